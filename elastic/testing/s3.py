"""A real S3 API server on loopback: moto in server mode, in its own process, driven by s3fs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import s3fs

from elastic.testing.loopback import free_port

# Dummy credentials for the loopback server; set before the session's Ray starts, so the
# rank actors inherit them the way they would inherit a node's real AWS environment.
TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}


class MotoServer:
    def __init__(self, bucket: str = "elastic-test"):
        self.port = free_port()
        self.bucket = bucket
        self.process: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        """Start (or restart on the same port) and create the bucket: moto keeps no state."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        # exist_ok: on a restart, a rank's checkpoint write may recreate the bucket first.
        self.filesystem().makedirs(self.bucket, exist_ok=True)
        return self

    def for_bucket(self, bucket: str) -> MotoServer:
        """This server through another bucket, created now: tests share the process and keep
        their data apart. Stopping or freezing the process stays its owner's business."""
        view = MotoServer(bucket)
        view.port = self.port
        view.filesystem().makedirs(bucket, exist_ok=False)
        return view

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.process.send_signal(signal.SIGCONT)

    def filesystem(self) -> s3fs.S3FileSystem:
        return s3fs.S3FileSystem(
            client_kwargs={"endpoint_url": self.endpoint_url}, skip_instance_cache=True,
            key=TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"], secret=TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        )

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])


def set_test_credentials() -> None:
    for key, value in TEST_CREDENTIALS.items():
        os.environ.setdefault(key, value)

"""``ray job submit`` against a real head started with ``ray start``: a short run succeeds and its
logs show progress; submitting the same run again resumes it; the head is stopped at the end.

The head is private to this test (its own temp dir, ports and auth token), so it never meets the
session's Ray instance from tests/conftest.py. It runs under ``ray start --block`` and is stopped
by signalling that process, which shuts down exactly the processes it started: ``ray stop`` would
kill every Ray process on the machine, other tests' and other users' included.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.loopback import free_port

REPO = Path(__file__).resolve().parents[1]
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# Keep the upload small: the CI virtualenv lives in the repository.
RUNTIME_ENV = {"excludes": [".git", ".venv", "runs", ".pytest_cache", "**/__pycache__", "*.egg-info"]}


def processes_mentioning(*markers: str) -> list[int]:
    """Pids whose command line mentions one of ``markers`` (paths only this test uses)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or not a process
            continue
        if proc.name.isdigit() and int(proc.name) != os.getpid() and any(m in cmdline for m in markers):
            pids.append(int(proc.name))
    return pids


class RayHead:
    def __init__(self, temp_dir: str):
        self.temp_dir = temp_dir
        self.dashboard = f"http://127.0.0.1:{free_port()}"
        token = secrets.token_hex(32)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
            # `python` in the job's entrypoint is this interpreter, with the package installed.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
        }
        self.headers = {"Authorization": f"Bearer {token}"}
        ports = {
            flag: str(free_port())
            for flag in ("--port", "--node-manager-port", "--object-manager-port", "--ray-client-server-port",
                         "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--runtime-env-agent-port",
                         "--metrics-export-port")
        }
        self.log_path = Path(temp_dir) / "head.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [*RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--num-cpus", "4",
                 "--temp-dir", temp_dir, "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
                 "--dashboard-port", self.dashboard.rsplit(":", 1)[1], "--min-worker-port", "0",
                 "--max-worker-port", "0", "--disable-usage-stats", *(x for pair in ports.items() for x in pair)],
                stdout=log, stderr=subprocess.STDOUT, env=self.env,
            )
        self.wait_until_ready(timeout=120)

    def wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"ray start exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                request = urllib.request.Request(f"{self.dashboard}/api/jobs/", headers=self.headers)
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"the job server at {self.dashboard} did not come up:\n{self.log_path.read_text()}")

    def submit(self, *train_args: str) -> str:
        """``ray job submit`` of ``python -m elastic train ...``; returns the job's logs."""
        command = [*RAY, "job", "submit", "--address", self.dashboard, "--working-dir", str(REPO),
                   "--runtime-env-json", json.dumps(RUNTIME_ENV), "--", "python", "-m", "elastic", "train", *train_args]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=400)
        output = done.stdout + done.stderr
        assert done.returncode == 0 and "succeeded" in output, f"ray job submit failed:\n{output}"
        return output

    def stop(self) -> list[int]:
        """Stop the head's processes; returns those that outlived it (and were then killed)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)  # it drains for up to 30 s
        except subprocess.TimeoutExpired:
            self.process.kill()
        leftovers = processes_mentioning(self.temp_dir)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        return leftovers


@pytest.fixture
def ray_head():
    # Short, because Ray's unix socket paths live under it (about 107 bytes at most).
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    head = RayHead(temp_dir)
    yield head
    leftovers = head.stop()
    shutil.rmtree(temp_dir, ignore_errors=True)
    assert not leftovers, f"processes of the test's Ray head outlived it: {leftovers}"


def test_submit_then_resubmit_resumes(ray_head, tmp_path):
    storage = tmp_path / "runs"
    args = ["--groups", "1", "--shard", "1", "--tp", "1", "--storage", str(storage), "--run-name", "submitted",
            "--checkpoint-every", "3"]
    summary_path = storage / "submitted" / "summary.json"

    first = ray_head.submit("--steps", "6", *args)
    assert "6/6" in first, f"no progress in the job's logs:\n{first}"
    assert "run submitted: completed; 6 steps committed" in first
    assert json.loads(summary_path.read_text())["resumed_from_step"] is None

    second = ray_head.submit("--steps", "10", *args)
    assert "10/10" in second, f"no progress in the job's logs:\n{second}"
    summary = json.loads(summary_path.read_text())
    assert summary["resumed_from_step"] == 6, "the second submission did not resume from the first's checkpoint"
    assert summary["steps_committed"] == 4
    assert [record["step"] for record in summary["steps"]] == [6, 7, 8, 9]

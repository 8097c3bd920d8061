"""The Ray head's GCS lost mid-run and started again: with GCS fault tolerance (its tables in a
real Redis server, as docs/operations.md's "What survives what" sets it up for ``ray start`` and
KubeRay), the ranks keep training through the outage, on the steady path that no Ray call is
on, and the run completes with the clean run's losses and no rank restarted. Without Redis the
same outage ends the driver (measured by hand; the same page says so).

.ci/run installs the Debian package ``redis-server``; without the binary the test is skipped.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from elastic.core.events import EventKind
from elastic.testing.loopback import free_port, wait_for
from elastic.testing.losses import max_relative_difference
from elastic.testing.ray_head import RayHead
from tests.tiny import tiny_config

REDIS = shutil.which("redis-server")
pytestmark = [
    pytest.mark.skipif(REDIS is None, reason="no redis-server on PATH: install the Debian package redis-server "
                                             "(.ci/run does)"),
    pytest.mark.waits,  # a Ray head, a Redis and a driver of their own; the outage
]

DOWN_S = 4.0  # the GCS's outage
STEPS = 800  # the run goes on for seconds after the GCS is back


class RedisServer:
    """One ``redis-server`` on 127.0.0.1, in memory only (the GCS's tables live as long as it)."""

    def __init__(self, directory: Path):
        self.address = f"127.0.0.1:{free_port()}"
        host, port = self.address.split(":")
        self.process = subprocess.Popen(
            [REDIS, "--bind", host, "--port", port, "--save", "", "--appendonly", "no", "--dir", str(directory)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_for(self.answers, 30, "redis-server to answer", interval=0.05)

    def answers(self) -> bool:
        host, port = self.address.split(":")
        try:
            with socket.create_connection((host, int(port)), timeout=1) as connection:
                connection.sendall(b"PING\r\n")
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture
def head_with_redis(tmp_path):
    redis = RedisServer(tmp_path)
    try:
        head = RayHead(num_cpus=4, gcs_redis=redis.address)
        try:
            yield head
        finally:
            head.stop()
    finally:
        redis.stop()


def start_driver(head: RayHead, tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    """``elastic train`` of the tiny job in a process of its own joined to ``head``, as under
    ``ray job submit``; the process and the run's directory."""
    config = tiny_config(tmp_path, groups=2, steps=STEPS, checkpoint__every=100, run_name=name)
    config_file = tmp_path / f"{name}.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    with open(tmp_path / f"{name}.log", "w") as log:
        driver = subprocess.Popen([sys.executable, "-m", "elastic", "train", "--quiet", "--config", str(config_file)],
                                  cwd=tmp_path, env=head.driver_env(), stdout=log, stderr=subprocess.STDOUT)
    return driver, tmp_path / "runs" / name


def finished(driver: subprocess.Popen, tmp_path: Path, name: str) -> dict:
    try:
        assert driver.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        if driver.poll() is None:
            driver.kill()
    return json.loads((tmp_path / "runs" / name / "summary.json").read_text())


def test_the_gcs_killed_and_started_again_mid_run_costs_no_step_and_no_rank(head_with_redis, tmp_path):
    clean = finished(start_driver(head_with_redis, tmp_path, "clean")[0], tmp_path, "clean")
    driver, run = start_driver(head_with_redis, tmp_path, "job")
    wait_for((run / "checkpoints" / "step-00000100" / "manifest.json").exists, 300, "the run's first checkpoint",
             interval=0.05)
    killed = time.time()
    head_with_redis.restart_gcs(DOWN_S)
    summary = finished(driver, tmp_path, "job")
    kinds = [event["kind"] for event in summary["events"]]
    # no rank failed, none restarted: the two groups built once, at the start
    assert kinds.count(EventKind.GROUP_BUILT) == 2 and EventKind.RANK_FAILED not in kinds, kinds
    assert summary["steps_committed"] == STEPS and summary["steps_discarded"] == 0
    # the ranks trained on while the GCS was down (the summary's times are when the driver
    # heard of each step, from the leg's start; the ranks send their records about once a
    # second, and the summary is written as the leg ends)
    leg_started = (run / "summary.json").stat().st_mtime - summary["wall_s"]
    outage = (killed - leg_started + 0.5, killed - leg_started + DOWN_S - 0.5)
    assert sum(outage[0] <= step["t"] <= outage[1] for step in summary["steps"]) >= 5, outage
    # Over hundreds of steps, sums in another order than one process's part ways by more than
    # ulps (1e-5 up to step 240, 4 % by step 1200, as Adam carries them on); a run on the same
    # ranks does not.
    assert max_relative_difference(summary["losses"], clean["losses"]) <= 1e-5

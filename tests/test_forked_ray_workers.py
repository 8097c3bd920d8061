"""The launcher Ray starts for the test run's workers (elastic/testing/forked_ray_workers.py) stands
in for the worker it has forked: the worker gets the launcher's argv, environment, working
directory and streams; the launcher exits as the worker did, passes signals on, and a
launcher killed outright takes its worker with it. The head starts a job's workers that way
unless the job has a runtime env of its own."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys

import ray

from elastic.testing.loopback import wait_for
from tests.processes import alive

PROBE = """
import json, os, sys, time
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "value": os.environ.get("PROBE_VALUE"),
                  "pid": os.getpid()}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "die":
    os._exit(int(sys.argv[2]))
time.sleep(120)
"""


def launch(ray_head, tmp_path, *args: str) -> subprocess.Popen:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    command = shlex.split(ray_head.worker_launcher) + [str(script), *args]
    return subprocess.Popen(command, cwd=tmp_path, env=dict(os.environ, PROBE_VALUE="passed on"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_worker_runs_in_the_launchers_setting_and_the_launcher_exits_as_it_did(ray_head, tmp_path):
    for args, code in ((("exit", "3"), 3), (("die", "7"), 7), (("exit", "0"), 0)):
        launcher = launch(ray_head, tmp_path, *args)
        out, err = launcher.communicate(timeout=60)
        assert launcher.returncode == code, (out, err)
        seen = json.loads(out)
        assert seen["argv"] == [str(tmp_path / "probe.py"), *args], seen
        assert seen["cwd"] == str(tmp_path) and seen["value"] == "passed on", seen
        assert seen["pid"] != launcher.pid  # forked by the server, not the launcher itself
        assert err == "to stderr\n"


def test_signals_reach_the_worker_and_a_launcher_killed_outright_takes_it_along(ray_head, tmp_path):
    launcher = launch(ray_head, tmp_path, "wait")
    worker = json.loads(launcher.stdout.readline())["pid"]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=60) == -signal.SIGTERM
    wait_for(lambda: not alive(worker), 30, "the worker to end on the SIGTERM passed on")

    launcher = launch(ray_head, tmp_path, "wait")
    worker = json.loads(launcher.stdout.readline())["pid"]
    launcher.kill()
    launcher.wait(timeout=60)
    wait_for(lambda: not alive(worker), 30, "the worker to follow its launcher killed outright")


@ray.remote(num_cpus=0)
class Probe:
    def start(self) -> tuple[int, bool]:
        return os.getppid(), "torch" in sys.modules


def test_the_heads_workers_fork_from_the_server_unless_their_job_has_a_runtime_env(ray_cluster, ray_head):
    for options, forked in (({}, True), ({"runtime_env": {"env_vars": {"PROBE_VALUE": "set"}}}, False)):
        probe = Probe.options(**options).remote()
        try:
            parent, torch_loaded = ray.get(probe.start.remote(), timeout=120)
        finally:
            ray.kill(probe)
        assert (parent == ray_head.fork_server.pid, torch_loaded) == (forked, forked), options

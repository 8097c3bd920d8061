"""A Ray head of its own for the tests and the benchmarks that outlive a driver: ``ray start
--head`` on loopback, with its own temp dir, ports and auth token; with Ray's dashboard, whose
job API ``ray job submit`` talks to, only where it is asked for (tests/test_ray_job.py). Each
test lane runs one (tests/conftest.py), and ``bench/driver_loss.py`` one whose drivers it kills.

It runs under ``ray start --block`` and is stopped by signalling that process, which shuts
down exactly the processes it started: ``ray stop`` would kill every Ray process on the
machine, other users' included. A head whose GCS a Redis backs runs without ``--block`` (which
would end the head once its GCS dies) and is stopped process by process, as ``ray stop`` stops
them, but only its own. ``add_node`` joins a further node to it, as a cluster grows.
Beside it runs the server its jobs' workers fork from (elastic/testing/forked_ray_workers.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from elastic.testing import forked_ray_workers
from elastic.testing.loopback import free_port

RAY = [sys.executable, "-m", "ray.scripts.scripts"]
# ``ray start`` with the ``python`` its raylet starts workers with in argv[1]: Ray builds that
# command from ``sys.executable``.
RAY_START_WITH_WORKER_PYTHON = [
    sys.executable, "-c",
    "import sys; from ray.scripts.scripts import main; sys.executable = sys.argv.pop(1); sys.argv[0] = 'ray'; main()"]
# Tries at starting a node, the head or an added one: a ``ray start`` that exits before its node
# is up (one of the free ports it was handed, taken meanwhile by another process of this busy
# machine; the dashboard not up within Ray's own 60 s) is started again on fresh ports.
NODE_STARTS = 3
# The processes of a node, each on a port of its own (several nodes share this machine).
NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")


def processes_mentioning(*markers: str) -> list[int]:
    """Pids whose command line mentions one of ``markers`` (paths only this head uses)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = " ".join(command_of(int(proc.name)))
        except OSError:  # gone meanwhile
            continue
        if any(m in cmdline for m in markers):
            pids.append(int(proc.name))
    return pids


def command_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def stop_block(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)  # it drains for up to 30 s
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class RayHead:
    def __init__(self, num_cpus: int, job_server: bool = False, timeout: float = 300.0,
                 gcs_redis: str | None = None):
        """Takes its token from this process's ``RAY_AUTH_TOKEN`` (see tests/conftest.py).
        ``job_server``: run Ray's dashboard, the job API at ``dashboard``. The lanes' heads run
        without it: the slowest process of a head's start, which failed a whole lane's on a
        loaded machine, for one test. ``timeout`` bounds a try that neither comes up nor exits.
        ``gcs_redis``: the GCS keeps its tables in the Redis server at this address (Ray's GCS
        fault tolerance), and the head runs without ``--block``, whose watch would end every
        process of the head once its GCS dies: ``restart_gcs`` kills the GCS and starts it again."""
        # Short, because Ray's unix socket paths live under it (about 107 bytes at most).
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.job_server = job_server
        token = os.environ["RAY_AUTH_TOKEN"]
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
            # `python` in a job's entrypoint is this interpreter, with the package installed.
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
            # The ranks are this head's workers: gloo on loopback, one thread each on 2 cores.
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,
        }
        self.blocks = gcs_redis is None
        self.restarted: list[subprocess.Popen] = []  # the GCS servers restart_gcs started
        if gcs_redis:
            self.env |= {"RAY_REDIS_ADDRESS": gcs_redis, "RAY_external_storage_namespace": Path(self.temp_dir).name}
        self.headers = {"Authorization": f"Bearer {token}"}
        self.nodes: list[subprocess.Popen] = []
        # Workers started with ``worker_python`` (this head's, for a job without a runtime env) or
        # with ``worker_launcher`` as their job's py_executable fork from this server.
        self.fork_socket = Path(self.temp_dir) / "fork.sock"
        self.worker_launcher = forked_ray_workers.launch_command(str(self.fork_socket))
        self.worker_python = str(Path(self.temp_dir) / "python")
        forked_ray_workers.write_worker_python(self.worker_python, str(self.fork_socket))
        with open(Path(self.temp_dir) / "fork-server.log", "w") as log:
            self.fork_server = forked_ray_workers.start_server(str(self.fork_socket), log, self.env)
        try:
            self.process = self._start_head(num_cpus, timeout)
        except BaseException:
            stop_block(self.fork_server)
            raise

    def _start_head(self, num_cpus: int, timeout: float) -> subprocess.Popen:
        """The head's ``ray start``, once it is up; started again on fresh ports when it exits
        first, at most ``NODE_STARTS`` times; the error names each try's log."""
        ended = []
        for attempt in range(NODE_STARTS):
            log_name = f"head-{attempt}.log"
            self.gcs_address = f"127.0.0.1:{free_port()}"
            self.dashboard = f"http://127.0.0.1:{free_port()}"
            process = self._start_node(
                log_name, self.blocks, "--head", "--port", self.gcs_address.rsplit(":", 1)[1], "--num-cpus", str(num_cpus),
                "--temp-dir", self.temp_dir, f"--include-dashboard={str(self.job_server).lower()}",
                "--dashboard-host", "127.0.0.1", "--dashboard-port", self.dashboard.rsplit(":", 1)[1],
                "--ray-client-server-port", str(free_port()),
            )
            if self._came_up(process, log_name, timeout):
                return process
            ended.append(f"{log_name} (exit {process.returncode}):\n{self.log(log_name)[-3000:]}")
        raise AssertionError("the head's ray start exited every time:\n" + "\n".join(ended))

    def _start_node(self, log_name: str, block: bool, *args: str) -> subprocess.Popen:
        ports = [x for flag in NODE_PORTS for x in (flag, str(free_port()))]
        with open(Path(self.temp_dir) / log_name, "w") as log:
            return subprocess.Popen(
                [*RAY_START_WITH_WORKER_PYTHON, self.worker_python, "start", *(["--block"] if block else []),
                 "--node-ip-address", "127.0.0.1", "--min-worker-port", "0", "--max-worker-port", "0", "--disable-usage-stats", *ports,
                 *args],
                stdout=log, stderr=subprocess.STDOUT, env=self.env,
            )

    def _came_up(self, process: subprocess.Popen, log_name: str, timeout: float) -> bool:
        """Waits until the head is up: its ``ray start`` has written the cluster's address, this
        try's GCS port, into the temp dir (it does once every process of the node runs; the host
        it writes is the machine's, not loopback), the fork server listens and, on a job server,
        the job API answers. False if ``ray start`` exits first."""
        address_file = Path(self.temp_dir) / "ray_current_cluster"
        port = self.gcs_address.rsplit(":", 1)[1]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None and (self.blocks or process.returncode != 0):
                return False
            if self.fork_server.poll() is not None:
                stop_block(process)
                raise AssertionError(f"the fork server exited:\n{self.log('fork-server.log')}")
            if (self.fork_socket.exists() and address_file.exists() and address_file.read_text().endswith(f":{port}")
                    and (not self.job_server or self._job_api_answers())):
                return True
            time.sleep(0.1)
        stop_block(process)
        raise AssertionError(f"the head's ray start neither came up nor exited within {timeout:.0f}s:\n"
                             f"{self.log(log_name)[-3000:]}")

    def _job_api_answers(self) -> bool:
        request = urllib.request.Request(f"{self.dashboard}/api/jobs/", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    def forking_env(self) -> dict[str, str]:
        """The environment of a driver process that starts a Ray of its own, whose workers fork
        from this head's server as the test run's own do."""
        return dict(os.environ, **forked_ray_workers.driver_env(str(self.fork_socket)))

    def driver_env(self) -> dict[str, str]:
        """The environment of a driver process that joins this head, as under ``ray job submit``;
        the head's workers fork from its server already."""
        return dict(os.environ, RAY_ADDRESS=self.gcs_address)

    def log(self, name: str) -> str:
        return (Path(self.temp_dir) / name).read_text()

    def add_node(self, num_cpus: int, timeout: float = 120.0) -> subprocess.Popen:
        """Starts a node that joins this head, and returns once the cluster counts it alive. A
        node whose ``ray start`` exits before that (one of the free ports it was handed, taken
        meanwhile by another process of this busy machine, ends its raylet) is started again
        on fresh ports, at most ``NODE_STARTS`` times; the error names each try's log."""
        import ray

        def alive() -> int:
            return sum(node["Alive"] for node in ray.nodes())

        before, ended = alive(), []
        for attempt in range(NODE_STARTS):
            log_name = f"node-{len(self.nodes)}-{attempt}.log"
            node = self._start_node(log_name, True, "--address", self.gcs_address, "--num-cpus", str(num_cpus))
            self.nodes.append(node)
            deadline = time.monotonic() + timeout
            while node.poll() is None and time.monotonic() < deadline:
                if alive() > before:
                    return node
                time.sleep(0.25)
            if node.poll() is None:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for the added node to register:\n"
                                     f"{self.log(log_name)[-3000:]}")
            self.nodes.remove(node)
            ended.append(f"{log_name} (exit {node.returncode}):\n{self.log(log_name)[-3000:]}")
        raise AssertionError("the added node's ray start exited every time:\n" + "\n".join(ended))

    def remove_node(self, node: subprocess.Popen) -> None:
        stop_block(node)
        self.nodes.remove(node)

    def restart_gcs(self, down_s: float) -> None:
        """Kill the head's GCS server (SIGKILL, as an out-of-memory kill would) and start it
        again with the same command line and environment after ``down_s``."""
        [pid] = [pid for pid in processes_mentioning(self.temp_dir) if command_of(pid)[0].endswith("gcs_server")]
        command = command_of(pid)
        environment = dict(entry.split("=", 1) for entry in
                           Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in entry)
        os.kill(pid, signal.SIGKILL)
        time.sleep(down_s)
        self.restarted.append(subprocess.Popen(command, env=environment, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True))

    def _end_processes(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL past ``grace_s``, as ``ray stop`` ends a node (a GCS backed by
        Redis, the raylet and the autoscaler's monitor outlive a SIGTERM)."""
        for pid in processes_mentioning(self.temp_dir):
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and processes_mentioning(self.temp_dir):  # a zombie mentions nothing
            time.sleep(0.1)
        for pid in processes_mentioning(self.temp_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in [self.process, *self.restarted]:
            if process.poll() is None:
                process.kill()
            process.wait()

    def stop(self) -> list[int]:
        """Stop the nodes, then the head; returns the processes that outlived them (and were
        then killed)."""
        for node in list(self.nodes):
            self.remove_node(node)
        if self.blocks:
            stop_block(self.process)
        else:  # nothing watches the head's processes: each is asked to end, as ``ray stop`` asks
            self._end_processes()
        stop_block(self.fork_server)
        leftovers = processes_mentioning(self.temp_dir)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return leftovers

"""Ray worker processes forked from one that has already imported torch.

A rank actor's process spends about 3.3 of its 4 CPU-seconds of start-up importing torch,
DTensor, DCP, ``torch._dynamo`` and the rank's code: over the suite's few hundred rank
actors, about half the suite's CPU. The test run's head (``elastic/testing/ray_head.py``) starts a
server that imports torch's part once (``start_server``), and its nodes' raylets start their
workers with a ``python`` that sends Ray's default worker through this file's launcher
(``write_worker_python``). So each worker of a job without a runtime env (the test run's own
driver, and the CLI drivers a test joins to the head) is forked from that server, then runs
Ray's own ``default_worker.py`` unchanged: Ray, the actors and the runs are all real, only
the imports are shared. A driver that starts a Ray of its own (bench/gpu_check.py's parts,
bench/failure_cost.py, whose 64 rank processes fit 24 GB only so) names the launcher as its
job's ``py_executable`` through Ray's ``RAY_RUNTIME_ENV_HOOK`` (``driver_env``). Jobs with a
runtime env of their own (``ray job submit --working-dir``) and tests/test_listeners.py's local
run keep Ray's plain start-up, so that path stays covered.

The launcher is what Ray starts and watches. It hands the server its argv, environment,
working directory and standard streams, waits for the forked worker and exits with its
status; signals it gets go to the worker, and if it is killed outright the worker follows
(its lifeline pipe closes). The server runs no threads, so a fork copies no lock mid-use.

    python -I -S elastic/testing/forked_ray_workers.py launch SOCKET default_worker.py ARGS...
    python elastic/testing/forked_ray_workers.py serve SOCKET
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import subprocess
import sys

# The part of torch a rank imports on its way to its first step (elastic.testing.preload's:
# torch._dynamo too, which the first optimizer and DTensor's first distribute_tensor import,
# about 1 CPU-second), and the rank's own modules, short of Ray: Ray's library reads the
# worker's job id from the environment as it loads, so each worker loads it, and the rank's
# modules that import it, itself (0.4 CPU-s).
RANK_MODULES = ("checkpointing.rank_io", "checkpointing.healing", "checkpointing.pretrained",
                "workers.model_build", "workers.step_transaction", "workers.world")
_FDS = 4  # stdin, stdout, stderr, the lifeline
SOCKET = "ELASTIC_TEST_FORK_SOCKET"  # where a driver's runtime_env_hook finds the server
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def launch_command(socket_path: str) -> str:
    """The ``py_executable`` that has Ray's workers forked from the server at ``socket_path``."""
    return f"{sys.executable} -I -S {os.path.abspath(__file__)} launch {socket_path}"


def write_worker_python(path: str, socket_path: str) -> None:
    """Writes at ``path`` the ``python`` a node's raylet starts its workers with: Ray's default
    worker goes through the launcher, anything else (``setup_worker.py`` for a job with a
    runtime env, Ray's agents) runs as this interpreter. A job without a runtime env then
    skips ``setup_worker.py``, an interpreter of its own that imports Ray (0.45 CPU-s a worker)."""
    with open(path, "w") as script:
        script.write(f'#!/bin/sh\ncase "$1" in\n  */default_worker.py) exec {launch_command(socket_path)} "$@" ;;\n'
                     f'esac\nexec {sys.executable} "$@"\n')
    os.chmod(path, 0o700)


def start_server(socket_path: str, log, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The server at ``socket_path``, its output to ``log``; it listens once its imports are done
    (a few seconds), and a launcher that comes earlier finds no socket."""
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", socket_path],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """Ray's ``RAY_RUNTIME_ENV_HOOK`` for a driver that starts a Ray of its own."""
    return {**(runtime_env or {}), "py_executable": launch_command(os.environ[SOCKET])}


def driver_env(socket_path: str) -> dict[str, str]:
    """What a driver process adds to its environment for its workers to fork from the server."""
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {"RAY_RUNTIME_ENV_HOOK": f"elastic.testing.forked_ray_workers.{runtime_env_hook.__name__}",
            SOCKET: socket_path, "PYTHONPATH": path}


def _send(connection: socket.socket, payload: bytes, fds: list[int]) -> None:
    message = struct.pack("!I", len(payload)) + payload
    connection.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise EOFError("the other end closed")
        data += chunk
    return data


# the launcher (stdlib only: it starts with -I -S, in about 20 ms)

def launch(socket_path: str, argv: list[str]) -> int:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(socket_path)
    lifeline_read, _lifeline_write = os.pipe()  # the write end stays open as long as this process lives
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    _send(connection, request, [0, 1, 2, lifeline_read])
    os.close(lifeline_read)
    pid = struct.unpack("!i", _receive_exactly(connection, 4))[0]

    def pass_on(number: int, _frame) -> None:
        try:
            os.kill(pid, number)
        except ProcessLookupError:  # it has just ended; its status is on its way
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, pass_on)
    status = struct.unpack("!i", _receive_exactly(connection, 4))[0]
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    return os.waitstatus_to_exitcode(status)


# the server

def serve(socket_path: str) -> None:
    import importlib
    import selectors

    from elastic.testing.preload import TORCH_PRELOADED

    for module in (*TORCH_PRELOADED, *RANK_MODULES):
        importlib.import_module(module)
        if "ray" in sys.modules:
            sys.exit(f"{module} imports ray, which a forked Ray worker must load itself: leave it out of RANK_MODULES")
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}  # a forked worker's pid -> its launcher
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    try:
        while True:
            for key, _ in selector.select():
                if key.fileobj is listener:
                    connection, _ = listener.accept()
                    pid = _fork_worker(connection, [listener.fileno(), selector.fileno(), wake_read, wake_write,
                                                    *(c.fileno() for c in waiting.values())])
                    if pid is not None:
                        waiting[pid] = connection
                else:
                    os.read(wake_read, 4096)
            _reap(waiting)
    finally:
        os.unlink(socket_path)


def _reap(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = waiting.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(struct.pack("!i", status))
            except OSError:  # its launcher is gone
                pass
            connection.close()


def _fork_worker(connection: socket.socket, server_fds: list[int]) -> int | None:
    try:
        header, ancillary, _, _ = connection.recvmsg(4, socket.CMSG_SPACE(_FDS * array.array("i").itemsize))
        fds = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        request = json.loads(_receive_exactly(connection, struct.unpack("!I", header)[0]))
    except (OSError, EOFError, ValueError, struct.error):
        connection.close()
        return None
    pid = os.fork()
    if pid == 0:
        try:
            _become_worker(request, list(fds), [connection.fileno(), *server_fds])
        finally:
            os._exit(1)
    for fd in fds:
        os.close(fd)
    try:
        connection.sendall(struct.pack("!i", pid))
    except OSError:  # the launcher is gone: its lifeline closed, and the worker ends itself
        pass
    return pid


def _become_worker(request: dict, fds: list[int], server_fds: list[int]) -> None:
    import runpy
    import threading

    # A group of its own, as Ray gives each worker it starts: Ray ends a worker by signalling
    # its process group, which would otherwise be the test run's.
    os.setsid()
    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd in server_fds:
        os.close(fd)
    stdin, stdout, stderr, lifeline = fds
    for source, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(source, target)
        os.close(source)
    # The launcher killed outright (Ray's last resort) takes its worker with it.
    threading.Thread(target=lambda: (os.read(lifeline, 1), os.kill(os.getpid(), signal.SIGKILL)), daemon=True).start()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *sys.path[1:]]
    sys.argv[:] = request["argv"]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "launch":
        sys.exit(launch(sys.argv[2], sys.argv[3:]))
    serve(sys.argv[2])

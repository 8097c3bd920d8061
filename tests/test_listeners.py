"""What a local run listens on, read from the kernel while it trains (docs/operations.md: "What
listens where"): the product's own listeners (the rendezvous store, the metrics endpoint) on loopback
only, and every listener beyond loopback one of Ray's own processes, which Ray 2.60 binds to
every interface."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import sys

import pytest

from elastic.testing.loopback import free_port, wait_for

pytestmark = pytest.mark.waits  # a Ray of its own starts

LISTEN = "0A"


def _address(hex_address: str) -> str:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        text = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    else:  # four little-endian words
        text = socket.inet_ntop(socket.AF_INET6, b"".join(struct.pack("<I", int(host[i:i + 8], 16))
                                                          for i in range(0, 32, 8)))
    return f"{text}:{int(port, 16)}"


def listening_sockets() -> dict[int, str]:
    """Each listening TCP socket's inode and local address."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == LISTEN:
                    found[int(fields[9])] = _address(fields[1])
    return found


def owners(inodes: set[int]) -> dict[int, tuple[int, str, str]]:
    """inode -> (pid, comm, command line) of the processes holding those sockets."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and int(target[8:-1]) in inodes:
                    with open(f"/proc/{pid}/comm") as comm, open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                        found[int(target[8:-1])] = (int(pid), comm.read().strip(),
                                                    cmdline.read().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:  # gone, or not ours to read
            continue
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host == "::1"


def is_rays(comm: str, cmdline: str) -> bool:
    return comm in ("gcs_server", "raylet") or comm.startswith("ray::") or "/ray/" in cmdline


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(parent, []).append(int(pid))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def test_a_local_run_listens_beyond_loopback_only_in_rays_own_processes(tmp_path):
    """`elastic train` starting its own Ray, its listeners read mid-run."""
    metrics_port = free_port()
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-m", "elastic", "train", "--quiet", "--run-name", "listening",
                               "--steps", "400", "--groups", "1", "--shard", "2", "--tp", "1", "--checkpoint-every", "2",
                               "--metrics-port", str(metrics_port)],
                              cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: (tmp_path / "runs" / "listening" / "checkpoints" / "step-00000002" / "manifest.json").exists(),
                 240, "the run's first checkpoint")
        sockets = listening_sockets()
        tree = descendants(driver.pid)
        seen = [(sockets[inode], pid, comm, cmdline) for inode, (pid, comm, cmdline) in owners(set(sockets)).items()
                if pid in tree]
    finally:
        driver.send_signal(signal.SIGTERM)
        driver.wait(120)
    own = [(address, comm) for address, pid, comm, _ in seen if pid == driver.pid]
    assert f"127.0.0.1:{metrics_port}" in [address for address, _ in own], own
    # The driver process also holds Ray's core worker, which Ray binds to every interface; the
    # rendezvous store and the metrics endpoint beside it are on loopback.
    assert len([address for address, _ in own if not is_loopback(address)]) <= 1, own
    strangers = [entry for entry in seen
                 if entry[1] != driver.pid and not is_loopback(entry[0]) and not is_rays(entry[2], entry[3])]
    assert not strangers, f"listeners beyond loopback that are not Ray's: {strangers}"
    assert any(comm == "gcs_server" for _, _, comm, _ in seen)  # Ray's own were seen, and allowed for

"""What the tests read of a process by its pid, from /proc."""

from __future__ import annotations


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: neither gone nor dead and left for whoever adopted it to reap."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False

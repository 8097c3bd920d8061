"""Helpers for the tests' own servers, all on 127.0.0.1."""

from __future__ import annotations

import socket
import time


# Every port given out: a caller takes several before binding any (a Ray node's components,
# each on one), and the kernel may hand the same free port out twice in a row.
_GIVEN: set[int] = set()


def free_port() -> int:
    """A port free now on loopback, and never one this process was given before."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def own_outside_address() -> str:
    """This machine's address on its outward interface, to knock on our listeners as an
    outsider would (a UDP connect picks the route and sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))
        return probe.getsockname()[0]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.25):
    """Poll until ``predicate()`` is truthy and return its value; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")

"""The rendezvous of the run's process groups: a TCPStore the driver hosts."""

from __future__ import annotations

import secrets
import socket
from dataclasses import dataclass

import ray
import torch.distributed as dist

from workers.attempt_watch import attempt_over_key
from workers.keyed_store import KeyedStore
from workers.segment_handoff import next_segment_key


@dataclass
class Rendezvous:
    """The TCPStore every process group rendezvouses on, hosted by the driver.

    It listens only on the address the ranks reach the driver at: loopback for a local run
    (a Ray the driver started), the driver node's address on a cluster. torch's store
    server takes no bind address, so it is handed a socket bound there. It has no
    authentication either, and any client that reaches the port can list every key: the
    ranks bind each key and value to a secret that reaches them only through Ray
    (``workers.keyed_store``), so a client without it finds nothing usable and can plant
    nothing a rank trusts. The NetworkPolicy in ``deploy/kuberay`` keeps other pods from
    connecting at all.
    """

    host: str
    store: dist.TCPStore
    secret: str  # hex

    @classmethod
    def start(cls, host: str | None = None) -> Rendezvous:
        host = host or ray.util.get_node_ip_address()
        family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True,
                              master_listen_fd=listener.detach())
        return cls(host, store, secrets.token_hex(32))

    @property
    def port(self) -> int:
        return self.store.port

    def end_attempt(self, attempt: int) -> None:
        """Set ``attempt``'s key, as the ranks read it (bound to the run's secret): every rank
        still in it stops, and every rank's watch of it ends (``workers.attempt_watch``)."""
        KeyedStore(self.store, self.secret).set(attempt_over_key(attempt), "")

    def hand_off(self, attempt: int, release: int, word: bytes) -> None:
        """Write the ``release``-th word to the ranks that wait after ``attempt``
        (``workers.segment_handoff``): one key, however many ranks read it."""
        KeyedStore(self.store, self.secret).set(next_segment_key(attempt, release), word)

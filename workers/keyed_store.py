"""The run's view of the rendezvous store: keys and values bound to the run's secret.

torch's TCPStore has no authentication, and any client that reaches its port can list every
key (``list_keys``), then read or overwrite any of them. So no key or value of the run is
stored as itself:

- a key is stored as ``HMAC(secret, key)``: a listing shows digests that name no group,
  build, generation or rank, and the keys of the next build cannot be guessed from them;
- a value written with ``set`` or ``compare_set`` carries ``HMAC(secret, key, value)``, and
  ``get`` refuses a value whose tag does not match, so a client without the secret cannot
  plant an address or an NCCL id that a rank would trust (``StoreTampered``). Values are
  sealed, not hidden: what they hold (the ranks' listening addresses) is what a port scan of
  the cluster's network finds anyway.

Keep a reference to it for as long as torch uses it: torch holds only the C++ half, and
calls into a store whose Python half was collected fail ("Not implemented").

Counters (``add``) stay plain integers: the store adds to them server-side. torch reads them
only through ``add`` (its store-based barrier); a tampered counter can delay a rendezvous
until its timeout, a fault the run recovers from, but cannot make a rank trust anything.
"""

from __future__ import annotations

import hashlib
import hmac
from datetime import timedelta

import torch.distributed as dist

TAG_BYTES = 32


class StoreTampered(RuntimeError):
    """A rendezvous value without the run's tag: written by a client without the secret."""


class KeyedStore(dist.Store):
    def __init__(self, store: dist.Store, secret: str):
        super().__init__()
        self.store = store
        self.secret = bytes.fromhex(secret)

    def _key(self, key: str) -> str:
        return hmac.new(self.secret, key.encode(), hashlib.sha256).hexdigest()

    def _tag(self, key: str, value: bytes) -> bytes:
        return hmac.new(self.secret, len(key).to_bytes(4, "big") + key.encode() + value, hashlib.sha256).digest()

    def _sealed(self, key: str, value: str | bytes) -> bytes:
        value = value.encode() if isinstance(value, str) else bytes(value)
        return value + self._tag(key, value)

    def _opened(self, key: str, sealed: bytes) -> bytes:
        value, tag = sealed[:-TAG_BYTES], sealed[-TAG_BYTES:]
        if len(sealed) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(key, value)):
            raise StoreTampered(f"the rendezvous value of {key!r} was not written by this run "
                                "(a client without the run's secret reached the store)")
        return value

    def set(self, key: str, value) -> None:
        self.store.set(self._key(key), self._sealed(key, value))

    def get(self, key: str) -> bytes:
        return self._opened(key, self.store.get(self._key(key)))

    def compare_set(self, key: str, expected, desired) -> bytes:
        # torch's "expected empty" means "only if the key is absent": it stays empty
        sealed_expected = self._sealed(key, expected) if len(expected) else b""
        current = self.store.compare_set(self._key(key), sealed_expected, self._sealed(key, desired))
        return self._opened(key, current)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(self._key(key), amount)

    def check(self, keys: list[str]) -> bool:
        return self.store.check([self._key(key) for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        hashed = [self._key(key) for key in keys]
        if timeout is None:
            self.store.wait(hashed)
        else:
            self.store.wait(hashed, timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self.store.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.store.set_timeout(timeout)

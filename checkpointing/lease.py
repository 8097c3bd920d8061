"""One driver per run: a lease in the run's own storage.

Layout::

    <run>/lease/00000003.json   {"generation": 3, "holder": ..., "expires_at": ..., "released": false}

A driver acquires the run by creating the record of the next generation exclusively (an
``O_EXCL`` create locally, an ``If-None-Match: *`` PUT on S3): of two drivers that race, one
create succeeds and the other is refused. It is refused as well while the newest record is
live: not released and not past its expiry. The holder renews its own record well before it
expires, and a driver that dies stops renewing, so its lease ends ``ttl_s`` later.

A holder that sees a newer generation, or fails to renew before its own expiry, has lost the
run: it must commit nothing and delete nothing from then on (``ensure_held``). Expiry is
wall-clock time written by the holder, so the drivers' clocks must agree to well within
``ttl_s`` (NTP does that). Storage calls only, no Ray, no torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

from checkpointing.storage import StorageOptions, join_url

log = logging.getLogger("elastic.lease")

RECORD = re.compile(r"^(\d{8})\.json$")


class LeaseHeld(RuntimeError):
    """Another driver holds the run."""


class LeaseLost(RuntimeError):
    """This driver no longer holds the run: it must not commit or delete anything."""


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def default_holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} ({secrets.token_hex(3)})"


class RunLease:
    def __init__(self, run_url: str, options: StorageOptions, ttl_s: float, holder: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.root_url = join_url(run_url, "lease")
        self.options = options
        self.ttl_s = ttl_s
        self.holder = holder or default_holder()
        self.clock = clock
        self.generation: int | None = None
        self.expires_at = 0.0
        self.lost: str | None = None
        self._lock = threading.Lock()

    # storage

    def _path(self, root: str, generation: int) -> str:
        return f"{root}/{generation:08d}.json"

    def _generations(self, fs, root: str) -> list[int]:
        try:
            entries = fs.ls(root, detail=False)
        except FileNotFoundError:
            return []
        found = (RECORD.match(entry.rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
        return sorted(int(match.group(1)) for match in found if match)

    def _read(self, fs, root: str, generation: int) -> dict:
        return json.loads(fs.cat_file(self._path(root, generation)))

    def _write(self, fs, root: str, expires_at: float, released: bool) -> None:
        with fs.open(self._path(root, self.generation), "wb") as handle:
            handle.write(self._record(expires_at, released))

    def _record(self, expires_at: float, released: bool) -> bytes:
        return json.dumps({"generation": self.generation, "holder": self.holder,
                           "expires_at": expires_at, "released": released}).encode()

    def _create(self, fs, path: str, data: bytes) -> bool:
        """Create ``path`` only if it does not exist; False if another driver created it first."""
        try:
            if "://" in self.root_url:  # an If-None-Match PUT on S3; elsewhere the best the store offers
                fs.pipe_file(path, data, mode="create")
                return True
            fs.makedirs(os.path.dirname(path), exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        return True

    # protocol

    def acquire(self) -> int:
        """Take the run, or raise ``LeaseHeld`` naming the holder and when its lease ends."""
        fs, root = self.options.filesystem(self.root_url)
        generations = self._generations(fs, root)
        newest = generations[-1] if generations else 0
        if newest:
            record = self._read(fs, root, newest)
            now = self.clock()
            if not record["released"] and record["expires_at"] > now:
                raise LeaseHeld(
                    f"another driver holds this run: {record['holder']} (lease generation {newest}), until "
                    f"{_utc(record['expires_at'])} (in {record['expires_at'] - now:.0f} s) unless it renews. "
                    "Wait for it to end or stop it (ray job stop), or use another run name (--run-name)"
                )
        self.generation = newest + 1
        self.expires_at = self.clock() + self.ttl_s
        if not self._create(fs, self._path(root, self.generation), self._record(self.expires_at, False)):
            self.generation = None
            return self.acquire()  # another driver won this generation: its record now refuses us
        for old in generations[:-1]:  # keep the previous holder's record for the history
            fs.rm(self._path(root, old))
        return self.generation

    def renew(self) -> None:
        """Extend the lease; raises ``LeaseLost`` if it expired or another driver took the run."""
        with self._lock:
            self.ensure_held()
            fs, root = self.options.filesystem(self.root_url)
            newer = [g for g in self._generations(fs, root) if g > self.generation]
            if newer:
                self._lose(f"lease generation {newer[-1]} was taken by {self._read(fs, root, newer[-1])['holder']}")
            expires_at = self.clock() + self.ttl_s
            self._write(fs, root, expires_at, released=False)
            self.expires_at = expires_at

    def ensure_held(self) -> None:
        """Before a commit or a deletion: raise ``LeaseLost`` unless the lease is surely ours.
        An expired lease stays lost even if no one took it yet: one might be taking it now."""
        if self.lost:
            raise LeaseLost(self.lost)
        if self.clock() >= self.expires_at:
            self._lose(f"the lease expired at {_utc(self.expires_at)} before it could be renewed")

    def _lose(self, why: str) -> None:
        self.lost = f"this driver lost the run: {why}; it commits and deletes nothing more"
        raise LeaseLost(self.lost)

    def release(self) -> None:
        """End the lease now, so the next driver need not wait for it to expire."""
        if self.generation is None or self.lost:
            return
        with self._lock:
            fs, root = self.options.filesystem(self.root_url)
            self._write(fs, root, self.clock(), released=True)
            self.expires_at = self.clock()

    def keep_renewed(self, stop: threading.Event, on_lost: Callable[[str], None]) -> threading.Thread:
        """Renew every third of the TTL until ``stop``; a storage error is retried until the
        lease would expire, and a lost lease is reported once through ``on_lost``."""

        def renew_until_stopped() -> None:
            while not stop.wait(self.ttl_s / 3):
                try:
                    self.renew()
                except LeaseLost as error:
                    on_lost(str(error))
                    return
                except Exception as error:  # storage briefly down: the next round retries
                    log.warning("lease renewal failed, retrying: %s", error)

        thread = threading.Thread(target=renew_until_stopped, name="run-lease", daemon=True)
        thread.start()
        return thread

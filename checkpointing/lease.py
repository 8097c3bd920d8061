"""One driver per run: a lease in the run's own storage.

Layout::

    <run>/lease/00000003.json   {"generation": 3, "holder": ..., "expires_at": ..., "released": false}

A driver acquires the run by creating the record of the next generation exclusively (locally,
a hard link of a complete temporary file, which fails if the name exists; elsewhere an
``If-None-Match: *`` PUT): of two drivers that race, one create succeeds and the other is
refused. Not every S3-compatible server honours ``If-None-Match``, so a driver first creates
a probe object twice, and refuses to start (``LeaseUnsafe``) where the second create goes
through: there two drivers could both take the run. A driver is refused as well while the
newest record is live: not released and not past its expiry. The holder renews its own record
well before it expires, and a driver that dies stops renewing, so its lease ends ``ttl_s``
later, or at once for a next driver that can see the holder's process is gone: the record
names the holder's process (the machine's boot, the process table, its id and start time), and a
driver on the same boot and process table that finds no such process, only its zombie, or
another started at another time takes the run without waiting (``holder_gone``). A holder on
another machine or in another container, or whose process is there, is waited for.

Every write is whole or nothing (a temporary file renamed over the record locally, a single
PUT on S3): a crash mid-renewal leaves the previous record, never a truncated one. A record
that cannot be read all the same (damaged, written by hand) stops the next driver with
``LeaseCorrupt`` naming the file, and ``break_lease`` recovers the run when that is safe.

A holder that sees a newer generation, finds its own record naming another holder, or fails
to renew before its own expiry, has lost the run: it must commit nothing and delete nothing
from then on (``ensure_held``). Expiry is wall-clock time written by the holder, so the
drivers' clocks must agree to well within ``ttl_s`` (NTP does that). Storage calls only, no
Ray, no torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from fsspec.implementations.local import LocalFileSystem

from checkpointing.storage import StorageOptions, join_url

log = logging.getLogger("elastic.lease")

# Eight digits and more: generation 100,000,000 is 100000000.json, and still the newest.
RECORD = re.compile(r"^(\d{8,})\.json$")
FIELD_TYPES = {"generation": int, "holder": str, "expires_at": (int, float), "released": bool}
OPTIONAL_FIELD_TYPES = {"process": str}  # absent from an older driver's records


class LeaseRefused(RuntimeError):
    """This driver may not take the run; the message says why and what to do."""


class LeaseHeld(LeaseRefused):
    """Another driver holds the run."""


class LeaseCorrupt(LeaseRefused):
    """The newest lease record cannot be read, so whether a driver holds the run is unknown."""

    def __init__(self, url: str, problem: str):
        super().__init__(
            f"the run's lease record {url} is unreadable ({problem}); once no other driver of this run is "
            "running (its job stopped or gone), run again with --break-lease"
        )


class LeaseUnsafe(LeaseRefused):
    """The storage lets a second exclusive create through: it cannot keep one driver per run."""


class LeaseLost(RuntimeError):
    """This driver no longer holds the run: it must not commit or delete anything."""


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


# In /proc/<pid>/stat after the command's closing parenthesis: the state is the first field,
# the start time (clock ticks since boot) the twentieth.
STARTTIME = 19


def _stat_fields(pid: int) -> list[str] | None:
    """``pid``'s /proc stat fields after its command, or None: no such process here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].decode().split()
    except FileNotFoundError:
        return None


def process_identity(pid: int | None = None) -> str:
    """``pid``'s (this process's) name for as long as it lives: the machine's boot, the process
    table (PID namespace), the id and its start time; "" where /proc does not tell them."""
    pid = os.getpid() if pid is None else pid
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
        table = os.readlink("/proc/self/ns/pid")
        fields = _stat_fields(pid)
    except OSError:
        return ""
    return "" if fields is None else f"{boot_id}|{table}|{pid}|{fields[STARTTIME]}"


def default_holder() -> str:
    return f"{socket.gethostname()} pid {os.getpid()} ({secrets.token_hex(3)})"


def lease_url(run_url: str) -> str:
    return join_url(run_url, "lease")


@dataclass(frozen=True)
class LeaseRecord:
    generation: int
    holder: str
    expires_at: float
    released: bool
    process: str = ""  # the holder's ``process_identity``: where a next driver can see it is gone

    def live(self, now: float) -> bool:
        return not self.released and self.expires_at > now

    def holder_gone(self) -> bool:
        """Whether the holder's process is gone, as this process can tell: the same boot of the
        same machine and the same process table, and no process of its id, or only its
        zombie, or one started at another time (its id reused). The holder died without
        releasing, and its lease needs no waiting out."""
        boot, table, pid, started = (self.process.split("|") + ["", "", "", ""])[:4]
        own = process_identity()
        if not own or own.split("|")[:2] != [boot, table] or own == self.process or not pid.isdigit():
            return False
        fields = _stat_fields(int(pid))
        return fields is None or fields[0] == "Z" or fields[STARTTIME] != started

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()


def parse_record(data: bytes, url: str, generation: int) -> LeaseRecord:
    """The record of ``generation`` stored at ``url``; ``LeaseCorrupt`` says what is wrong."""
    try:
        fields = json.loads(data)
    except ValueError as error:  # not JSON, or not text at all
        raise LeaseCorrupt(url, "empty" if not data.strip() else f"not JSON: {error}") from None
    if not isinstance(fields, dict):
        raise LeaseCorrupt(url, "not a JSON object")
    wrong = [name for name, kind in FIELD_TYPES.items() if not isinstance(fields.get(name), kind)] + [
        name for name, kind in OPTIONAL_FIELD_TYPES.items() if name in fields and not isinstance(fields[name], kind)]
    if wrong:
        raise LeaseCorrupt(url, f"missing or mistyped: {', '.join(wrong)}")
    if fields["generation"] != generation:
        raise LeaseCorrupt(url, f"its generation field says {fields['generation']}")
    return LeaseRecord(generation, fields["holder"], float(fields["expires_at"]), fields["released"],
                       fields.get("process", ""))


class LeaseDirectory:
    """A run's lease records in storage, opened for one operation."""

    def __init__(self, root_url: str, options: StorageOptions):
        self.root_url = root_url
        self.fs, self.root = options.filesystem(root_url)
        self.local = isinstance(self.fs, LocalFileSystem)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    @staticmethod
    def _name(generation: int) -> str:
        return f"{generation:08d}.json"

    def generations(self) -> list[int]:
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        found = (RECORD.match(entry.rstrip("/").rsplit("/", 1)[-1]) for entry in entries)
        return sorted(int(match.group(1)) for match in found if match)

    def read(self, generation: int) -> LeaseRecord:
        name = self._name(generation)
        return parse_record(self.fs.cat_file(self._path(name)), f"{self.root_url}/{name}", generation)

    def create(self, record: LeaseRecord) -> bool:
        """Create ``record`` whole, only if its generation has none; False if one exists."""
        return self._create(self._path(self._name(record.generation)), record.encode())

    def replace(self, record: LeaseRecord) -> None:
        """Overwrite ``record``'s file whole: a reader sees the old record or the new one."""
        path = self._path(self._name(record.generation))
        if not self.local:
            self.fs.pipe_file(path, record.encode())  # one PUT: an object is replaced whole
            return
        temporary = _synced_temporary(self.root, record.encode())
        try:
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise
        _sync_directory(self.root)

    def remove(self, generation: int) -> None:
        self._remove(self._path(self._name(generation)))

    def honours_exclusive_create(self) -> bool:
        """Whether creating a name that exists fails here, as the lease needs: some
        S3-compatible servers ignore ``If-None-Match`` and overwrite. One probe object,
        created twice, tells."""
        probe = self._path(f".probe-{secrets.token_hex(8)}")
        try:
            self._create(probe, b"probe")
            return not self._create(probe, b"probe")
        finally:
            self._remove(probe)

    def _create(self, path: str, data: bytes) -> bool:
        if not self.local:
            try:
                self.fs.pipe_file(path, data, mode="create")  # If-None-Match: * on S3
            except FileExistsError:
                return False
            return True
        self.fs.makedirs(self.root, exist_ok=True)
        temporary = _synced_temporary(self.root, data)
        try:
            os.link(temporary, path)  # atomic, and refused if the name exists
        except FileExistsError:
            return False
        finally:
            os.unlink(temporary)
        _sync_directory(self.root)
        return True

    def _remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):  # another driver removed it first
            self.fs.rm(path)


def _synced_temporary(directory: str, data: bytes) -> str:
    """A file of ``data`` on disk beside the records, to be linked or renamed into place."""
    descriptor, path = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        os.unlink(path)
        raise
    return path


def _sync_directory(directory: str) -> None:
    # The link or rename itself reaches the disk only with its directory.
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _create_next(records: LeaseDirectory, record_for: Callable[[int], LeaseRecord], now: Callable[[], float],
                 corrupt_ok: bool = False) -> tuple[LeaseRecord, list[int], LeaseRecord | None]:
    """Create the record of the generation after the newest, unless the newest is live and its
    holder not gone (``LeaseHeld``) or unreadable (``LeaseCorrupt``, unless ``corrupt_ok``).
    Returns it, the generations that were there before it, and the gone holder's live record
    it took the run from (None: the run was free)."""
    while True:
        generations = records.generations()
        newest = generations[-1] if generations else 0
        taken_from = _refuse_if_live(records, newest, now(), corrupt_ok) if newest else None
        record = record_for(newest + 1)
        if records.create(record):
            return record, generations, taken_from
        # another driver created this generation first: its record now decides


def _refuse_if_live(records: LeaseDirectory, generation: int, now: float, corrupt_ok: bool) -> LeaseRecord | None:
    """Raises ``LeaseHeld`` while the record of ``generation`` is live and its holder not gone;
    returns it where it is live and its holder gone."""
    try:
        record = records.read(generation)
    except LeaseCorrupt:
        if corrupt_ok:
            return None
        raise
    if record.live(now) and record.holder_gone():
        return record
    if record.live(now):
        raise LeaseHeld(
            f"another driver holds this run: {record.holder} (lease generation {generation}), until "
            f"{_utc(record.expires_at)} (in {record.expires_at - now:.0f} s) unless it renews. "
            "Wait for it to end or stop it (ray job stop), or use another run name (--run-name)"
        )


def break_lease(run_url: str, options: StorageOptions, clock: Callable[[], float] = time.time) -> int:
    """End the run's lease when its newest record is unreadable (``LeaseCorrupt``), so that
    the next driver can take the run; returns the generation of the record written.

    Safe only when no other driver of this run is running: its job is stopped or gone (``ray
    job status``/``ray job stop``, the RayJob deleted). A live driver's record cannot be told
    apart from a dead one's once it is unreadable, and a driver still running under it would
    go on committing until its next renewal, which then finds the newer generation and stops
    it. A record that can be read is never broken while it is live (``LeaseHeld``).

    The record written is the next generation's, marked released, rather than the bad one
    deleted: generations only ever increase, and the catalog tells which driver's partial
    checkpoints it may delete by them."""
    records = LeaseDirectory(lease_url(run_url), options)
    holder = f"lease broken by {default_holder()}"
    record, _, _ = _create_next(records, lambda generation: LeaseRecord(generation, holder, clock(), True), clock,
                                corrupt_ok=True)
    return record.generation


class RunLease:
    def __init__(self, run_url: str, options: StorageOptions, ttl_s: float, holder: str | None = None,
                 clock: Callable[[], float] = time.time):
        self.root_url = lease_url(run_url)
        self.options = options
        self.ttl_s = ttl_s
        self.holder = holder or default_holder()
        self.clock = clock
        self.process = process_identity()
        self.generation: int | None = None
        self.expires_at = 0.0
        self.lost: str | None = None
        self.taken_from: LeaseRecord | None = None  # the gone holder's live record this driver took the run from
        self._lock = threading.Lock()

    def _records(self) -> LeaseDirectory:
        return LeaseDirectory(self.root_url, self.options)

    def _record(self, expires_at: float, released: bool, generation: int | None = None) -> LeaseRecord:
        return LeaseRecord(self.generation if generation is None else generation, self.holder, expires_at, released,
                           self.process)

    # protocol

    def acquire(self) -> int:
        """Take the run, or raise ``LeaseHeld`` naming the holder and when its lease ends (a
        holder on this host whose process is gone is not waited for: ``taken_from``),
        ``LeaseCorrupt`` if the newest record is unreadable, ``LeaseUnsafe`` on a store that
        does not honour exclusive creates."""
        records = self._records()
        if not records.honours_exclusive_create():
            raise LeaseUnsafe(
                f"the storage of {self.root_url} ignores exclusive creates (If-None-Match): a second create of "
                "one object succeeded, so two drivers could both take this run; use a store (or a version of it) "
                "that honours conditional writes, such as AWS S3"
            )
        record, generations, self.taken_from = _create_next(
            records, lambda generation: self._record(self.clock() + self.ttl_s, False, generation), self.clock)
        self.generation, self.expires_at = record.generation, record.expires_at
        for old in generations[:-1]:  # keep the previous holder's record for the history
            records.remove(old)
        return self.generation

    def renew(self) -> None:
        """Extend the lease; raises ``LeaseLost`` if it expired or another driver took the run."""
        with self._lock:
            self.ensure_held()
            records = self._records()
            self._ensure_still_ours(records)
            expires_at = self.clock() + self.ttl_s
            records.replace(self._record(expires_at, released=False))
            self.expires_at = expires_at

    def _ensure_still_ours(self, records: LeaseDirectory) -> None:
        """Raise ``LeaseLost`` if another driver took the run: it created a newer generation,
        or overwrote this one's record (a store that let its create through)."""
        newer = [generation for generation in records.generations() if generation > self.generation]
        if newer:
            self._lose(f"lease generation {newer[-1]} was taken by {self._holder_of(records, newer[-1])}")
        # A record that does not come back is not proof of a takeover: an object store that
        # is briefly unreachable answers reads as missing. The renewal then fails and is
        # retried, and the lease ends at its expiry if storage stays away.
        try:
            holder = records.read(self.generation).holder
        except LeaseCorrupt:
            holder = "an unknown driver (the record is unreadable)"
        if holder != self.holder:
            self._lose(f"its lease generation {self.generation} was taken over by {holder}")

    @staticmethod
    def _holder_of(records: LeaseDirectory, generation: int) -> str:
        try:
            return records.read(generation).holder
        except LeaseCorrupt:
            return "an unknown driver (the record is unreadable)"
        except FileNotFoundError:
            return "an unknown driver (the record is gone)"

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
            records = self._records()
            try:
                self._ensure_still_ours(records)
            except LeaseLost:
                return  # no longer this driver's to end
            records.replace(self._record(self.clock(), released=True))
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

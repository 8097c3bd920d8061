"""The driver's side of checkpoints: when to save, which group saves, when a save is committed.

One healthy replica group saves (groups hold identical state). Training stalls only while its
ranks copy the state to CPU; their uploads then run in the background while steps go on. At
each step boundary the driver polls the uploads; once every rank of the saving group
finished, it writes the commit manifest and prunes old and partial checkpoints. One save is
in flight at a time: a save that falls due meanwhile is deferred (and counted) until the
boundary after the upload ends. A failed save (staging, upload or manifest), or a saving
group that breaks, is never committed: it is counted, and the next due boundary tries again
(never the very next step). ``max_consecutive_failures`` failures in a row stop the run.
An upload still running ``upload_timeout_s`` after it started (or at the final checkpoint's
deadline) fails the same way: its ranks kill their uploads and its partial files are deleted,
so a stalled storage mount cannot hold back every later save unnoticed. A driver stages,
commits and deletes only while it holds the run's lease (``LeaseLost`` otherwise).
"""

from __future__ import annotations

import base64
import logging
import time
from dataclasses import asdict, dataclass

from checkpointing.catalog import CheckpointCatalog, NoUsableCheckpoint, Restorable
from checkpointing.lease import RunLease
from elastic.core.data_plan import DataCursor
from elastic.core.events import EventKind, EventLog
from elastic.core.goodput import TimeLedger
from elastic.core.loss_scale import LossScale, saved_loss_scale
from elastic.core.topology import Topology
from elastic.fleet.api import CallFailed, FleetApi, FleetError, Pending
from elastic.core.protocol import describe_error

log = logging.getLogger("elastic.driver.checkpoint_coordinator")


class CheckpointsFailing(RuntimeError):
    """Saves keep failing: the run stops rather than train on with nothing to fall back to."""


@dataclass
class SaveInFlight:
    step: int
    cursor: DataCursor
    group: int
    ranks: list[int]
    uploads: Pending
    stall_s: float
    started_at: float
    loss_scale: LossScale | None = None


def latest_checkpoint(catalog: CheckpointCatalog, events: EventLog, start_fresh: bool,
                      at_most: int | None = None) -> Restorable | None:
    """The newest usable checkpoint (of a step up to ``at_most``, if given), each one passed
    over an event."""
    def skipped(step: int, reason: str) -> None:
        events.emit(EventKind.CHECKPOINT_SKIPPED, step=step, reason=reason)

    return catalog.latest(on_skip=skipped, start_fresh=start_fresh, at_most=at_most)


class CheckpointCoordinator:
    def __init__(self, catalog: CheckpointCatalog, fleet: FleetApi, events: EventLog, ledger: TimeLedger,
                 topology: Topology, config_hash: str, max_consecutive_failures: int, upload_timeout_s: float,
                 clock=time.monotonic, config_record: dict | None = None, start_fresh: bool = False,
                 lease: RunLease | None = None, data_identity: dict[str, str] | None = None,
                 source_identity: dict[str, str] | None = None):
        self.catalog = catalog
        self.lease = lease
        self.fleet = fleet
        self.events = events
        self.ledger = ledger
        self.topology = topology
        self.config_hash = config_hash
        self.config_record = config_record or {}
        self.data_identity = data_identity or {}  # what the data is: recorded with every checkpoint
        self.source_identity = source_identity or {}  # what model.init_from is: likewise
        self.start_fresh = start_fresh
        self.restored_step: int | None = None  # the checkpoint the run resumed or rolled back to
        self.clock = clock
        self.in_flight: SaveInFlight | None = None
        self.due = False
        self.deferred_counted = False
        self.last_committed_step: int | None = None
        self.max_consecutive_failures = max_consecutive_failures
        self.consecutive_failures = 0
        self.upload_timeout_s = upload_timeout_s

    @property
    def last_committed_url(self) -> str | None:
        return None if self.last_committed_step is None else self.catalog.url(self.last_committed_step)

    # resume

    def latest(self, at_most: int | None = None) -> Restorable | None:
        """The newest usable checkpoint (of a step up to ``at_most``, if given)."""
        return latest_checkpoint(self.catalog, self.events, self.start_fresh, at_most)

    def restore(self, checkpoint: Restorable, ranks: list[int]) -> tuple[Restorable, float]:
        """Load a committed checkpoint into ranks of any layout (DCP reshards); returns the
        checkpoint loaded and the seconds it took.

        A checkpoint whose files match its manifest but do not load is corrupt all the same:
        it is moved aside and the one before it loaded into the same ranks, none replaced.
        Each rank gets the generator states saved at its shard position and stage (the TP
        ranks of a position share one stream). A stream the saving layout did not have restarts
        its stream from the seed and the step instead, which is reported: its random draws
        differ from the run that saved it."""
        started = self.clock()
        while True:
            generators = {rank: self._saved_generators(checkpoint, rank) for rank in ranks}
            try:
                self.fleet.restore(ranks, checkpoint.url, checkpoint.step, generators)
                break
            except CallFailed as error:
                if not error.unloadable or set(error.ranks) - set(error.unloadable):
                    raise
                checkpoint = self._instead_of_unloadable(checkpoint, next(iter(error.unloadable.values())))
        reseeded = sorted({self.topology.stream_of(rank) for rank, state in generators.items() if state is None})
        if reseeded:
            self.events.emit(EventKind.RNG_RESEEDED, step=checkpoint.step, streams=reseeded,
                             saved_layout=checkpoint.manifest.topology)
        self.last_committed_step = self.restored_step = checkpoint.step
        return checkpoint, self.clock() - started

    def _instead_of_unloadable(self, checkpoint: Restorable, why: str) -> Restorable:
        self.catalog.move_aside(checkpoint.step)
        self.events.emit(EventKind.CHECKPOINT_SKIPPED, step=checkpoint.step, reason=why)
        log.warning("checkpoint at step %d does not load, moved aside: %s", checkpoint.step, why)
        earlier = self.latest(at_most=checkpoint.step - 1)
        if earlier is None:
            raise NoUsableCheckpoint(f"the checkpoint of step {checkpoint.step} does not load ({why}) and no earlier "
                                     "one is usable; restore the run's checkpoints, or start a new run")
        return earlier

    def _saved_generators(self, checkpoint: Restorable, rank: int) -> dict[str, bytes] | None:
        saved = checkpoint.manifest.rng.get(self.topology.stream_of(rank))
        return None if saved is None else {name: base64.b64decode(state) for name, state in saved.items()}

    # saving

    def wants_save(self, step: int) -> bool:
        """Poll the upload in flight; then whether a save should start at this boundary."""
        self.poll()
        self.due |= self.catalog.is_due(step)
        if not self.due:
            return False
        if self.in_flight is not None:
            if not self.deferred_counted:
                self.deferred_counted = True
                self.events.emit(EventKind.CHECKPOINT_DEFERRED, step=step, in_flight_step=self.in_flight.step)
            return False
        return True

    def start(self, step: int, cursor: DataCursor, group: int, ranks: list[int],
              loss_scale: LossScale | None = None) -> bool:
        """Stage the committed state of ``group`` and start its upload (the only stall); the
        manifest will record ``cursor`` and ``loss_scale`` (fp16's) as they stand at ``step``."""
        self._ensure_held()  # a driver that lost the run writes nothing more, not even files
        self.due = False
        self.deferred_counted = False
        try:
            url = self.catalog.prepare(step)
        except Exception as error:  # storage unreachable (botocore's errors are not OSErrors)
            self._failed(step, f"the checkpoint directory could not be prepared: {describe_error(error)}")
            return False
        started = self.clock()
        try:
            with self.ledger.timing("checkpoint_stall"):
                self.fleet.save(ranks, url)
        except FleetError as error:
            self._failed(step, f"staging failed: {describe_error(error)}")
            return False
        stall_s = self.clock() - started
        uploads = self.fleet.finish_saves(ranks)
        self.in_flight = SaveInFlight(step, cursor, group, list(ranks), uploads, stall_s, self.clock(), loss_scale)
        self.events.emit(EventKind.CHECKPOINT_STARTED, step=step, group=group, stall_s=round(stall_s, 4))
        return True

    def poll(self, timeout: float = 0.0) -> None:
        save = self.in_flight
        if save is None:
            return
        if not self.fleet.done(save.uploads, timeout):
            if self.clock() - save.started_at >= self.upload_timeout_s:
                self._abandon(
                    f"the upload did not end within checkpoint.upload_timeout_s ({self.upload_timeout_s:g} s): check "
                    "that the storage answers, or raise checkpoint.upload_timeout_s if uploads take longer")
            return
        self.in_flight = None
        try:
            results = list(self.fleet.results(save.uploads).values())
        except FleetError as error:
            self._failed(save.step, f"a rank of group {save.group} failed during the upload: {describe_error(error)}")
            return
        failures = [f"rank {r.global_rank}: {r.error}" for r in results if not r.ok]
        if failures:
            self._failed(save.step, "; ".join(failures))
            return
        self._commit(save, results)

    def _commit(self, save: SaveInFlight, results) -> None:
        upload_s = max(result.upload_s for result in results)
        files = {name: digest for result in results for name, digest in result.files.items()}
        started = self.clock()
        self._ensure_held()
        try:
            manifest = self.catalog.commit(
                save.step, asdict(save.cursor), self.topology.record(), self.config_hash, files,
                timings={"stall_s": round(save.stall_s, 4), "upload_s": round(upload_s, 4)},
                config=self.config_record,
                data=self.data_identity,
                source=self.source_identity,
                loss_scale=saved_loss_scale(save.loss_scale),
                rng={
                    self.topology.stream_of(result.global_rank): {
                        name: base64.b64encode(state).decode() for name, state in result.rng.items()
                    }
                    for result in results if result.rng and self.topology.saves_stream(result.global_rank)
                },
            )
        except Exception as error:  # storage unreachable: not committed, the next save retries
            self._failed(save.step, f"manifest write failed: {describe_error(error)}")
            return
        commit_s = self.clock() - started
        self.last_committed_step = save.step
        self.consecutive_failures = 0
        self.events.emit(
            EventKind.CHECKPOINT_COMMITTED, step=save.step, url=self.catalog.url(save.step), group=save.group,
            files=len(manifest.files), bytes=manifest.total_bytes, stall_s=round(save.stall_s, 4),
            upload_s=round(upload_s, 4), commit_s=round(commit_s, 4),
        )
        self.prune()

    def prune(self) -> None:
        writing = self.in_flight.step if self.in_flight else None
        self._ensure_held()
        try:
            deleted = self.catalog.prune(writing=writing, protect=(self.last_committed_step, self.restored_step))
        except Exception as error:  # retention is retried at the next commit
            log.warning("checkpoint retention failed: %s", error)
            return
        if deleted:
            self.events.emit(EventKind.CHECKPOINTS_DELETED, steps=deleted)

    def _ensure_held(self) -> None:
        if self.lease is not None:
            self.lease.ensure_held()

    def _failed(self, step: int, error: str) -> None:
        """Count the failure and wait for the next due boundary: retrying at every step would
        stall training on storage that is down."""
        self.due = False
        self.consecutive_failures += 1
        self.events.emit(EventKind.CHECKPOINT_FAILED, step=step, error=describe_error(error, 1000),
                         consecutive=self.consecutive_failures)
        if self.consecutive_failures >= self.max_consecutive_failures:
            raise CheckpointsFailing(
                f"{self.consecutive_failures} checkpoint saves failed in a row, the last at step {step}: "
                f"{describe_error(error, 500)}; fix the storage (or raise checkpoint.max_consecutive_failures) "
                "and run again: the run resumes from its last committed checkpoint"
            )

    def _abandon(self, why: str) -> None:
        """Fail the save in flight, whose upload will not end: its ranks kill their uploads
        and its partial directory is deleted, so the next due save starts clean."""
        save, self.in_flight = self.in_flight, None
        try:
            self.fleet.abandon_saves(save.ranks)
        except FleetError as error:  # a rank gone or stuck: its failure surfaces where it runs
            why += f"; ranks {error.ranks} did not confirm they stopped it: {describe_error(error)}"
        self.prune()
        self._failed(save.step, why)

    def abandon_if_lost(self, lost_groups: set[int]) -> None:
        """A save whose group broke can never complete; forget it so the next one can start."""
        if self.in_flight is not None and self.in_flight.group in lost_groups:
            step = self.in_flight.step
            self.in_flight = None
            self._failed(step, f"saving group {sorted(lost_groups)} lost a rank during the upload")

    def finish(self, step: int, cursor: DataCursor, group: int, ranks: list[int], deadline: float,
               loss_scale: LossScale | None = None) -> bool:
        """Final or preemption checkpoint: wait out the upload in flight, save ``step`` and
        commit it, all before ``deadline`` (clock time). Returns whether ``step`` is committed."""
        self._wait_in_flight(deadline)
        if self.last_committed_step == step:
            return True
        if self.clock() >= deadline or not self.start(step, cursor, group, ranks, loss_scale):
            return False
        self._wait_in_flight(deadline)
        return self.last_committed_step == step

    def _wait_in_flight(self, deadline: float) -> None:
        """Until the save in flight ends; one still uploading at ``deadline`` fails."""
        while self.in_flight is not None and self.clock() < deadline:
            self.poll(timeout=min(0.5, max(0.0, deadline - self.clock())))
        if self.in_flight is not None:
            self._abandon("the upload did not end before the final checkpoint's deadline: check that the storage "
                          "answers, or raise checkpoint.grace_s if uploads take longer")

"""The driver's controller: the step protocol of DESIGN.md in lockstep with the rank actors.

One loop iteration is one step transaction: settle membership at the step boundary (grow,
heal and join groups), plan the data, dispatch ``(generation, step, micro-batches,
commit_previous)`` to every live rank, collect with a deadline, then commit or discard. A
failed step evicts its culprits, rebuilds the replicate process groups among the survivors
and runs again; groups that lost a rank sit out while their replacement starts and heals.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError

from checkpointing.manager import Restorable
from elastic.checkpointer import Checkpointer
from elastic.config import TrainConfig
from elastic.data_plan import DataCursor, StepPlan, plan_step
from elastic.diagnosis import Diagnosis, diagnose, least_progressed
from elastic.events import EventLog
from elastic.faults import Fault
from elastic.fleet import ACTOR_ERRORS, Fleet
from elastic.goodput import TimeLedger
from elastic.membership import Membership
from elastic.metrics import Metrics
from elastic.policies import FailurePolicy, ScalingPolicy, StepDeadline
from elastic.straggler_mitigation import NO_ACTIONS, StragglerMitigation
from workers.protocol import InjectedFault, StepReport, StepRequest

log = logging.getLogger("elastic.controller")

# How long a rank of a group that lost a member gets to report its error after the abort,
# before it counts as blocked in its group's collectives.
ABORT_SETTLE_S = 0.25
# How long a rank of a healthy group gets to return after the abort, at the least: it is
# computing its share or waiting in the cross-group all-reduce, and must not be mistaken for
# a stuck rank because the driver's call took a moment to reach it on a loaded node.
ABORT_GRACE_S = 2.0


class TrainingStopped(RuntimeError):
    """The job cannot go on (below minimum, no live peer, recoveries exhausted)."""


@dataclass
class Joining:
    """A group on its way into the quorum: placed, actors started, world built."""

    group: int
    ranks_to_start: list[int]
    stage: str = "placing"
    refs: list = field(default_factory=list)
    started_at: float = 0.0


@dataclass
class OpenRecovery:
    cause: str
    culprits: dict[int, str]
    detected_at: float
    detect_s: float
    drain_s: float = 0.0
    rebuild_s: float = 0.0
    heal_s: float = 0.0


class Controller:
    def __init__(self, config: TrainConfig, fleet: Fleet, membership: Membership, faults: list[Fault],
                 dataset_len: int, events: EventLog, ledger: TimeLedger, metrics: Metrics,
                 clock=time.monotonic, on_step=None, checkpointer: Checkpointer | None = None,
                 resume: Restorable | None = None, stop_requested: threading.Event | None = None):
        self.config = config
        self.fleet = fleet
        self.membership = membership
        self.faults = list(faults)
        self.dataset_len = dataset_len
        self.events = events
        self.ledger = ledger
        self.metrics = metrics
        self.clock = clock
        self.on_step = on_step or (lambda record: None)
        self.checkpointer = checkpointer
        self.resume = resume
        self.stop_requested = stop_requested or threading.Event()
        ft = config.fault_tolerance
        self.deadline = StepDeadline(ft.deadline_factor, ft.min_deadline_s, ft.first_step_deadline_s)
        self.failures = FailurePolicy(ft.max_recoveries)
        self.scaling = ScalingPolicy(config.scaling.min_groups, config.scaling.max_groups)
        self.cursor = DataCursor()
        self.step = 0
        self.losses: list[float] = []
        self.step_records: list[dict] = []
        self.steps_discarded = 0
        self.pending_commit = False
        self.has_state = False
        self.weights: dict[int, float] = {}
        self.attempts = 0
        self.failure_seen_at = 0.0  # when the driver saw the failed step's first failure
        self.joining: dict[int, Joining] = {}
        self.world_generation = 0
        self.recovery: OpenRecovery | None = None
        self.training_started_at: float | None = None
        self.tokens_committed = 0
        self.first_step = 0
        self.steps_rolled_back = 0
        self.stragglers = (
            StragglerMitigation(config.stragglers, config.global_batch, events, metrics, clock)
            if config.stragglers.enabled else None
        )
        self.straggler_actions = NO_ACTIONS  # decided at the last commit, applied at the next boundary

    # membership at step boundaries

    def reserve_group(self) -> int:
        group = self.membership.add_group()
        self.fleet.reserve(group)
        self.joining[group] = Joining(group, list(self.membership.global_ranks(group)), started_at=self.clock())
        self.events.emit("group-reserved", group=group)
        return group

    def heal_group(self, group: int) -> None:
        """Start replacements for the group's dead ranks; all its members then rebuild and heal."""
        record = self.membership.groups[group]
        self.joining[group] = Joining(group, sorted(record.dead_ranks), started_at=self.clock())

    def _all_ready(self, refs) -> bool:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def advance_joining(self) -> None:
        for group, task in list(self.joining.items()):
            try:
                self._advance(task)
            except ACTOR_ERRORS as error:
                self.events.emit("group-start-failed", group=group, error=str(error)[:300])
                for rank in self.membership.global_ranks(group):
                    if rank not in self.fleet.actors:
                        continue
                    try:
                        ray.get(self.fleet.actors[rank].node.remote(), timeout=5)
                    except (*ACTOR_ERRORS, GetTimeoutError):
                        self.fleet.kill(rank)
                        self.membership.groups[group].dead_ranks.add(rank)
                self.heal_group(group)

    def _advance(self, task: Joining) -> None:
        if task.stage == "placing" and self.fleet.placed(task.group):
            task.refs = [self.fleet.start_rank(rank) for rank in task.ranks_to_start]
            task.stage = "starting"
        if task.stage == "starting" and self._all_ready(task.refs):
            ray.get(task.refs)
            for rank in task.ranks_to_start:
                self.membership.replaced(rank)
                if self.stragglers is not None:
                    self.stragglers.forget(rank)  # a fresh process: its speed is not the old one's
            self.world_generation += 1
            ranks = self.membership.global_ranks(task.group)
            task.refs = list(self.fleet.call(ranks, "build", self.world_generation).values())
            task.stage = "building"
        if task.stage == "building" and self._all_ready(task.refs):
            ray.get(task.refs)
            task.stage = "ready"
            self.events.emit("group-built", group=task.group, seconds=round(self.clock() - task.started_at, 3))

    def join_ready_groups(self) -> bool:
        ready = sorted(g for g, task in self.joining.items() if task.stage == "ready")
        if not ready:
            return False
        live = self.membership.live_groups()
        if self.has_state:
            if live:
                self._heal_from_peers(ready, live[0])
            else:
                self._restore_from_checkpoint(ready)
        for group in ready:
            del self.joining[group]
        self.membership.join(ready)
        for group in ready:
            self.events.emit("group-joined", group=group, generation=self.membership.generation)
        self.rebuild_replicas()
        return True

    def commit_live(self) -> None:
        if self.pending_commit:
            ranks = self.membership.ranks_of(self.membership.live_groups())
            ray.get(list(self.fleet.call(ranks, "commit").values()))
            self.pending_commit = False

    def _heal_from_peers(self, groups: list[int], source_group: int) -> None:
        started = self.clock()
        self.commit_live()
        imports = []
        for group in groups:
            for source, target in zip(
                self.membership.global_ranks(source_group), self.membership.global_ranks(group)
            ):
                state = self.fleet.actors[source].export_state.remote()
                imports.append(self.fleet.actors[target].import_state.remote(state))
        ray.get(imports)
        seconds = self.clock() - started
        if self.recovery is not None:
            self.recovery.heal_s += seconds
        for group in groups:
            self.events.emit("group-healed", group=group, source_group=source_group, seconds=round(seconds, 4))
            self.metrics.heal_seconds.observe(seconds)

    def _restore_from_checkpoint(self, groups: list[int]) -> None:
        """No live peer holds the state: roll back to the latest committed checkpoint."""
        checkpoint = self.checkpointer.latest() if self.checkpointer else None
        if checkpoint is None:
            raise TrainingStopped(
                f"group(s) {groups} rebuilt but no live group holds the state to heal from, "
                "and there is no committed checkpoint to recover from; "
                "run with at least two replica groups (--groups 2) or checkpoint more often (--checkpoint-every N)"
            )
        seconds = self.checkpointer.restore(checkpoint, self.membership.ranks_of(groups))
        if self.recovery is not None:
            self.recovery.heal_s += seconds
        rolled_back = self.step - checkpoint.step
        self.rewind(checkpoint)
        self.steps_rolled_back += rolled_back
        self.metrics.steps_rolled_back.inc(rolled_back)
        self.events.emit(
            "restored-from-checkpoint", step=checkpoint.step, groups=groups, rolled_back_steps=rolled_back,
            seconds=round(seconds, 4),
        )

    def rewind(self, checkpoint: Restorable) -> None:
        """Continue from a checkpoint's step and data cursor; later committed steps rerun."""
        self.step = checkpoint.step
        self.cursor = DataCursor(**checkpoint.manifest.cursor)
        kept = max(0, self.step - self.first_step)
        del self.losses[kept:]
        del self.step_records[kept:]
        self.pending_commit = False
        self.has_state = True

    def rebuild_replicas(self) -> None:
        started = self.clock()
        quorum = self.membership.quorum()
        refs = [
            self.fleet.actors[rank].join_replicas.remote(quorum.generation, quorum.replica_rank(group), len(quorum.groups))
            for group in quorum.groups
            for rank in self.membership.global_ranks(group)
        ]
        ray.get(refs, timeout=self.config.fault_tolerance.collective_timeout_s + 30)
        seconds = self.clock() - started
        if self.recovery is not None:
            self.recovery.rebuild_s += seconds
        self.events.emit("groups-rebuilt", generation=quorum.generation, groups=list(quorum.groups), seconds=round(seconds, 4))
        self.metrics.generation.set(quorum.generation)
        self.metrics.live_groups.set(len(quorum.groups))
        self.metrics.live_ranks.set(len(quorum.groups) * self.membership.ranks_per_group)

    def settle_membership(self) -> None:
        """Grow toward max groups, move joining groups along, and hold below the minimum."""
        if self.scaling.wants_more(len(self.membership.groups), self.clock()):
            self.reserve_group()
        waited_from = self.clock()
        while True:
            self.advance_joining()
            self.join_ready_groups()
            live = len(self.membership.live_groups())
            if live and not self.scaling.below_minimum(live):
                return
            waited = self.clock() - waited_from
            limit = self.config.fault_tolerance.capacity_timeout_s + (
                0 if self.has_state else self.config.fault_tolerance.first_step_deadline_s
            )
            if waited > limit:
                stuck = {g: t.stage for g, t in self.joining.items()}
                raise TrainingStopped(
                    f"below the minimum of {self.scaling.min_groups} live replica group(s) "
                    f"({live} live) for {waited:.0f}s; groups waiting: {stuck} "
                    "('placing' means the cluster cannot place shard x tp ranks); "
                    "add capacity, lower scaling.min_groups, or raise fault_tolerance.capacity_timeout_s"
                )
            time.sleep(0.05)

    def report_open_mitigations(self) -> None:
        """Emit the straggler decisions still being measured, with what was measured so far."""
        if self.stragglers is not None:
            self.stragglers.close()

    def mitigate_stragglers(self) -> None:
        """Apply the straggler decisions of the last committed step at this boundary."""
        actions, self.straggler_actions = self.straggler_actions, NO_ACTIONS
        if actions.weights is not None:
            self.weights = dict(actions.weights)
        live = set(self.membership.live_groups())
        changed = False
        for rank in actions.replace:
            if self.membership.group_of(rank) not in live:
                continue  # its group already left the quorum (a failure since the decision)
            self.fleet.kill(rank)
            group = self.membership.evict_rank(rank)
            self.events.emit("rank-evicted", rank=rank, group=group, cause="straggler")
            self.metrics.evictions.labels(cause="straggler").inc()
            self.heal_group(group)
            changed = True
        for group in actions.evict_groups:
            if group not in live:
                continue
            self.fleet.kill_group(group)
            self.membership.remove_group(group)
            for rank in self.membership.global_ranks(group):
                self.stragglers.forget(rank)
            cooldown_s = self.config.stragglers.regrow_cooldown_s
            self.scaling.hold_back_one(self.clock() + cooldown_s)
            self.events.emit("group-evicted", group=group, cause="straggler", regrow_after_s=cooldown_s)
            changed = True
        if changed and self.membership.live_groups():
            self.rebuild_replicas()

    # the step transaction

    def due_faults(self, live_ranks: set[int]) -> dict[int, tuple[InjectedFault, ...]]:
        elapsed = self.clock() - (self.training_started_at or self.clock())
        firing: dict[int, list[InjectedFault]] = {}
        for fault in list(self.faults):
            if not fault.due(self.step, elapsed):
                continue
            targets = [r for r in live_ranks if fault.targets(r, self.membership.group_of(r))]
            if not targets:
                continue
            self.faults.remove(fault)
            self.events.emit("fault-injected", fault=fault.kind, ranks=targets, step=self.step)
            for rank in targets:
                firing.setdefault(rank, []).append(InjectedFault(fault.kind, fault.factor, fault.after))
        return {rank: tuple(faults) for rank, faults in firing.items()}

    def dispatch(self, plan: StepPlan) -> dict[ray.ObjectRef, int]:
        quorum_ranks = set(self.membership.ranks_of(plan.groups))
        faults = self.due_faults(quorum_ranks)
        self.attempts += 1
        deadline_s = self.deadline.seconds()
        refs = {}
        for group, group_plan in plan.groups.items():
            for rank in self.membership.global_ranks(group):
                shard_index, _ = self.membership.position_of(rank)
                request = StepRequest(
                    generation=self.membership.generation,
                    step=self.step,
                    micro_batches=group_plan.micro_batches(shard_index, self.config.scaling.shard, self.config.micro_batch),
                    global_tokens=plan.global_samples * self.config.data.seq_len,
                    commit_previous=self.pending_commit,
                    attempt=self.attempts,
                    deadline_s=deadline_s,
                    faults=faults.get(rank, ()),
                    noise=self.config.stragglers.noise,
                )
                refs[self.fleet.actors[rank].train_step.remote(request)] = rank
        self.pending_commit = False
        return refs

    def collect(self, refs: dict[ray.ObjectRef, int], started: float) -> tuple[dict[int, StepReport], Diagnosis | None]:
        pending = dict(refs)
        reports: dict[int, StepReport] = {}
        dead: set[int] = set()
        hung: list[int] = []
        deadline_s = self.deadline.seconds()
        failed = False
        while pending and not failed:
            remaining = deadline_s - (self.clock() - started)
            if remaining <= 0:
                progress = self.fleet.probe(pending.values(), timeout=5)
                hung = least_progressed(progress.values()) or sorted(set(pending.values()) - set(progress))
                self.events.emit("step-deadline", step=self.step, deadline_s=round(deadline_s, 3), hung=hung)
                failed = True
                break
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
            for ref in ready:
                rank = pending.pop(ref)
                failed |= self._receive(ref, rank, reports, dead)
        if not failed:
            return reports, None
        self.failure_seen_at = self.clock()
        for rank in hung:
            self.fleet.kill(rank)
        still_running = {ref: rank for ref, rank in pending.items() if rank not in hung}
        self.fleet.abort_step(still_running.values(), self.attempts)
        group_of = {r: self.membership.group_of(r) for r in refs.values()}
        stuck = self._drain(still_running, reports, dead, hung, group_of, started + deadline_s)
        diagnosis = diagnose(dead=dead, reports=reports, hung=hung, stuck=stuck, group_of=group_of)
        return reports, diagnosis

    def _receive(self, ref, rank: int, reports: dict, dead: set) -> bool:
        try:
            report = ray.get(ref)
        except ACTOR_ERRORS:
            dead.add(rank)
            return True
        reports[rank] = report
        return not report.ok

    def _drain(self, pending: dict, reports: dict, dead: set, hung: list[int], group_of: dict[int, int],
               step_deadline: float) -> list[int]:
        """Collect the rest of a failed step; returns the ranks blocked in their own group.

        A group that lost a member (or whose world failed) is broken: its other ranks block
        in its collectives, get ``ABORT_SETTLE_S`` to report, and are then counted as stuck.
        A rank of a healthy group is computing its own share, not stuck: the abort stops its
        group at the next micro-batch boundary (or at the cross-group all-reduce), so it
        returns within a micro-batch. It gets until the step's deadline, and at least a
        typical step time (never less than ``ABORT_GRACE_S``) from now.
        """
        def broken_groups() -> frozenset[int]:
            return diagnose(dead=dead, reports=reports, hung=hung, group_of=group_of).broken_groups

        settle_until = self.clock() + ABORT_SETTLE_S
        finish_until = max(step_deadline, self.clock() + max(ABORT_GRACE_S, self.deadline.typical_s()))
        pending = dict(pending)
        while pending:
            broken = broken_groups()
            now = self.clock()
            waiting = [ref for ref, rank in pending.items()
                       if now < (settle_until if group_of[rank] in broken else finish_until)]
            if not waiting:
                break
            until = settle_until if any(group_of[pending[ref]] in broken for ref in waiting) else finish_until
            ready, _ = ray.wait(waiting, num_returns=1, timeout=max(0.0, until - now))
            for ref in ready:
                self._receive(ref, pending.pop(ref), reports, dead)
        return sorted(pending.values())

    def recover(self, diagnosis: Diagnosis, step_started: float) -> None:
        drained = self.clock()
        if not self.failures.allow_recovery():
            raise TrainingStopped(
                f"step {self.step} failed ({diagnosis.cause}: {diagnosis.culprits}) after "
                f"{self.config.fault_tolerance.max_recoveries} recoveries; raise fault_tolerance.max_recoveries"
            )
        for rank, cause in sorted(diagnosis.culprits.items()):
            self.fleet.kill(rank)
            group = self.membership.evict_rank(rank)
            self.events.emit("rank-failed", rank=rank, group=group, cause=cause, step=self.step)
            self.events.emit("rank-evicted", rank=rank, group=group, cause=cause)
            self.metrics.evictions.labels(cause=cause).inc()
        for rank in diagnosis.stuck:
            # Blocked in its own group's collective with no way to abort it: its group heals
            # from a live peer anyway, so a fresh process costs nothing a wait would not.
            self.fleet.kill(rank)
            group = self.membership.evict_rank(rank)
            self.events.emit("rank-evicted", rank=rank, group=group, cause="stuck-in-collective")
            self.metrics.evictions.labels(cause="stuck-in-collective").inc()
        for group in sorted(diagnosis.broken_groups):
            self.membership.mark_broken(group)
            self.heal_group(group)
        if self.checkpointer is not None:
            failed_ranks = [*diagnosis.culprits, *diagnosis.stuck]
            self.checkpointer.abandon_if_lost(
                set(diagnosis.broken_groups) | {self.membership.group_of(rank) for rank in failed_ranks}
            )
        if self.recovery is None:
            self.recovery = OpenRecovery(
                diagnosis.cause, dict(diagnosis.culprits), step_started,
                detect_s=self.failure_seen_at - step_started, drain_s=drained - self.failure_seen_at,
            )
        self.events.emit(
            "step-discarded", step=self.step, cause=diagnosis.cause, culprits=diagnosis.culprits,
            broken_groups=sorted(diagnosis.broken_groups), errors=diagnosis.errors,
        )
        self.steps_discarded += 1
        self.metrics.steps_discarded.inc()
        if self.membership.live_groups():
            self.rebuild_replicas()

    def close_recovery(self) -> None:
        if self.recovery is None:
            return
        total = self.clock() - self.recovery.detected_at
        self.events.emit(
            "recovered",
            cause=self.recovery.cause,
            culprits=self.recovery.culprits,
            step=self.step,
            detect_s=round(self.recovery.detect_s, 4),
            drain_s=round(self.recovery.drain_s, 4),
            rebuild_s=round(self.recovery.rebuild_s, 4),
            heal_s=round(self.recovery.heal_s, 4),
            total_s=round(total, 4),
        )
        self.metrics.recoveries.labels(cause=self.recovery.cause).inc()
        self.metrics.recovery_seconds.labels(cause=self.recovery.cause).observe(total)
        self.recovery = None

    def run_step(self) -> bool:
        quorum = self.membership.quorum()
        weights = {g: self.weights.get(g, 1.0) for g in quorum.groups}
        plan = plan_step(
            self.step,
            self.cursor,
            dataset_len=self.dataset_len,
            global_batch=self.config.global_batch,
            seed=self.config.seed,
            group_weights=weights,
        )
        started = self.clock()
        refs = self.dispatch(plan)
        reports, diagnosis = self.collect(refs, started)
        elapsed = self.clock() - started
        if diagnosis is not None:
            self.ledger.charge("discarded", elapsed)
            with self.ledger.timing("recovery"):
                self.recover(diagnosis, started)
            return False
        self.ledger.charge("committed", elapsed)
        self.commit(plan, reports, elapsed)
        return True

    def commit(self, plan: StepPlan, reports: dict[int, StepReport], elapsed: float) -> None:
        self.pending_commit = True
        self.has_state = True
        self.deadline.record(elapsed)
        loss = sum(r.loss_share for rank, r in reports.items() if self.membership.position_of(rank)[1] == 0)
        self.losses.append(loss)
        self.cursor = plan.next_cursor
        tokens = plan.global_samples * self.config.data.seq_len
        self.tokens_committed += tokens
        record = {
            "step": self.step,
            "t": round(self.clock() - self.events.started_at, 4),
            "loss": loss,
            "step_s": round(elapsed, 5),
            "live_groups": len(plan.groups),
            "live_ranks": len(reports),
            "generation": self.membership.generation,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "rank_step_s": {str(rank): round(r.wall_s, 5) for rank, r in sorted(reports.items())},
            "rank_compute_s": {str(rank): round(r.compute_s, 5) for rank, r in sorted(reports.items())},
            "group_samples": {str(g): gp.samples for g, gp in plan.groups.items()},
        }
        self.step_records.append(record)
        if self.stragglers is not None:
            self.straggler_actions = self.stragglers.on_step(
                self.step, reports, {rank: self.membership.group_of(rank) for rank in reports},
                plan.groups.samples(), self.fleet.has_spare_slot(), self.config.scaling.min_groups,
            )
        self.step += 1
        self.close_recovery()
        self._export_step_metrics(record, reports)
        self.on_step(record)

    def _export_step_metrics(self, record: dict, reports: dict[int, StepReport]) -> None:
        m = self.metrics
        for rank, report in reports.items():
            m.rank_step_seconds.labels(rank=str(rank)).set(report.wall_s)
            m.rank_compute_seconds.labels(rank=str(rank)).set(report.compute_s)
            m.rank_communication_seconds.labels(rank=str(rank)).set(report.comm_s)
        m.steps_committed.inc()
        m.step.set(record["step"])
        m.loss.set(record["loss"])
        m.tokens_per_second.set(record["tokens_per_s"])
        m.goodput_ratio.set(self.ledger.goodput())
        for category, seconds in self.ledger.breakdown().items():
            if category != "wall_s":
                m.time_seconds.labels(category=category).set(seconds)

    # the run

    def start(self) -> None:
        with self.ledger.timing("startup"):
            for _ in range(self.config.scaling.max_groups):
                self.reserve_group()
            self.settle_membership()
            # Start with every group the cluster could place, not just the minimum.
            give_up = self.clock() + self.config.fault_tolerance.first_step_deadline_s
            while any(t.stage in ("starting", "building") for t in self.joining.values()) and self.clock() < give_up:
                self.advance_joining()
                time.sleep(0.02)
            self.join_ready_groups()
            if self.resume is not None:
                self.resume_from(self.resume)
        self.training_started_at = self.clock()

    def resume_from(self, checkpoint: Restorable) -> None:
        seconds = self.checkpointer.restore(checkpoint, self.membership.ranks_of(self.membership.live_groups()))
        self.first_step = checkpoint.step
        self.rewind(checkpoint)
        self.events.emit("resumed", step=checkpoint.step, url=checkpoint.url, seconds=round(seconds, 4))

    def train(self) -> str:
        """Run to the configured step count, or until a stop is requested; returns the exit:
        ``completed`` or ``preempted`` only with the final checkpoint committed."""
        while self.step < self.config.steps:
            if self.stop_requested.is_set():
                return self.finish("preempted")
            # Growing, healing and joining groups at the boundary is elasticity overhead.
            with self.ledger.timing("recovery"):
                self.mitigate_stragglers()
                self.settle_membership()
            if self.run_step():
                self.maybe_checkpoint()
        return self.finish("completed")

    def finish(self, reason: str) -> str:
        self.report_open_mitigations()
        if self.save_final(reason):
            return reason
        return f"{reason}, final checkpoint missed (step {self.step}): see the checkpoint-failed events"

    def _saving_group(self) -> tuple[int, list[int]]:
        group = self.membership.live_groups()[0]
        return group, self.membership.ranks_of([group])

    def maybe_checkpoint(self) -> None:
        if self.checkpointer is None or not self.checkpointer.wants_save(self.step):
            return
        self.commit_live()
        self.checkpointer.start(self.step, self.cursor, *self._saving_group())

    def save_final(self, reason: str) -> bool:
        """Commit the last step's gradients and checkpoint it within the grace period; returns
        whether the final checkpoint is committed (always, when checkpoints are off)."""
        self.commit_live()
        if self.checkpointer is None:
            return True
        grace_s = self.config.checkpoint.grace_s
        committed = False
        if self.membership.live_groups():
            with self.ledger.timing("checkpoint_stall"):
                committed = self.checkpointer.finish(self.step, self.cursor, *self._saving_group(), self.clock() + grace_s)
        if not committed:
            self.events.emit("final-checkpoint-missed", step=self.step, reason=reason, grace_s=grace_s)
        return committed

    def final_state(self) -> dict[int, list]:
        """Committed local parameter shards of the first live group, by position."""
        group = self.membership.live_groups()[0]
        ranks = list(self.membership.global_ranks(group))
        shards = ray.get([self.fleet.actors[r].local_parameters.remote() for r in ranks])
        return {self.membership.position_of(r): s for r, s in zip(ranks, shards)}

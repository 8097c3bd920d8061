"""The driver's controller: one state machine running the step protocol with the rank actors.

The run moves through explicit states, and ``advance(state)`` returns the next one::

    Starting -> AtBoundary -> Stepping -> AtBoundary -> ... -> Stopping -> Finished
                    |            |
                    |            +-> Recovering -> AtBoundary
                    +-> Evaluating -> AtBoundary (or Recovering)

``AtBoundary`` settles membership between runs: straggler actions, growing, placing,
starting, building, healing and joining groups. ``Stepping`` hands the live ranks a *run*
(``RunSpec``) up to the next planned boundary (the end, a checkpoint or an evaluation due)
and watches it (``run_watch``): the ranks plan, step and commit on their own, deciding each
step in their groups' votes, and the driver records the steps they committed, keeps its own
duties going, and asks for a pause when something needs a boundary (a stop, a straggler
action, a group ready to join, a deferred save). A failed step ends the run in
``Recovering``. ``Evaluating`` computes
the held-out loss with the live groups, split like a step's batch, and fails and recovers
like one. ``Recovering`` carries out the plan that
``plan_recovery`` makes from the step's diagnosis. The decisions live in ``elastic.core``
(pure), the Ray calls behind ``fleet_api``; this module is the order in which they happen.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from checkpointing.catalog import Restorable
from elastic.checkpoint_coordinator import CheckpointCoordinator
from elastic.config import TrainConfig
from elastic.core.data_plan import DataCursor, group_weights, plan_eval
from elastic.core.diagnosis import CONTROL_ERROR, DEATH, Diagnosis
from elastic.core.events import EventKind, EventLog
from elastic.core.faults import FaultSchedule
from elastic.core.goodput import TimeLedger
from elastic.core.membership import Broken, Built, GroupStage, Membership, Placed, Started
from elastic.core.policies import FailurePolicy, ScalingPolicy, StepDeadline
from elastic.core.protocol import EvalRequest, RunSpec, StepRecord, StepReport, describe_error
from elastic.core.recovery import plan_recovery
from elastic.core.straggler_mitigation import NO_ACTIONS, StragglerMitigation
from elastic.fleet_api import FleetApi, FleetError, Pending, RanksLost, RunStream
from elastic.run_watch import RunWatch
from elastic.step_collection import StepCollection

log = logging.getLogger("elastic.controller")

# How often the boundary polls groups on their way into the quorum.
JOIN_POLL_S = 0.05
# About how much training a group's batch of step records covers: the driver's work per
# step shrinks with it, and a hang is noticed this much later.
REPORT_INTERVAL_S = 1.0


class TrainingStopped(RuntimeError):
    """The job cannot go on (below minimum, no live peer, recoveries exhausted)."""


# run states


@dataclass(frozen=True)
class Starting:
    pass


@dataclass(frozen=True)
class AtBoundary:
    pass


@dataclass(frozen=True)
class Stepping:
    pass


@dataclass(frozen=True)
class Evaluating:
    pass


@dataclass(frozen=True)
class Recovering:
    diagnosis: Diagnosis
    step_started: float
    failure_seen_at: float
    evaluating: bool = False  # the held-out evaluation failed, not a training step


@dataclass(frozen=True)
class Stopping:
    reason: str  # completed | preempted


@dataclass(frozen=True)
class Finished:
    exit: str


RunState = Starting | AtBoundary | Stepping | Evaluating | Recovering | Stopping | Finished


@dataclass
class OpenRecovery:
    cause: str
    culprits: dict[int, str]
    detected_at: float
    detect_s: float
    drain_s: float = 0.0
    rebuild_s: float = 0.0
    heal_s: float = 0.0


StepListener = Callable[[dict], None]


class Controller:
    def __init__(self, config: TrainConfig, fleet: FleetApi, dataset_len: int, events: EventLog, ledger: TimeLedger, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 on_step: Iterable[StepListener] = (), checkpoints: CheckpointCoordinator | None = None,
                 resume: Restorable | None = None, stop_requested: threading.Event | None = None,
                 faults: FaultSchedule | None = None, eval_len: int = 0):
        self.config = config
        self.fleet = fleet
        self.topology = fleet.topology
        self.membership = Membership(self.topology)
        self.dataset_len = dataset_len
        self.eval_len = eval_len
        self.schedule = config.lr_schedule
        self.events = events
        self.ledger = ledger
        self.clock = clock
        self.sleep = sleep
        self.step_listeners = list(on_step)
        self.checkpoints = checkpoints
        self.resume = resume
        self.stop_requested = stop_requested or threading.Event()
        self.faults = faults  # injected faults (tests and benchmarks): they decorate the runs' specs
        ft = config.fault_tolerance
        self.deadline = StepDeadline(ft.deadline_factor, ft.min_deadline_s, ft.first_step_deadline_s)
        self.failures = FailurePolicy(ft.max_recoveries)
        self.collection = StepCollection(fleet, self.topology, self.deadline, events, clock)
        self.watch = RunWatch(self.collection)
        self.pause_requested = False  # of the run in flight
        self.scaling = ScalingPolicy(config.scaling.min_groups, config.scaling.max_groups)
        self.stragglers = (
            StragglerMitigation(config.stragglers, config.global_batch, events, clock)
            if config.stragglers.enabled else None
        )
        self.straggler_actions = NO_ACTIONS  # decided at a commit, applied at the next boundary
        self.cursor = DataCursor()
        self.step = 0
        self.first_step = 0
        self.losses: list[float] = []
        self.step_records: list[dict] = []
        self.steps_discarded = 0
        self.steps_rolled_back = 0
        self.tokens_committed = 0
        self.eval_records: list[dict] = []
        self.has_state = False
        self.attempts = 0
        self.world_generation = 0
        self.replicas_stale = False  # a cross-group rebuild failed: redo it at the next boundary
        self.joining_calls: dict[int, Pending] = {}  # a group's start or build calls in flight
        self.joining_since: dict[int, float] = {}
        self.recovery: OpenRecovery | None = None

    # the state machine

    def run(self) -> str:
        """Run to the configured step count, or until a stop is requested; returns the exit:
        ``completed`` or ``preempted`` only with the final checkpoint committed."""
        state: RunState = Starting()
        while not isinstance(state, Finished):
            state = self.advance(state)
        return state.exit

    def advance(self, state: RunState) -> RunState:
        try:
            return self._leave(state)
        except FleetError as error:
            with self.ledger.timing("recovery"):
                return self.control_failed(error, during=type(state).__name__.lower())

    def _leave(self, state: RunState) -> RunState:
        match state:
            case Starting():
                with self.ledger.timing("startup"):
                    self.start()
                return AtBoundary()
            case AtBoundary():
                if self.stop_requested.is_set():
                    return Stopping("preempted")
                if self.step >= self.config.steps and not self.eval_due():
                    return Stopping("completed")
                # Growing, healing and joining groups at the boundary is elasticity overhead.
                with self.ledger.timing("recovery"):
                    if self.replicas_stale and self.membership.live_groups():
                        self.rebuild_replicas()
                    self.mitigate_stragglers()
                    self.settle_membership()
                return Evaluating() if self.eval_due() else Stepping()
            case Stepping():
                return self.run_steps()
            case Evaluating():
                return self.run_eval()
            case Recovering():
                with self.ledger.timing("recovery"):
                    self.recover(state)
                return AtBoundary()
            case Stopping(reason):
                return Finished(self.finish(reason))
        raise ValueError(f"no transition from {state!r}")

    # start

    def start(self) -> None:
        for _ in range(self.config.scaling.max_groups):
            self.reserve_group()
        self.settle_membership()
        # Start with every group the cluster could place, not just the minimum.
        give_up = self.clock() + self.config.fault_tolerance.first_step_deadline_s
        while self._groups_in_flight() and self.clock() < give_up:
            self.advance_groups()
            self.sleep(JOIN_POLL_S)
        self.join_ready_groups()
        if self.resume is not None:
            self.resume_from(self.resume)

    def _groups_in_flight(self) -> bool:
        return bool(self.membership.groups_in(GroupStage.STARTING) + self.membership.groups_in(GroupStage.BUILDING))

    def resume_from(self, checkpoint: Restorable) -> None:
        # The run's state is the checkpoint's from here on: if the restore fails, the groups
        # that lost ranks rebuild and heal, or restore it again.
        self.first_step = checkpoint.step
        self.rewind(checkpoint)
        seconds = self.checkpoints.restore(checkpoint, self.topology.ranks_of(self.membership.live_groups()))
        self.events.emit(EventKind.RESUMED, step=checkpoint.step, url=checkpoint.url, seconds=round(seconds, 4))

    # membership at step boundaries

    def reserve_group(self) -> int:
        group = self.membership.add_group()
        self.fleet.reserve(group)
        self.events.emit(EventKind.GROUP_RESERVED, group=group)
        return group

    def advance_groups(self) -> None:
        """Move every group on its way into the quorum one stage on, where it can go."""
        for group, record in list(self.membership.groups.items()):
            if record.stage in (GroupStage.LIVE, GroupStage.READY):
                continue
            try:
                self._advance(group)
            except FleetError as error:
                self.events.emit(EventKind.GROUP_START_FAILED, group=group, error=str(error)[:300])
                self.joining_calls.pop(group, None)
                lost = error.ranks if isinstance(error, RanksLost) else [
                    rank for rank in self.topology.global_ranks(group) if not self.fleet.alive(rank)
                ]
                for rank in lost:
                    self.fleet.kill(rank)
                    self.membership.lose_rank(rank)
                if not lost:
                    self.membership.apply(group, Broken())

    def _advance(self, group: int) -> None:
        self.joining_since.setdefault(group, self.clock())
        if self.membership.stage_of(group) is GroupStage.PLACING and self.fleet.placed(group):
            record = self.membership.apply(group, Placed())
            self.joining_calls[group] = self.fleet.start(sorted(record.to_start))
        if self.membership.stage_of(group) is GroupStage.STARTING and self.fleet.done(self.joining_calls[group]):
            started = self.fleet.results(self.joining_calls[group])
            if self.stragglers is not None:
                for rank in started:
                    self.stragglers.forget(rank)  # a fresh process: its speed is not the old one's
            self.membership.apply(group, Started())
            self.world_generation += 1
            self.joining_calls[group] = self.fleet.build(self.topology.global_ranks(group), self.world_generation)
        if self.membership.stage_of(group) is GroupStage.BUILDING and self.fleet.done(self.joining_calls[group]):
            self.fleet.results(self.joining_calls.pop(group))
            self.membership.apply(group, Built())
            seconds = self.clock() - self.joining_since[group]
            self.events.emit(EventKind.GROUP_BUILT, group=group, seconds=round(seconds, 3))

    def join_ready_groups(self) -> bool:
        ready = list(self.membership.groups_in(GroupStage.READY))
        if not ready:
            return False
        live = self.membership.live_groups()
        if self.has_state:
            try:
                if live:
                    self._heal_from_peers(ready, live[0])
                else:
                    self._restore(ready)
            except FleetError:
                for group in ready:  # what they hold now is unknown: build them afresh
                    self.membership.apply(group, Broken())
                raise
        for group in ready:
            self.joining_since.pop(group, None)
        self.membership.join(ready)
        for group in ready:
            self.events.emit(EventKind.GROUP_JOINED, group=group, generation=self.membership.generation)
        self.rebuild_replicas()
        return True

    def _heal_from_peers(self, groups: list[int], source_group: int) -> None:
        started = self.clock()
        sources = self.topology.global_ranks(source_group)
        self.fleet.copy_state([
            pair for group in groups for pair in zip(sources, self.topology.global_ranks(group))
        ])
        seconds = self.clock() - started
        if self.recovery is not None:
            self.recovery.heal_s += seconds
        for group in groups:
            self.events.emit(EventKind.GROUP_HEALED, group=group, source_group=source_group, seconds=round(seconds, 4))

    def _restore(self, groups: list[int]) -> None:
        """No live peer holds the state: roll back to the latest committed checkpoint or,
        before the first one, to the initial state the seed determines, which groups that
        were just built hold already."""
        checkpoint = self.checkpoints.latest() if self.checkpoints else None
        if checkpoint is not None:
            self._restore_from_checkpoint(groups, checkpoint)
        elif self.first_step == 0:
            rolled_back = self.step
            self.rewind(None)
            self.steps_rolled_back += rolled_back
            self.events.emit(EventKind.RESTORED_INITIAL_STATE, step=0, groups=groups, rolled_back_steps=rolled_back,
                             seed=self.config.seed)
        else:
            positions = [self.topology.position_of(rank) for rank in self.topology.global_ranks(groups[0])]
            raise TrainingStopped(
                f"every copy of the state is lost (shard, tp positions {positions}): no live group holds it, "
                f"no committed checkpoint is left, and the run resumed from step {self.first_step}, so the "
                "initial state is not its state; run with more replica groups (--groups) or checkpoint more often "
                "(--checkpoint-every N)"
            )

    def _restore_from_checkpoint(self, groups: list[int], checkpoint: Restorable) -> None:
        seconds = self.checkpoints.restore(checkpoint, self.topology.ranks_of(groups))
        if self.recovery is not None:
            self.recovery.heal_s += seconds
        rolled_back = self.step - checkpoint.step
        self.rewind(checkpoint)
        self.steps_rolled_back += rolled_back
        self.events.emit(
            EventKind.RESTORED_FROM_CHECKPOINT, step=checkpoint.step, groups=groups, rolled_back_steps=rolled_back,
            seconds=round(seconds, 4),
        )

    def rewind(self, checkpoint: Restorable | None) -> None:
        """Continue from a checkpoint's step and data cursor (``None``: the initial state's,
        step 0); later committed steps rerun."""
        self.step = checkpoint.step if checkpoint else 0
        self.cursor = DataCursor(**checkpoint.manifest.cursor) if checkpoint else DataCursor()
        kept = max(0, self.step - self.first_step)
        del self.losses[kept:]
        del self.step_records[kept:]
        self.eval_records = [record for record in self.eval_records if record["step"] <= self.step]
        self.has_state = True

    def rebuild_replicas(self) -> None:
        self.replicas_stale = True
        started = self.clock()
        quorum = self.membership.quorum()
        assignments = {
            rank: (quorum.generation, quorum.replica_rank(group), len(quorum.groups))
            for group in quorum.groups
            for rank in self.topology.global_ranks(group)
        }
        self.fleet.join_replicas(assignments)
        self.replicas_stale = False
        seconds = self.clock() - started
        if self.recovery is not None:
            self.recovery.rebuild_s += seconds
        self.events.emit(EventKind.GROUPS_REBUILT, generation=quorum.generation, groups=list(quorum.groups),
                         ranks=len(assignments), seconds=round(seconds, 4))

    def settle_membership(self) -> None:
        """Grow toward max groups, move joining groups along, and hold below the minimum."""
        if self.scaling.wants_more(len(self.membership.groups), self.clock()):
            self.reserve_group()
        waited_from = self.clock()
        while True:
            self.advance_groups()
            self.join_ready_groups()
            live = len(self.membership.live_groups())
            if live and not self.scaling.below_minimum(live):
                return
            waited = self.clock() - waited_from
            limit = self.config.fault_tolerance.capacity_timeout_s + (
                0 if self.has_state else self.config.fault_tolerance.first_step_deadline_s
            )
            if waited > limit:
                raise TrainingStopped(
                    f"below the minimum of {self.scaling.min_groups} live replica group(s) "
                    f"({live} live) for {waited:.0f}s; groups waiting: {self.membership.waiting_groups()} "
                    "('placing' means the cluster cannot place shard x tp ranks); "
                    "add capacity, lower scaling.min_groups, or raise fault_tolerance.capacity_timeout_s"
                )
            self.sleep(JOIN_POLL_S)

    def evict(self, rank: int, cause: str) -> int:
        """Kill the rank's process; its group leaves the quorum to replace it. Returns the group."""
        self.fleet.kill(rank)
        self.joining_calls.pop(self.topology.group_of(rank), None)
        group = self.membership.lose_rank(rank)
        self.events.emit(EventKind.RANK_EVICTED, rank=rank, group=group, cause=cause)
        return group

    def mitigate_stragglers(self) -> None:
        """Apply the straggler decisions of the last committed step at this boundary."""
        actions, self.straggler_actions = self.straggler_actions, NO_ACTIONS
        live = set(self.membership.live_groups())
        changed = False
        for rank in actions.replace:
            if self.topology.group_of(rank) in live:  # else its group left since the decision
                self.evict(rank, "straggler")
                changed = True
        for group in actions.evict_groups:
            if group not in live:
                continue
            self.fleet.kill_group(group)
            self.membership.remove_group(group)
            for rank in self.topology.global_ranks(group):
                self.stragglers.forget(rank)
            cooldown_s = self.config.stragglers.regrow_cooldown_s
            self.scaling.hold_back_one(self.clock() + cooldown_s)
            self.events.emit(EventKind.GROUP_EVICTED, group=group, cause="straggler", regrow_after_s=cooldown_s)
            changed = True
        if changed and self.membership.live_groups():
            self.rebuild_replicas()

    # runs: the steps the ranks take on their own

    def run_steps(self) -> RunState:
        """Hand the live ranks a run up to the next planned boundary and watch it; the ranks
        commit each step among themselves, and the driver records what they committed."""
        spec = self.run_spec()
        started = self.clock()
        self.attempts += 1
        ranks = self.topology.ranks_of(spec.groups)
        specs = dict.fromkeys(ranks, spec)
        stream = self.fleet.start_run(self.faults.decorate(spec.first_step, specs) if self.faults else specs)
        self.pause_requested = False
        outcome = self.watch.watch(stream, spec, self.commit, lambda: self.between_steps(stream))
        self.ledger.charge("committed", outcome.committed_until - started)
        self.ledger.charge("discarded" if outcome.diagnosis else "committed", self.clock() - outcome.committed_until)
        if outcome.diagnosis is not None:
            return Recovering(outcome.diagnosis, outcome.committed_until, self.collection.failure_seen_at)
        self.maybe_checkpoint()
        return AtBoundary()

    def run_spec(self) -> RunSpec:
        return RunSpec(
            run=self.attempts + 1,
            first_step=self.step,
            stop_step=self.next_boundary(),
            cursor=self.cursor,
            dataset_len=self.dataset_len,
            global_batch=self.config.global_batch,
            seed=self.config.seed,
            group_weights=group_weights(self.membership.live_groups(),
                                        self.stragglers.weights if self.stragglers is not None else {}),
            micro_batch=self.config.micro_batch,
            seq_len=self.config.data.seq_len,
            schedule=self.schedule,
            clip_grad_norm=self.config.optimizer.clip_grad_norm,
            deadline_s=self.deadline.seconds(),
            report_every=self.report_every(),
        )

    def next_boundary(self) -> int:
        """The step before which the run pauses: the end, the next checkpoint or evaluation
        due, or an injected fault's step."""
        stops = [self.config.steps]
        if self.checkpoints is not None and self.checkpoints.catalog.every:
            every = self.checkpoints.catalog.every
            stops.append((self.step // every + 1) * every)
        if self.config.eval.every:
            stops.append((self.step // self.config.eval.every + 1) * self.config.eval.every)
        if self.faults is not None and (fault_step := self.faults.next_step_after(self.step)) is not None:
            stops.append(fault_step)
        return max(self.step + 1, min(stops))

    def report_every(self) -> int:
        """Steps per record batch: about ``REPORT_INTERVAL_S`` of them, one at long steps."""
        typical = self.deadline.typical_s()
        return max(1, int(REPORT_INTERVAL_S / typical)) if typical > 0 else 1

    def between_steps(self, stream: RunStream) -> None:
        """The driver's own duties while a run goes on: commit a finished upload, move
        joining groups on, and ask the ranks to pause when something needs a boundary."""
        if self.checkpoints is not None:
            self.checkpoints.poll()
        if self.scaling.wants_more(len(self.membership.groups), self.clock()):
            self.reserve_group()
        if any(record.stage is not GroupStage.LIVE for record in self.membership.groups.values()):
            self.advance_groups()
        if not self.pause_requested and self.boundary_needed():
            self.pause_requested = True
            self.fleet.request_pause(stream.ranks, stream.run)

    def boundary_needed(self) -> bool:
        return bool(
            self.stop_requested.is_set()
            or self.straggler_actions != NO_ACTIONS
            or self.membership.groups_in(GroupStage.READY)
            or (self.checkpoints is not None and self.checkpoints.due and self.checkpoints.in_flight is None)
            or (self.faults is not None and self.faults.time_fault_due())
        )

    def global_loss(self, reports: dict[int, StepReport]) -> float:
        """The loss over the evaluated batch: each TP row's share once (its ranks compute the
        same replicated logits)."""
        return sum(report.loss_share for rank, report in reports.items() if self.topology.leads_tp(rank))

    # evaluation

    def eval_due(self) -> bool:
        """Every ``eval.every`` committed steps and after the last one, once per step."""
        every = self.config.eval.every
        if not every or self.step == 0 or (self.eval_records and self.eval_records[-1]["step"] == self.step):
            return False
        return self.step % every == 0 or self.step >= self.config.steps

    def run_eval(self) -> RunState:
        """The held-out loss of the committed state: the first ``eval.samples`` samples of the
        validation set, split across the live groups by the step's rules, so the loss is the
        same whatever the number of groups."""
        plan = plan_eval(self.step, dataset_len=self.eval_len, samples=self.config.eval.samples,
                         group_weights=group_weights(self.membership.live_groups(), {}))
        # Forward only, over a batch that may be larger than a training step's.
        deadline_s = self.deadline.seconds() * max(1.0, plan.global_samples / self.config.global_batch)
        started = self.clock()
        self.attempts += 1
        pending = self.fleet.evaluate({
            rank: EvalRequest(self.step, group_plan.micro_batches(self.topology.shard_index(rank), self.topology.shard,
                                                                  self.config.micro_batch),
                              plan.global_samples * self.config.data.seq_len, self.attempts, deadline_s)
            for group, group_plan in plan.groups.items() for rank in self.topology.global_ranks(group)
        })
        reports, diagnosis = self.collection.collect(pending, self.step, self.attempts, started, deadline_s)
        elapsed = self.clock() - started
        self.ledger.charge("evaluation" if diagnosis is None else "discarded", elapsed)
        if diagnosis is not None:
            return Recovering(diagnosis, started, self.collection.failure_seen_at, evaluating=True)
        loss = self.global_loss(reports)
        record = {"step": self.step, "loss": loss, "samples": plan.global_samples, "seconds": round(elapsed, 4)}
        self.eval_records.append(record)
        self.events.emit(EventKind.EVALUATED, **record)
        return AtBoundary()

    def recover(self, failure: Recovering) -> None:
        diagnosis = failure.diagnosis
        drained = self.clock()
        if not self.failures.allow_recovery():
            raise TrainingStopped(
                f"step {self.step} failed ({diagnosis.cause}: {diagnosis.culprits}) after "
                f"{self.config.fault_tolerance.max_recoveries} recoveries; raise fault_tolerance.max_recoveries"
            )
        plan = plan_recovery(diagnosis, self.topology, self.membership.live_groups())
        for eviction in plan.evictions:
            if eviction.failed_the_step:
                self.events.emit(EventKind.RANK_FAILED, rank=eviction.rank, group=eviction.group,
                                 cause=eviction.cause, step=self.step)
            self.evict(eviction.rank, eviction.cause)
        for group in plan.rebuilding:
            self.joining_calls.pop(group, None)
            self.membership.apply(group, Broken())
        if self.checkpoints is not None:
            self.checkpoints.abandon_if_lost(plan.affected_groups)
        if self.recovery is None:
            self.recovery = OpenRecovery(
                diagnosis.cause, dict(diagnosis.culprits), failure.step_started,
                detect_s=failure.failure_seen_at - failure.step_started, drain_s=drained - failure.failure_seen_at,
            )
        self.events.emit(
            EventKind.EVAL_DISCARDED if failure.evaluating else EventKind.STEP_DISCARDED, step=self.step,
            cause=diagnosis.cause, culprits=diagnosis.culprits, broken_groups=sorted(diagnosis.broken_groups),
            errors=diagnosis.errors,
        )
        if not failure.evaluating:
            self.steps_discarded += 1
        if plan.survivors:
            self.rebuild_replicas()

    def control_failed(self, error: FleetError, during: str) -> RunState:
        """A control call (commit, heal, restore, rebuild, checkpoint staging) failed: a new
        failure, recovered from like a failed step, never a crash. The ranks that no longer
        answer are replaced, and so are the ranks the call failed on, whose state is now
        unknown; a failed rebuild of cross-group groups leaves state intact, so there the
        ranks waiting on a dead peer are kept."""
        if not self.failures.allow_recovery():
            raise TrainingStopped(
                f"a control call failed while {during} ({describe_error(error, 300)}) after "
                f"{self.config.fault_tolerance.max_recoveries} recoveries; raise fault_tolerance.max_recoveries"
            )
        involved = set(error.ranks) | set(self.topology.ranks_of(
            [*self.membership.live_groups(), *self.membership.groups_in(GroupStage.READY)]))
        dead = involved - self.fleet.responsive(sorted(involved))
        failed = set() if dead and error.left_state_intact else set(error.ranks) - dead
        culprits = {rank: DEATH if rank in dead else CONTROL_ERROR for rank in sorted(dead | failed)}
        if self.resume is not None and not self.has_state:
            # Failed before the resume's restore began: every group is rebuilt and restores it.
            self.first_step = self.resume.step
            self.rewind(self.resume)
            for group in self.membership.live_groups():
                self.membership.apply(group, Broken())
        for rank, cause in culprits.items():
            self.events.emit(EventKind.RANK_FAILED, rank=rank, group=self.topology.group_of(rank), cause=cause,
                             step=self.step, during=during, error=describe_error(error, 300))
            self.evict(rank, cause)
        if self.checkpoints is not None:
            self.checkpoints.abandon_if_lost({self.topology.group_of(rank) for rank in culprits})
        if self.recovery is None:
            now = self.clock()
            self.recovery = OpenRecovery(next(iter(culprits.values())), dict(culprits), now, detect_s=0.0)
        self.replicas_stale = True
        return AtBoundary()

    def close_recovery(self) -> None:
        if self.recovery is None:
            return
        self.events.emit(
            EventKind.RECOVERED,
            cause=self.recovery.cause,
            culprits=self.recovery.culprits,
            step=self.step,
            detect_s=round(self.recovery.detect_s, 4),
            drain_s=round(self.recovery.drain_s, 4),
            rebuild_s=round(self.recovery.rebuild_s, 4),
            heal_s=round(self.recovery.heal_s, 4),
            total_s=round(self.clock() - self.recovery.detected_at, 4),
        )
        self.recovery = None

    def commit(self, records: dict[int, StepRecord]) -> None:
        """Record a step every group of the run committed (their votes agree on the loss, the
        norm and the clipping factor; each group reports its own ranks' times)."""
        first = records[min(records)]
        times = {rank: rank_times for record in records.values() for rank, rank_times in record.ranks.items()}
        ordered = sorted(times.items())
        step_s = max(record.step_s for record in records.values())
        self.deadline.record(step_s)
        self.losses.append(first.loss)
        self.cursor = first.next_cursor
        tokens = first.global_samples * self.config.data.seq_len
        self.tokens_committed += tokens
        record = {
            "step": self.step,
            "t": round(self.clock() - self.events.started_at, 4),
            "loss": first.loss,
            "lr": self.schedule.lr(self.step),
            "grad_norm": first.grad_norm,
            "grad_clip_scale": first.clip_scale,
            "step_s": round(step_s, 5),
            "live_groups": len(first.group_samples),
            "live_ranks": len(times),
            "generation": self.membership.generation,
            "tokens_per_s": tokens / step_s if step_s > 0 else 0.0,
            "rank_step_s": {str(rank): round(t.wall_s, 5) for rank, t in ordered},
            "rank_compute_s": {str(rank): round(t.compute_s, 5) for rank, t in ordered},
            "rank_comm_s": {str(rank): round(t.comm_s, 5) for rank, t in ordered},
            "group_samples": {str(g): samples for g, samples in first.group_samples.items()},
        }
        if self.stragglers is not None:
            actions = self.stragglers.on_step(
                self.step, times, {rank: self.topology.group_of(rank) for rank in times},
                first.group_samples, self.fleet.has_spare_slot(), self.config.scaling.min_groups,
            )
            if actions != NO_ACTIONS:  # the run goes on until the pause: keep it for the boundary
                self.straggler_actions = actions
            record["rank_straggler_score"] = {str(rank): round(s, 4) for rank, s in self.stragglers.scores().items()}
        self.has_state = True
        self.step_records.append(record)
        self.step += 1
        self.close_recovery()
        for listener in self.step_listeners:
            listener(record)

    # checkpoints and the end of the run

    def _saving_group(self) -> tuple[int, list[int]]:
        group = self.membership.live_groups()[0]
        return group, self.topology.ranks_of([group])

    def maybe_checkpoint(self) -> None:
        if self.checkpoints is None or not self.checkpoints.wants_save(self.step):
            return
        self.checkpoints.start(self.step, self.cursor, *self._saving_group())

    def finish(self, reason: str) -> str:
        if self.stragglers is not None:
            self.stragglers.close()  # report the decisions still being measured
        if self.save_final(reason):
            return reason
        return f"{reason}, final checkpoint missed (step {self.step}): see the checkpoint-failed events"

    def save_final(self, reason: str) -> bool:
        """Commit the last step's gradients and checkpoint it within the grace period; returns
        whether the final checkpoint is committed (always, when checkpoints are off)."""
        if self.checkpoints is None:
            return True
        grace_s = self.config.checkpoint.grace_s
        committed = False
        if self.membership.live_groups():
            with self.ledger.timing("checkpoint_stall"):
                committed = self.checkpoints.finish(self.step, self.cursor, *self._saving_group(), self.clock() + grace_s)
        if not committed:
            self.events.emit(EventKind.FINAL_CHECKPOINT_MISSED, step=self.step, reason=reason, grace_s=grace_s)
        return committed

    def final_state(self) -> dict[tuple[int, int], list]:
        """Committed local parameter shards of the first live group, by position."""
        _, ranks = self._saving_group()
        shards = self.fleet.local_parameters(ranks)
        return {self.topology.position_of(rank): shards[rank] for rank in ranks}

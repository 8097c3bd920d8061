"""The driver's controller: one state machine over the run, with the rank actors behind the
fleet. ``advance(state)`` returns the next state::

    Starting -> AtBoundary -> Stepping -> AtBoundary -> ... -> Stopping -> Finished
                    |            |
                    |            +-> Recovering -> AtBoundary
                    +-> Evaluating -> AtBoundary (or Recovering)

``AtBoundary`` settles membership between segments (``group_keeper``): straggler actions,
growing, placing, starting, building, healing and joining groups (``state_sources``: where a
joining group's state comes from). ``Stepping`` hands the live ranks a *segment* (``SegmentSpec``) up
to the next planned boundary (the end, a checkpoint or an evaluation due) and watches it
(``segment_watch``): the ranks plan, step and commit on their own, deciding each step in their
groups' votes, and the driver records the steps they committed (``history``, as
``StepResult``s for the listeners), keeps its own duties going, and asks for a pause when
something needs a boundary (a stop, a straggler action, a group ready to join, a deferred save).
``Evaluating`` computes the held-out loss with the live groups, split like a step's batch.
``Recovering`` carries out the plan ``plan_recovery`` makes from a ``Diagnosis``, whatever
failed (``FailedWork``: a step, an evaluation, a control call, or a group on its way in); each
spends one recovery of the same budget, and the survivors rebuild their cross-group groups at
the boundary after it. The decisions live in ``elastic.core`` (pure), the Ray calls
behind ``fleet_api``; this module is the order in which they happen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from checkpointing.catalog import Restorable
from elastic.driver.checkpoint_coordinator import CheckpointCoordinator
from elastic.setup.config import TrainConfig
from elastic.core.compute_replay import MIN_GROUPS
from elastic.core.data_plan import dropped_samples, group_weights
from elastic.core.diagnosis import Cause, Diagnosis, diagnose_control_failure
from elastic.core.events import EventKind, EventLog
from elastic.core.exits import Ending, Exit
from elastic.core.faults import FaultSchedule
from elastic.core.goodput import TimeLedger
from elastic.core.membership import GroupStage, Membership
from elastic.core.policies import DivergencePolicy, FailurePolicy, StepDeadline, segment_boundary
from elastic.core.protocol import SegmentRecords, SegmentSpec, describe_error
from elastic.core.recovery import plan_recovery
from elastic.driver.evaluation import Evaluation
from elastic.fleet.api import FleetApi, FleetError, SegmentStream
from elastic.driver.group_keeper import JOIN_POLL_S, GroupKeeper
from elastic.driver.history import RunHistory
from elastic.driver.records import RankArrays, StepResult
from elastic.driver.recovery_timing import RecoveryTiming
from elastic.driver.outcome_collector import FailureSeen, OutcomeCollector
from elastic.driver.run_context import RunContext
from elastic.driver.segment_watch import SegmentWatch
from elastic.driver.state_sources import StateSources
from elastic.driver.straggler_watch import StragglerWatch
from elastic.driver.stopped import TrainingStopped

__all__ = ["Controller", "TrainingStopped"]

# How often a group's first rank sends its committed records (and always with its first and
# last step of a segment): the driver's work per step shrinks with it, and a hang is noticed at
# most this much later.
RECORDS_INTERVAL_S = 1.0


# run states


@dataclass(frozen=True)
class Starting:
    pass


@dataclass(frozen=True)
class AtBoundary:
    replicas_stale: bool = False  # after a recovery: the survivors' cross-group groups are rebuilt first


@dataclass(frozen=True)
class Stepping:
    pass


@dataclass(frozen=True)
class Evaluating:
    pass


class FailedWork(StrEnum):
    """What a recovery recovers from."""

    STEP = "step"
    EVALUATION = "evaluation"
    CONTROL_CALL = "control call"
    GROUP_START = "group start"


@dataclass(frozen=True)
class Recovering:
    diagnosis: Diagnosis
    failed: FailedWork
    started: float  # when the failed work began
    seen_at: float  # when its failure was seen
    error: str = ""  # for a control call or a group start: the error it raised
    events: dict = field(default_factory=dict)  # extra fields of its rank-failed events

    def describe(self, step: int) -> str:
        """What failed, for a stop reason that goes on to name the error."""
        match self.failed:
            case FailedWork.CONTROL_CALL:
                return f"a control call failed while {self.events['during']} ({self.error})"
            case FailedWork.GROUP_START:
                return f"groups {sorted(self.diagnosis.broken_groups)} failed to start"
        return f"{self.failed} {step} failed ({self.diagnosis.cause}, ranks {sorted(self.diagnosis.culprits)})"


@dataclass(frozen=True)
class Stopping:
    reason: Exit  # completed, preempted or diverged: why


@dataclass(frozen=True)
class Finished:
    exit: Exit


RunState = Starting | AtBoundary | Stepping | Evaluating | Recovering | Stopping | Finished
StepListener = Callable[[StepResult], None]


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
        self.events = events
        self.ledger = ledger
        self.clock = clock
        self.step_listeners = list(on_step)
        self.checkpoints = checkpoints
        self.resume = resume
        self.stop_requested = stop_requested or threading.Event()
        self.faults = faults  # injected faults (tests and benchmarks): they decorate the segments' specs
        ft = config.fault_tolerance
        self.deadline = StepDeadline(ft.deadline_factor, ft.min_deadline_s, ft.first_step_deadline_s)
        self.failures = FailurePolicy(ft.max_recoveries)
        self.divergence = DivergencePolicy(config.optimizer.max_nonfinite_steps)
        self.watch = SegmentWatch(collector := OutcomeCollector(fleet, self.topology, self.deadline, events, clock))
        self.evaluation = Evaluation(config, collector, eval_len, events, ledger, clock)
        self.stragglers = StragglerWatch(config, self.topology, events, clock)
        rounds = config.sync.outer_rounds
        self.history = RunHistory(integrity_every=config.integrity.every, loss_scale=config.compute.loss_scale,
                                  outer_every=rounds.every if rounds is not None else 0)
        self.timing = RecoveryTiming(events, clock)
        self.context = run = RunContext(config, fleet, self.membership, self.history, self.timing, events, clock)
        self.state_sources = StateSources(run, checkpoints)
        self.groups = GroupKeeper(run, self.state_sources, sleep, self.stragglers.mitigation)
        self.attempts = 0  # runs and evaluations started: each has its own number
        self.pause_requested = False  # of the segment in flight
        self.charged_until = 0.0  # the clock time up to which the segment in flight is charged to the ledger

    # the state machine

    def run(self) -> Exit:
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
            return self.control_call_failed(error, during=type(state).__name__.lower())

    def _leave(self, state: RunState) -> RunState:
        match state:
            case Starting():
                with self.ledger.timing("startup"):
                    self.start()
                return AtBoundary()
            case AtBoundary(replicas_stale):
                if self.groups.start_failed():
                    return self.group_start_failed()
                # inside a DiLoCo round the learners hold no run's state to save: the stop waits for its end
                if self.stop_requested.is_set() and self.context.between_rounds:
                    return Stopping(Exit(Ending.PREEMPTED))
                if self.history.step >= self.config.steps and not self.eval_due():
                    return Stopping(Exit(Ending.COMPLETED))
                # Growing, healing and joining groups at the boundary is elasticity overhead.
                with self.ledger.timing("recovery"):
                    if replicas_stale and self.membership.live_groups():
                        self.groups.rebuild_replicas()
                    if self.straggler_actions_ready() and self.context.between_rounds:
                        self.groups.apply_straggler_actions(self.stragglers.take())
                    self.groups.settle(self.deadline.typical_s(), steps_next=not self.eval_due())
                    if self.groups.start_failed():  # the run does not step next: joined groups heal now
                        self.state_sources.heal_pending_now()
                if self.groups.start_failed():
                    return AtBoundary()
                return Evaluating() if self.eval_due() else Stepping()
            case Stepping():
                return self.run_steps()
            case Evaluating():
                return self.run_eval()
            case Recovering():
                with self.ledger.timing("recovery"):
                    self.recover(state)
                return AtBoundary(replicas_stale=True)
            case Stopping(reason):
                return Finished(self.finish(reason))
        raise ValueError(f"no transition from {state!r}")

    def start(self) -> None:
        for _ in range(self.config.scaling.max_groups):
            self.groups.reserve_group()
        self.groups.settle()
        # Start with every group the cluster could place, not just the minimum.
        give_up = self.clock() + self.config.fault_tolerance.first_step_deadline_s
        while self.groups.in_flight() and self.clock() < give_up and not self.groups.start_failed():
            self.groups.advance_groups()
            self.groups.sleep(JOIN_POLL_S)
        self.groups.join_ready_groups()
        if self.resume is not None:
            # The run's state is the checkpoint's from here on: if the restore fails, the
            # groups that lost ranks rebuild and heal, or restore it again.
            self.history.first_step = self.resume.step
            self.state_sources.rewind(self.resume)
            restored, seconds = self.checkpoints.restore(self.resume, self.topology.ranks_of(self.membership.live_groups()))
            if restored is not self.resume:  # it did not load: the one before it did
                self.resume = restored
                self.history.first_step = restored.step
                self.state_sources.rewind(restored)
            self.events.emit(EventKind.RESUMED, step=self.resume.step, url=self.resume.url, seconds=round(seconds, 4))

    # runs: the steps the ranks take on their own

    def run_steps(self) -> RunState:
        """Hand the live ranks a segment up to the next planned boundary and watch it; the ranks
        commit each step among themselves, and the driver records what they committed."""
        spec = self.segment_spec()
        started = self.clock()
        specs = dict.fromkeys(self.topology.ranks_of(spec.groups), spec)
        self.timing.stepping()
        self.pause_requested = False
        self.charged_until = started
        try:
            stream = self.fleet.start_segment(self.faults.decorate(spec.first_step, specs) if self.faults else specs)
            outcome = self.watch.watch(stream, spec, self.commit, lambda: self.between_steps(stream))
        finally:  # the ranks' watches of the segment end with it
            self.fleet.end_attempt(spec.attempt)
        not_caught_up = self.state_sources.caught_up(spec.first_step, outcome.healed)
        settled = max(outcome.committed_until, self.charged_until)
        self.ledger.charge("committed", settled - self.charged_until)
        discarded = outcome.failure is not None or outcome.nonfinite is not None
        self.ledger.charge("discarded" if discarded else "committed", self.clock() - settled)
        if outcome.failure is not None or not_caught_up:  # a joining group that holds no state reported failing
            failure = outcome.failure or FailureSeen(Diagnosis({}, not_caught_up, {}), self.clock())
            return Recovering(failure.diagnosis, FailedWork.STEP, outcome.committed_until, failure.seen_at)
        if outcome.nonfinite is not None:  # every rank discarded it: tried again from the same state
            step = outcome.nonfinite
            self.history.discard_nonfinite(step)
            self.events.emit(EventKind.NONFINITE_STEP, step=step.step, loss=str(step.loss), grad_norm=str(step.grad_norm),
                             overflow=step.overflow,
                             **({"loss_scale": self.history.loss_scale.value} if step.overflow else {}))
            diverged = None if step.overflow else self.divergence.diverged(step)
            return Stopping(diverged) if diverged else AtBoundary()
        self.maybe_checkpoint()
        return AtBoundary()

    def segment_spec(self) -> SegmentSpec:
        self.attempts += 1
        return SegmentSpec(
            attempt=self.attempts, first_step=self.history.step, stop_step=self.next_boundary(),
            cursor=self.history.cursor, dataset_len=self.dataset_len, global_batch=self.config.global_batch,
            seed=self.config.seed, micro_batch=self.config.micro_batch, seq_len=self.config.data.seq_len,
            group_weights=group_weights(self.membership.live_groups(), self.stragglers.weights),
            schedule=self.config.lr_schedule, clip_grad_norm=self.config.optimizer.clip_grad_norm,
            deadline_s=self.deadline.seconds(), replicas_build=self.groups.replicas_build,
            records_interval_s=RECORDS_INTERVAL_S, loss_scale=self.history.loss_scale,
            integrity_every=self.config.integrity.every, memory_every=self.config.checkpoint.memory_every,
            replay_every=self._replay_every(),
            catch_up=self.state_sources.take_catch_up(),
        )

    def _replay_every(self) -> int:
        """The spot checks' interval for a segment: none under DiLoCo (the learners differ inside a
        round), with dropout (a replay draws other random numbers), nor for a group alone."""
        config, live = self.config, len(self.membership.live_groups())
        replayable = config.sync.outer_rounds is None and not config.model.dropout and live >= MIN_GROUPS
        return config.integrity.replay_every if replayable else 0

    def next_boundary(self) -> int:
        every = (self.checkpoints.catalog.every if self.checkpoints else 0, self.config.eval.every)
        fault_step = self.faults.next_step_after(self.history.step) if self.faults is not None else None
        return segment_boundary(self.history.step, self.config.steps, every, fault_step)

    def between_steps(self, stream: SegmentStream) -> None:
        """The driver's own duties while a segment goes on: commit a finished upload, move
        joining groups on, and ask the ranks to pause when something needs a boundary."""
        if self.checkpoints is not None:
            self.checkpoints.poll()
        self.groups.grow()
        if self.groups.joining():
            self.groups.advance_groups()
        if not self.pause_requested and self.boundary_needed():
            self.pause_requested = True
            # One rank is told: its flag enters its position's cross-group sum and every
            # group's vote, so every rank stops after the same step (one call at any size).
            self.fleet.request_pause(stream.ranks[:1], stream.attempt)

    def boundary_needed(self) -> bool:
        return bool(
            self.stop_requested.is_set()
            or self.straggler_actions_ready()
            or self.membership.groups_in(GroupStage.READY)
            or self.groups.start_failed()
            or (self.checkpoints is not None and self.checkpoints.due and self.checkpoints.in_flight is None)
            or (self.faults is not None and self.faults.time_fault_due())
        )

    def straggler_actions_ready(self) -> bool:
        uploading = self.checkpoints.in_flight if self.checkpoints is not None else None
        return self.stragglers.ready(None if uploading is None else frozenset(uploading.ranks))

    def commit(self, message: SegmentRecords, index: int) -> None:
        """A step every group committed, the message's ``index``-th: detector, history, deadline, recovery, listeners."""
        arrays = RankArrays.of_records(message, index, self.topology)
        scores = self.stragglers.on_commit(self.history.step, arrays, self.fleet.has_spare_slot)
        result = self.history.commit(message, index, arrays, generation=self.membership.generation,
                                     t=self.events.elapsed(), straggler_scores=scores)
        self.deadline.record(result.step_s)
        self.divergence.committed()
        self.timing.close(self.history.step)
        # Charged as each step commits, not when its segment ends: goodput and the committed
        # time are live between boundaries, which may be hundreds of steps apart.
        now = self.clock()
        self.ledger.charge("committed", now - self.charged_until)
        self.charged_until = now
        if result.replayed:
            self.events.emit(EventKind.STEP_REPLAYED, step=result.step)
        for listener in self.step_listeners:
            listener(result)

    # evaluation

    def eval_due(self) -> bool:
        return self.history.eval_due(self.config.eval.every, self.config.steps)

    def run_eval(self) -> RunState:
        started = self.clock()
        self.attempts += 1
        outcome = self.evaluation.run(self.history.step, self.membership.live_groups(), self.attempts)
        if isinstance(outcome, FailureSeen):
            return Recovering(outcome.diagnosis, FailedWork.EVALUATION, started, outcome.seen_at)
        self.history.eval_results.append(outcome)
        return AtBoundary()

    # failures: every kind a Diagnosis, recovered from in Recovering

    def control_call_failed(self, error: FleetError, during: str) -> Recovering:
        involved = set(error.ranks) | set(self.topology.ranks_of(
            [*self.membership.live_groups(), *self.membership.groups_in(GroupStage.READY)]))
        text = describe_error(error, 300)
        diagnosis = diagnose_control_failure(
            failed_on=error.ranks, dead=involved - self.fleet.responsive(sorted(involved)),
            group_of={r: self.topology.group_of(r) for r in involved},
            error=text)
        now = self.clock()
        return Recovering(diagnosis, FailedWork.CONTROL_CALL, now, now, error=text,
                          events={"during": during, "error": text})

    def group_start_failed(self) -> Recovering:
        diagnosis = self.groups.take_failed_starts()
        now = self.clock()
        return Recovering(diagnosis, FailedWork.GROUP_START, now, now, error="; ".join(diagnosis.errors.values()),
                          events={"during": "start"})

    def recover(self, failure: Recovering) -> None:
        diagnosis, step = failure.diagnosis, self.history.step
        drained = self.clock()
        self.events.emit(EventKind.FAILURE_DIAGNOSED, cause=diagnosis.cause, work=failure.failed.value, step=step,
                         culprits=diagnosis.culprits)
        refusal = self.failures.refusal(step, diagnosis)
        if refusal is not None:
            raise TrainingStopped(f"{failure.describe(step)}: {refusal}")
        if failure.failed is FailedWork.CONTROL_CALL and self.resume is not None and not self.history.has_state:
            # Failed before the resume's restore began: every group is rebuilt and restores it.
            self.history.first_step = self.resume.step
            self.state_sources.rewind(self.resume)
            for group in self.membership.live_groups():
                self.groups.rebuild(group)
        if diagnosis.cause is Cause.SILENT_CORRUPTION:
            # every group applied the wrong gradients of the steps since the last clean spot check
            diagnosis = self.state_sources.after_mismatch(diagnosis, self.history.replayed_step,
                                                          every_group=self.history.replayed_step < self.history.step)
        elif diagnosis.corrupt:
            diagnosis = self.state_sources.after_mismatch(diagnosis, self.history.verified_step)
        # groups joined to catch up that no segment saw catch up hold no state
        diagnosis = replace(diagnosis, broken_groups=diagnosis.broken_groups | self.state_sources.unconfirmed())
        live = self.membership.live_groups()
        plan = plan_recovery(diagnosis, self.topology, live)
        if failure.failed in (FailedWork.STEP, FailedWork.EVALUATION):  # what failed is said before what it costs
            self.events.emit(
                EventKind.STEP_DISCARDED if failure.failed is FailedWork.STEP else EventKind.EVAL_DISCARDED,
                step=step, cause=diagnosis.cause, culprits=diagnosis.culprits,
                broken_groups=sorted(diagnosis.broken_groups), errors=diagnosis.errors,
            )
        for eviction in plan.evictions:
            if eviction.failed_the_step:
                self.events.emit(EventKind.RANK_FAILED, rank=eviction.rank, group=eviction.group,
                                 cause=eviction.cause, step=step, **failure.events)
            self.groups.evict(eviction.rank, eviction.cause)
        rounds = self.config.sync.outer_rounds
        lost = [group for group in plan.rebuilding if group in live]
        if not self.context.between_rounds and plan.survivors and lost:  # DiLoCo's round lost a learner
            # (a group whose outer step failed holds an update of no committed step: it is broken)
            if rounds.drops:
                self.drop_learners(lost, step)
            elif not self.state_sources.redo_round(list(plan.survivors), rounds.start_of(step)):
                # no round's start in host memory: every group restores
                plan = replace(plan, rebuilding=tuple(sorted({*plan.rebuilding, *plan.survivors})), survivors=())
        for group in plan.rebuilding:
            if group in self.membership.groups:
                self.groups.rebuild(group)
        if self.checkpoints is not None:
            self.checkpoints.abandon_if_lost(plan.affected_groups)
        self.timing.open(diagnosis.cause, diagnosis.culprits, failure.started,
                         detect_s=failure.seen_at - failure.started, drain_s=drained - failure.seen_at)
        if failure.failed is FailedWork.STEP:
            self.history.steps_discarded += 1

    def drop_learners(self, groups: list[int], step: int) -> None:
        """DiLoCo's ``drop``: the learners ``groups`` lost inside the round leave it; what they
        trained of it goes back into the data plan, and the others finish the round without them."""
        config = self.config
        returned = [index for group in groups
                    for index in dropped_samples(self.history.round_steps_of(group), group,
                                                 dataset_len=self.dataset_len, global_batch=config.global_batch,
                                                 seed=config.seed)]
        self.history.return_samples(groups, returned)
        self.events.emit(EventKind.LEARNER_DROPPED, step=step, groups=groups,
                         round_start=config.sync.outer_rounds.start_of(step), returned_samples=len(returned))

    # checkpoints and the end of the run

    def maybe_checkpoint(self) -> None:
        if self.straggler_actions_ready():
            return  # the boundary replaces the slow rank first; the save, still due, follows at the next
        if (self.checkpoints is not None and self.context.between_rounds
                and self.checkpoints.wants_save(self.history.step)):
            self.checkpoints.start(self.history.step, self.history.cursor, *self.groups.saving_group(),
                                   loss_scale=self.history.loss_scale)

    def finish(self, reason: Exit) -> Exit:
        """The run's end: the last committed step checkpointed within the grace period, or
        ``reason`` marks the final checkpoint missed (never, when checkpoints are off)."""
        self.stragglers.close()
        if self.checkpoints is None:
            return reason
        grace_s = self.config.checkpoint.grace_s
        # inside a DiLoCo round (a divergence stops the run there) no group holds the run's state
        if self.membership.live_groups() and self.context.between_rounds:
            with self.ledger.timing("checkpoint_stall"):
                if self.checkpoints.finish(self.history.step, self.history.cursor, *self.groups.saving_group(),
                                           self.clock() + grace_s, loss_scale=self.history.loss_scale):
                    return reason
        self.events.emit(EventKind.FINAL_CHECKPOINT_MISSED, step=self.history.step, reason=str(reason), grace_s=grace_s)
        return replace(reason, final_checkpoint_missed_at=self.history.step)


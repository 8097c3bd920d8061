"""The groups' way into the quorum and out of it, at step boundaries: reserve a placement,
start the ranks, build the group's world, heal it from a live group (or restore the state
when none is live), join it, rebuild the cross-group process groups; evict ranks and apply
straggler actions. The controller decides when; this module does it through the fleet and
keeps the membership's lifecycle (``elastic.core.membership``) in step with it.

A group that fails to start or build is not handled here: its failure is kept as a
``Diagnosis`` for the controller to recover from like any other failure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from checkpointing.catalog import Restorable
from elastic.driver.checkpoint_coordinator import CheckpointCoordinator
from elastic.setup.config import TrainConfig
from elastic.core.data_plan import DataCursor
from elastic.core.diagnosis import DEATH, OWN_ERROR, Diagnosis
from elastic.core.events import EventKind, EventLog
from elastic.core.memory_tier import choose_buddies, plan_memory_restore
from elastic.core.membership import Broken, Built, GroupStage, Membership, Placed, Started
from elastic.core.policies import ScalingPolicy
from elastic.core.protocol import describe_error
from elastic.core.straggler_mitigation import StragglerActions, StragglerMitigation
from elastic.fleet.api import CallFailed, FleetApi, FleetError, Pending, RanksLost
from elastic.driver.progress import RunProgress
from elastic.driver.recovery_timing import RecoveryTiming
from elastic.driver.spare_keeper import SpareKeeper

# How often the boundary polls groups on their way into the quorum.
JOIN_POLL_S = 0.05


class TrainingStopped(RuntimeError):
    """The job cannot go on (below minimum, no live peer, recoveries exhausted)."""


class GroupKeeper:
    def __init__(self, config: TrainConfig, fleet: FleetApi, membership: Membership, progress: RunProgress,
                 timing: RecoveryTiming, events: EventLog, clock: Callable[[], float], sleep: Callable[[float], None],
                 checkpoints: CheckpointCoordinator | None, stragglers: StragglerMitigation | None):
        self.config = config
        self.fleet = fleet
        self.topology = fleet.topology
        self.membership = membership
        self.progress = progress
        self.timing = timing
        self.events = events
        self.clock = clock
        self.sleep = sleep
        self.checkpoints = checkpoints
        self.stragglers = stragglers
        self.scaling = ScalingPolicy(config.scaling.min_groups, config.scaling.max_groups)
        self.world_generation = 0
        self.replicas_stale = False  # the cross-group groups need a rebuild at the next boundary
        self.joining_calls: dict[int, Pending] = {}  # a group's start or build calls in flight
        self.joining_since: dict[int, float] = {}
        self.failed_starts: dict[int, Diagnosis] = {}  # groups that failed to start, for the controller
        # After an integrity mismatch: the newest step a restore may take the state from (a
        # later checkpoint may hold the corruption). None: the newest checkpoint.
        self.trusted_until: int | None = None
        self.node_of: dict[int, str] = {}  # each rank's node, as its last build reported it
        self.spares = SpareKeeper(config.scaling.spares, config.scaling.uses_gpu, fleet, events, clock)
        self.on_spares: set[int] = set()  # joining groups whose every new process is a warm spare

    # on the way in

    def reserve_group(self) -> int:
        group = self.membership.add_group()
        self.fleet.reserve(group)
        self.events.emit(EventKind.GROUP_RESERVED, group=group)
        return group

    def joining(self) -> bool:
        return any(record.stage is not GroupStage.LIVE for record in self.membership.groups.values())

    def in_flight(self) -> bool:
        return bool(self.membership.groups_in(GroupStage.STARTING) + self.membership.groups_in(GroupStage.BUILDING))

    def advance_groups(self) -> None:
        """Move every group on its way into the quorum one stage on, where it can go."""
        for group, record in list(self.membership.groups.items()):
            if record.stage in (GroupStage.LIVE, GroupStage.READY) or group in self.failed_starts:
                continue
            try:
                self._advance(group)
            except FleetError as error:
                self.joining_calls.pop(group, None)
                lost = error.ranks if isinstance(error, RanksLost) else [
                    rank for rank in self.topology.global_ranks(group) if not self.fleet.alive(rank)
                ]
                hooks_failed = error.hooks_failed if isinstance(error, CallFailed) else {}
                self.events.emit(EventKind.GROUP_START_FAILED, group=group, error=describe_error(error, 300))
                self.failed_starts[group] = Diagnosis(
                    culprits={**dict.fromkeys(lost, DEATH), **dict.fromkeys(hooks_failed, OWN_ERROR)},
                    broken_groups=frozenset({group}),
                    errors={rank: hooks_failed.get(rank, describe_error(error, 300)) for rank in error.ranks},
                )

    def _advance(self, group: int) -> None:
        self.joining_since.setdefault(group, self.clock())
        if self.membership.stage_of(group) is GroupStage.PLACING and self.fleet.placed(group):
            record = self.membership.apply(group, Placed())
            to_start = sorted(record.to_start)
            taken = self.spares.take(to_start, self.topology.global_ranks(group), self.node_of,
                                     self.progress.step)
            if to_start and len(taken) == len(to_start):
                self.on_spares.add(group)
            self.joining_calls[group] = self.fleet.start(to_start, taken)
        if self.membership.stage_of(group) is GroupStage.STARTING and self.fleet.done(self.joining_calls[group]):
            started = self.fleet.results(self.joining_calls[group])
            if self.stragglers is not None:
                for rank in started:
                    self.stragglers.forget(rank)  # a fresh process: its speed is not the old one's
            self.membership.apply(group, Started())
            self.world_generation += 1
            self.joining_calls[group] = self.fleet.build(self.topology.global_ranks(group), self.world_generation)
        if self.membership.stage_of(group) is GroupStage.BUILDING and self.fleet.done(self.joining_calls[group]):
            built = self.fleet.results(self.joining_calls.pop(group))
            self.node_of.update({rank: report.node_ip for rank, report in built.items() if report is not None})
            self.membership.apply(group, Built())
            seconds = self.clock() - self.joining_since[group]
            self.events.emit(EventKind.GROUP_BUILT, group=group, seconds=round(seconds, 3))

    def join_ready_groups(self) -> bool:
        ready = list(self.membership.groups_in(GroupStage.READY))
        if not ready:
            return False
        live = self.membership.live_groups()
        if self.progress.has_state:
            try:
                if live:
                    self._heal_from_peers(ready, live[0])
                else:
                    self._restore(ready)
            except FleetError:
                for group in ready:  # what they hold now is unknown: build them afresh
                    self.membership.apply(group, Broken())
                raise
        self.trusted_until = None
        for group in ready:
            self.joining_since.pop(group, None)
            self.on_spares.discard(group)
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
        self.timing.add("heal_s", seconds)
        for group in groups:
            self.events.emit(EventKind.GROUP_HEALED, group=group, source_group=source_group, seconds=round(seconds, 4))

    def _restore(self, groups: list[int]) -> None:
        """No live peer holds the state: roll back to the latest committed checkpoint (the
        latest the replicas' check verified, after a mismatch) or, before the first one, to
        the initial state the seed determines, which groups that were just built hold already."""
        if self._restore_from_memory(groups):
            return
        checkpoint = self.checkpoints.latest(self.trusted_until) if self.checkpoints else None
        if checkpoint is not None:
            self.restore_checkpoint(groups, checkpoint)
        elif self.progress.first_step == 0:
            rolled_back = self.rewind(None)
            self.events.emit(EventKind.RESTORED_INITIAL_STATE, step=0, groups=groups, rolled_back_steps=rolled_back,
                             seed=self.config.seed)
        else:
            positions = [self.topology.position_of(rank) for rank in self.topology.global_ranks(groups[0])]
            raise TrainingStopped(
                f"every copy of the state is lost (shard, tp positions {positions}): no live group holds it, "
                f"no committed checkpoint is left, and the run resumed from step {self.progress.first_step}, so "
                "the initial state is not its state; run with more replica groups (--groups) or checkpoint more "
                "often (--checkpoint-every N)"
            )

    def _restore_from_memory(self, groups: list[int]) -> bool:
        """Every rank of ``groups`` back at the newest step the memory tier holds for all of
        them (no newer than the last verified one, after a mismatch); False when it holds none."""
        if not self.config.checkpoint.memory_every:
            return False
        # a rank's copy may be held in any group, one still on its way back included
        holdings = self.fleet.memory_holdings(self.topology.ranks_of(self.membership.groups))
        plan = plan_memory_restore(self.topology.ranks_of(groups), holdings, self.trusted_until)
        if plan is None:
            return False
        started = self.clock()
        self.fleet.restore_memory(plan)
        seconds = self.clock() - started
        self.timing.add("heal_s", seconds)
        rolled_back = self._rewind_to(plan.step, plan.cursor)
        self.events.emit(EventKind.RESTORED_FROM_MEMORY, step=plan.step, groups=groups, rolled_back_steps=rolled_back,
                         from_buddies=[owner for _, owner in plan.transfers], seconds=round(seconds, 4),
                         host_bytes_per_rank=max(held.nbytes for held in holdings.values()))
        return True

    def after_mismatch(self, diagnosis: Diagnosis, verified_step: int) -> Diagnosis:
        """Replicas disagreed: no state after ``verified_step`` (the last check passed) is
        trusted. Since then the odd groups' gradients went into every group's update, so when
        the memory tier holds a verified copy for every live rank, every group goes back to
        it; else only the odd groups rebuild, and heal from the others."""
        self.trusted_until = verified_step
        live = self.membership.live_groups()
        if self.config.checkpoint.memory_every and live:
            ranks = self.topology.ranks_of(live)
            if plan_memory_restore(ranks, self.fleet.memory_holdings(ranks), verified_step) is not None:
                return replace(diagnosis, broken_groups=frozenset(live))
        return diagnosis

    def restore_checkpoint(self, groups: list[int], checkpoint: Restorable) -> None:
        seconds = self.checkpoints.restore(checkpoint, self.topology.ranks_of(groups))
        self.timing.add("heal_s", seconds)
        rolled_back = self.rewind(checkpoint)
        self.events.emit(
            EventKind.RESTORED_FROM_CHECKPOINT, step=checkpoint.step, groups=groups, rolled_back_steps=rolled_back,
            seconds=round(seconds, 4),
        )

    def rewind(self, checkpoint: Restorable | None) -> int:
        """Continue from a checkpoint's step and cursor (``None``: the initial state's);
        returns the committed steps rolled back."""
        if checkpoint is None:
            return self._rewind_to(0, DataCursor())
        return self._rewind_to(checkpoint.step, DataCursor(**checkpoint.manifest.cursor))

    def _rewind_to(self, step: int, cursor: DataCursor) -> int:
        rolled_back = self.progress.step - step
        self.progress.rewind(step, cursor)
        self.progress.steps_rolled_back += max(0, rolled_back)
        return rolled_back

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
        if self.config.checkpoint.memory_every:
            buddies = choose_buddies(self.topology, quorum.groups, self.node_of)
            self.fleet.set_buddies({rank: buddies.get(rank) for rank in assignments})
        self.replicas_stale = False
        seconds = self.clock() - started
        self.timing.add("rebuild_s", seconds)
        self.events.emit(EventKind.GROUPS_REBUILT, generation=quorum.generation, groups=list(quorum.groups),
                         ranks=len(assignments), seconds=round(seconds, 4))

    def grow(self) -> None:
        """Reserve one more group while the scaling policy wants more; start the spares missing."""
        if self.scaling.wants_more(len(self.membership.groups), self.clock()):
            self.reserve_group()
        self.spares.tend(bool(self.membership.live_groups()), self.progress.step)

    def settle(self, wait_for_spares_s: float = 0.0) -> None:
        """Grow toward max groups, move joining groups along, and hold below the minimum
        (returns early when a group failed to start: the controller recovers first).

        A group coming back on warm spares is built in well under a step: it is waited for,
        up to ``wait_for_spares_s``, rather than leave the survivors to start a step alone
        at twice its time and keep the group waiting at the boundary until it ends."""
        self.grow()
        waited_from = self.clock()
        while not self.failed_starts:
            self.advance_groups()
            self.join_ready_groups()
            live = len(self.membership.live_groups())
            coming = (bool(self.on_spares & set(self.membership.groups))
                      and self.clock() - waited_from < wait_for_spares_s)
            if live and not self.scaling.below_minimum(live) and not coming:
                return
            waited = self.clock() - waited_from
            limit = self.config.fault_tolerance.capacity_timeout_s + (
                0 if self.progress.has_state else self.config.fault_tolerance.first_step_deadline_s
            )
            if waited > limit:
                raise TrainingStopped(
                    f"below the minimum of {self.scaling.min_groups} live replica group(s) "
                    f"({live} live) for {waited:.0f}s; groups waiting: {self.membership.waiting_groups()} "
                    "('placing' means the cluster cannot place shard x tp ranks); "
                    "add capacity, lower scaling.min_groups, or raise fault_tolerance.capacity_timeout_s"
                )
            self.sleep(JOIN_POLL_S)

    def saving_group(self) -> tuple[int, list[int]]:
        """The live group whose ranks save checkpoints (and report the final state), and its ranks."""
        group = self.membership.live_groups()[0]
        return group, self.topology.ranks_of([group])

    # on the way out

    def evict(self, rank: int, cause: str) -> int:
        """Kill the rank's process; its group leaves the quorum to replace it. Returns the group."""
        self.fleet.kill(rank)
        group = self.topology.group_of(rank)
        self.joining_calls.pop(group, None)
        self.failed_starts.pop(group, None)
        self.on_spares.discard(group)
        self.membership.lose_rank(rank)
        self.events.emit(EventKind.RANK_EVICTED, rank=rank, group=group, cause=cause)
        return group

    def rebuild(self, group: int) -> None:
        """The group's world is gone: it builds again (its live processes are kept)."""
        self.joining_calls.pop(group, None)
        self.failed_starts.pop(group, None)
        self.on_spares.discard(group)
        self.membership.apply(group, Broken())

    def apply_straggler_actions(self, actions: StragglerActions) -> None:
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

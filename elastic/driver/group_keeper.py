"""A group's lifecycle, at step boundaries: reserve a placement, start the ranks (on warm
spares where there are), build the group's world, bring it the run's state
(``state_sources``), join it to the quorum and rebuild the cross-group process groups; on the
way out, evict a rank (its group builds again) or a whole group (a straggler action). Growing
toward the scaling policy's size, and holding below its minimum, happen here too. The
controller decides when; this module does it through the fleet and keeps the membership's
lifecycle (``elastic.core.membership``) in step with it.

A group that fails to start or build is not recovered here: its failure is kept as a
``Diagnosis`` until the controller takes it (``take_failed_starts``) to recover from like any
other failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from elastic.core.diagnosis import Cause, Diagnosis, merged
from elastic.core.events import EventKind
from elastic.core.memory_tier import BuddyPairing
from elastic.core.membership import Broken, Built, GroupStage, Placed, Started
from elastic.core.policies import ScalingPolicy, catch_up_pays
from elastic.core.topology import Position
from elastic.core.protocol import describe_error
from elastic.core.straggler_mitigation import StragglerActions, StragglerMitigation
from elastic.driver.run_context import RunContext
from elastic.driver.spare_keeper import SpareKeeper
from elastic.driver.state_sources import StateSources
from elastic.driver.stopped import TrainingStopped
from elastic.fleet.api import CallFailed, FleetError, Pending, RanksLost

# How often the boundary polls groups on their way into the quorum.
JOIN_POLL_S = 0.05


class GroupKeeper:
    def __init__(self, run: RunContext, state_sources: StateSources, sleep: Callable[[float], None],
                 stragglers: StragglerMitigation | None):
        config, fleet, events, clock = run.config, run.fleet, run.events, run.clock
        self.run = run
        self.config = config
        self.fleet = fleet
        self.topology = run.topology
        self.membership = run.membership
        self.history = run.history
        self.state_sources = state_sources
        self.timing = run.timing
        self.events = events
        self.clock = clock
        self.sleep = sleep
        self.stragglers = stragglers
        self.scaling = ScalingPolicy(config.scaling.min_groups, config.scaling.max_groups)
        self.world_build = 0  # numbers each build of a group's world: its process groups' store prefix
        self.replicas_build = 0  # numbers each build of the cross-group groups, as world_build does a world's
        self.joining_calls: dict[int, Pending] = {}  # a group's start or build calls in flight
        self.joining_since: dict[int, float] = {}
        self.stage_since: dict[int, float] = {}  # when a group's start or build call went out
        self.start_s: dict[int, float] = {}  # how long a building group's processes took to start
        self.started: dict[int, int] = {}  # a starting group's new processes up so far
        self._failed_starts: dict[int, Diagnosis] = {}  # groups that failed to start, until the controller takes them
        self.node_of: dict[int, str] = {}  # each rank's node, as its last build reported it
        self.pairing = BuddyPairing(self.topology)  # the memory tier's buddies, kept across quorum changes
        self.spares = SpareKeeper(config.scaling.spares, config.scaling.uses_gpu, fleet, events, clock)
        self.on_spares: set[int] = set()  # joining groups whose every new process is a warm spare
        # DiLoCo's learners lost in a round: the round is redone with them, so the run waits for
        # them to come back (up to capacity_timeout_s, then goes on without them)
        self.lost_learners: set[int] = set()

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

    def start_failed(self) -> bool:
        """Whether a group failed to start or build since the controller last took the failures."""
        return bool(self._failed_starts)

    def take_failed_starts(self) -> Diagnosis:
        """The groups' failures to start, as one diagnosis; they are the controller's to recover
        from now, and the groups are left alone until it rebuilds them."""
        diagnosis, self._failed_starts = merged(self._failed_starts.values()), {}
        return diagnosis

    def advance_groups(self) -> None:
        """Move every group on its way into the quorum one stage on, where it can go."""
        for group, record in list(self.membership.groups.items()):
            if record.stage in (GroupStage.LIVE, GroupStage.READY) or group in self._failed_starts:
                continue
            try:
                self._advance(group)
            except FleetError as error:
                self.joining_calls.pop(group, None)
                self.started.pop(group, None)
                lost = error.ranks if isinstance(error, RanksLost) else [
                    rank for rank in self.topology.global_ranks(group) if not self.fleet.alive(rank)
                ]
                own_errors = error.own_errors if isinstance(error, CallFailed) else {}
                self.events.emit(EventKind.GROUP_START_FAILED, group=group, error=describe_error(error, 300))
                self._failed_starts[group] = Diagnosis(
                    culprits={**dict.fromkeys(lost, Cause.DEATH), **dict.fromkeys(own_errors, Cause.OWN_ERROR)},
                    broken_groups=frozenset({group}),
                    errors={rank: own_errors.get(rank, describe_error(error, 300)) for rank in error.ranks},
                )

    def _advance(self, group: int) -> None:
        self.joining_since.setdefault(group, self.clock())
        if self.membership.stage_of(group) is GroupStage.PLACING and self.fleet.placed(group):
            record = self.membership.apply(group, Placed())
            to_start = sorted(record.to_start)
            taken = self.spares.take(to_start, self.topology.global_ranks(group), self.node_of,
                                     self.history.step)
            if to_start and len(taken) == len(to_start):
                self.on_spares.add(group)
            self.joining_calls[group] = self.fleet.start(to_start, taken)
            self.stage_since[group] = self.clock()
            self._count_started(group, 0)
        if self.membership.stage_of(group) is GroupStage.STARTING:
            up = self.fleet.answered(self.joining_calls[group])  # one look at the start's calls a poll
            if up < len(self.joining_calls[group].refs):
                self._count_started(group, up)
                return
            self.started.pop(group, None)
            started = self.fleet.results(self.joining_calls[group])
            self.start_s[group] = self.clock() - self.stage_since[group]
            self.timing.longest("start_s", self.start_s[group])
            if self.stragglers is not None:
                for rank in started:
                    self.stragglers.forget(rank)  # a fresh process: its speed is not the old one's
            self.membership.apply(group, Started())
            self.world_build += 1
            self.joining_calls[group] = self.fleet.build(self.topology.global_ranks(group), self.world_build)
            self.stage_since[group] = self.clock()
        if self.membership.stage_of(group) is GroupStage.BUILDING and self.fleet.done(self.joining_calls[group]):
            built = self.fleet.results(self.joining_calls.pop(group))
            for rank, report in built.items():
                if report is not None:
                    self.node_of[rank] = report.node_ip
                    self.state_sources.built(report.parameter_bytes)
            self.membership.apply(group, Built())
            build_s = self.clock() - self.stage_since.pop(group)
            self.timing.longest("build_s", build_s)
            seconds = self.clock() - self.joining_since[group]
            self.events.emit(EventKind.GROUP_BUILT, group=group, seconds=round(seconds, 3),
                             start_s=round(self.start_s.pop(group, 0.0), 3), build_s=round(build_s, 3))

    def _count_started(self, group: int, count: int) -> None:
        """A start's progress, said as it goes: on a busy host a group's processes can take
        minutes to start, and a console that says nothing looks hung."""
        if self.started.get(group) == count:
            return
        self.started[group] = count
        self.events.emit(EventKind.GROUP_STARTING, group=group, started=count,
                         ranks=len(self.joining_calls[group].refs),
                         seconds=round(self.clock() - self.stage_since[group], 3))

    def progress(self) -> tuple:
        """What the waiting groups have reached: it changes while any of them moves on."""
        return tuple((group, stage, self.started.get(group)) for group, stage in self.membership.waiting_groups().items())

    def join_ready_groups(self, steps_next: bool = False, step_s: float = 0.0) -> bool:
        """Join the groups built; ``steps_next``: the run steps next (a typical step of
        ``step_s``), so they take the state over its replicate group, while it steps where that
        pays (``state_sources``)."""
        ready = list(self.membership.groups_in(GroupStage.READY))
        live = self.membership.live_groups()
        if not ready:
            return False
        # Below the minimum the live groups were not stepping: the groups heal first and the
        # steps keep their split (a model that draws random numbers draws them as it would have).
        # DiLoCo's learners sum no gradients to catch up with.
        catch_up = (steps_next and not self.scaling.below_minimum(len(live)) and self.config.sync.outer_rounds is None
                    and catch_up_pays(self.state_sources.expected_copy_s(), step_s, len(live), len(ready)))
        try:
            if live and not self.run.between_rounds:  # a DiLoCo learner joins between rounds, or from a round's start
                if not self._joins_round(ready):
                    return False
            else:
                self.state_sources.load(ready, live, steps_next=steps_next, overlap=catch_up)
        except FleetError:
            for group in ready:  # what they hold now is unknown: build them afresh
                self.membership.apply(group, Broken())
            raise
        for group in ready:
            self.joining_since.pop(group, None)
            self.on_spares.discard(group)
            self.lost_learners.discard(group)
        self.membership.join(ready)
        for group in ready:
            self.events.emit(EventKind.GROUP_JOINED, group=group, generation=self.membership.generation)
        self.rebuild_replicas(joined=ready)
        return True

    def _joins_round(self, ready: list[int]) -> bool:
        """Under DiLoCo's drop, groups ready inside a round join it as learners from its start,
        where the memory tier holds it for them (``StateSources.join_round``), and take their
        shares of its remaining steps; else (and where experts' routing bias has moved since the
        round began, which the round's start does not hold) they join between rounds."""
        rounds, model = self.config.sync.outer_rounds, self.config.model
        if not rounds.drops or (model.experts and model.expert_bias_rate):
            return False
        return self.state_sources.join_round(ready, rounds.start_of(self.history.step))

    def rebuild_replicas(self, joined: Iterable[int] = ()) -> None:
        """New cross-group process groups over the quorum's groups: a new build, which the
        ranks enter themselves as the next segment starts (``SegmentSpec.replicas_build``), each
        only its position's, with no call per rank; and, with the memory tier, a buddy for each
        rank of the ``joined`` groups and each rank whose buddy left."""
        started = self.clock()
        quorum = self.membership.quorum()
        self.replicas_build += 1
        if self.config.checkpoint.memory_every:
            self.fleet.set_buddies(self.pairing.update(quorum.groups, self.node_of, renewed=joined))
        seconds = self.clock() - started
        self.timing.add("rebuild_s", seconds)
        self.events.emit(EventKind.GROUPS_REBUILT, generation=quorum.generation, build=self.replicas_build,
                         groups=list(quorum.groups), ranks=len(self.topology.ranks_of(quorum.groups)),
                         seconds=round(seconds, 4))

    def grow(self) -> None:
        """Reserve one more group while the scaling policy wants more; start the spares missing."""
        if self.scaling.wants_more(len(self.membership.groups), self.clock()):
            self.reserve_group()
        self.spares.tend(bool(self.membership.live_groups()), self.history.step)

    def settle(self, step_s: float = 0.0, steps_next: bool = False) -> None:
        """Grow toward max groups, move joining groups along, and hold below the minimum
        (returns early when a group failed to start: the controller recovers first).

        A group coming back on warm spares is built in well under a step: it is waited for,
        up to a typical step (``step_s``), rather than leave the survivors to start a step alone
        at twice its time and keep the group waiting at the boundary until it ends.
        ``steps_next``: the run steps next, so groups that join take the state in its segment."""
        self.grow()
        waited_from = progressed_at = self.clock()
        reached = self.progress()
        while not self._failed_starts:
            self.advance_groups()
            self.join_ready_groups(steps_next, step_s)
            live = len(self.membership.live_groups())
            coming = ((bool(self.on_spares & set(self.membership.groups)) and self.clock() - waited_from < step_s)
                      or self._learner_coming_back(waited_from))
            if live and not self.scaling.below_minimum(live) and not coming:
                return
            if self.progress() != reached:  # a group moved on: the wait is for capacity, not progress
                reached, progressed_at = self.progress(), self.clock()
            ft = self.config.fault_tolerance
            before_first_step = "" if self.history.has_state else f" + first_step_deadline_s {ft.first_step_deadline_s:g}"
            limit = ft.capacity_timeout_s + (0 if self.history.has_state else ft.first_step_deadline_s)
            stalled = self.clock() - progressed_at
            if stalled > limit:
                raise TrainingStopped(
                    f"below the minimum of {self.scaling.min_groups} live replica group(s) ({live} live), no group "
                    f"moving on for {stalled:.0f}s (fault_tolerance.capacity_timeout_s {ft.capacity_timeout_s:g}"
                    f"{before_first_step}); groups waiting: {self.membership.waiting_groups()} ('placing' means the "
                    "cluster cannot place a group's pp x shard x cp x tp ranks); add capacity, lower "
                    "scaling.min_groups, or raise fault_tolerance.capacity_timeout_s"
                )
            self.sleep(JOIN_POLL_S)

    def _learner_coming_back(self, waited_from: float) -> bool:
        """A DiLoCo learner lost in the round is on its way back: the round waits for it, for at
        most ``capacity_timeout_s``; past that the run goes on with the learners it has (the
        data plan gives them every sample)."""
        self.lost_learners &= set(self.membership.groups)
        if self.lost_learners and self.clock() - waited_from > self.config.fault_tolerance.capacity_timeout_s:
            self.lost_learners.clear()
        return bool(self.lost_learners)

    def saving_group(self) -> tuple[int, list[int]]:
        """The live group whose ranks save checkpoints (and report the final state), and its ranks."""
        group = self.membership.live_groups()[0]
        return group, self.topology.ranks_of([group])

    def final_state(self) -> dict[Position, list]:
        """Committed local parameter shards of the saving group, by position."""
        _, ranks = self.saving_group()
        shards = self.fleet.local_parameters(ranks)
        return {self.topology.position_of(rank): shards[rank] for rank in ranks}

    # on the way out

    def evict(self, rank: int, cause: Cause) -> int:
        """Kill the rank's process; its group leaves the quorum to replace it. Returns the group."""
        if cause is not Cause.HANG:  # a hung rank was killed when its failure was seen, before the drain
            self.fleet.kill(rank)
        group = self.topology.group_of(rank)
        self.joining_calls.pop(group, None)
        self.started.pop(group, None)
        self._failed_starts.pop(group, None)
        self.on_spares.discard(group)
        self._leaving(group)
        self.membership.lose_rank(rank)
        self.events.emit(EventKind.RANK_EVICTED, rank=rank, group=group, cause=cause)
        return group

    def rebuild(self, group: int) -> None:
        """The group's world is gone: it builds again (its live processes are kept)."""
        self.joining_calls.pop(group, None)
        self.started.pop(group, None)
        self._failed_starts.pop(group, None)
        self.on_spares.discard(group)
        self._leaving(group)
        self.membership.apply(group, Broken())

    def _leaving(self, group: int) -> None:
        """``group`` leaves the quorum: under DiLoCo's redo, a learner the round waits for."""
        rounds = self.config.sync.outer_rounds
        if rounds is not None and not rounds.drops and group in self.membership.live_groups():
            self.lost_learners.add(group)

    def apply_straggler_actions(self, actions: StragglerActions) -> None:
        live = set(self.membership.live_groups())
        changed = False
        for rank in actions.replace:
            if self.topology.group_of(rank) in live:  # else its group left since the decision
                self.evict(rank, Cause.STRAGGLER)
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
            self.events.emit(EventKind.GROUP_EVICTED, group=group, cause=Cause.STRAGGLER, regrow_after_s=cooldown_s)
            changed = True
        if changed and self.membership.live_groups():
            self.rebuild_replicas()

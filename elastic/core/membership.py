"""Membership: which replica groups train at the next step, and each group's lifecycle.

A rank is the unit of failure and a replica group the unit of elasticity. Every group moves
through one lifecycle, whether it is new or healing::

    PLACING --placed--> STARTING --started--> BUILDING --built--> READY --joined--> LIVE
       ^                                                                             |
       +------------------- rank-lost / broken (from any stage) ---------------------+

A new group starts every rank; a group that lost ranks starts only their replacements, and
a group whose world broke with all its processes alive starts none and only rebuilds. Its
placement is kept, so ``placed`` follows at once. ``transition`` is the one place these
moves are written; ``Membership`` applies them and owns the generation, which changes
exactly when the set of live groups does and names the process groups the ranks rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

from elastic.core.topology import Topology


class GroupStage(str, Enum):
    PLACING = "placing"  # waiting for the cluster to place the group's bundles
    STARTING = "starting"  # rank processes starting
    BUILDING = "building"  # the group's world and model being built
    READY = "ready"  # built, waiting for the step boundary to heal and join
    LIVE = "live"  # in the quorum


@dataclass(frozen=True)
class Placed:
    pass


@dataclass(frozen=True)
class Started:
    pass


@dataclass(frozen=True)
class Built:
    pass


@dataclass(frozen=True)
class Joined:
    pass


@dataclass(frozen=True)
class RankLost:
    rank: int


@dataclass(frozen=True)
class Broken:
    pass


Change = Placed | Started | Built | Joined | RankLost | Broken


class IllegalTransition(ValueError):
    pass


@dataclass(frozen=True)
class GroupLifecycle:
    group: int
    stage: GroupStage
    to_start: frozenset[int] = frozenset()  # ranks whose process must (re)start


_FORWARD = {
    Placed: (GroupStage.PLACING, GroupStage.STARTING),
    Started: (GroupStage.STARTING, GroupStage.BUILDING),
    Built: (GroupStage.BUILDING, GroupStage.READY),
    Joined: (GroupStage.READY, GroupStage.LIVE),
}


def transition(lifecycle: GroupLifecycle, change: Change) -> GroupLifecycle:
    """The group's lifecycle after ``change``; raises ``IllegalTransition`` for a move the lifecycle lacks."""
    if isinstance(change, RankLost):
        return replace(lifecycle, stage=GroupStage.PLACING, to_start=lifecycle.to_start | {change.rank})
    if isinstance(change, Broken):
        return replace(lifecycle, stage=GroupStage.PLACING)
    source, target = _FORWARD[type(change)]
    if lifecycle.stage is not source:
        raise IllegalTransition(
            f"group {lifecycle.group}: {type(change).__name__} needs stage {source.value}, not {lifecycle.stage.value}"
        )
    if isinstance(change, Started):
        return replace(lifecycle, stage=target, to_start=frozenset())
    return replace(lifecycle, stage=target)


@dataclass(frozen=True)
class Quorum:
    generation: int
    groups: tuple[int, ...]

    def replica_rank(self, group: int) -> int:
        return self.groups.index(group)


class Membership:
    def __init__(self, topology: Topology):
        self.topology = topology
        self.generation = 0
        self.groups: dict[int, GroupLifecycle] = {}
        self._next_group = 0

    def add_group(self) -> int:
        group = self._next_group
        self._next_group += 1
        self.groups[group] = GroupLifecycle(group, GroupStage.PLACING, frozenset(self.topology.global_ranks(group)))
        return group

    def apply(self, group: int, change: Change) -> GroupLifecycle:
        was_live = self.groups[group].stage is GroupStage.LIVE
        lifecycle = self.groups[group] = transition(self.groups[group], change)
        if was_live != (lifecycle.stage is GroupStage.LIVE):
            self.generation += 1
        return lifecycle

    def lose_rank(self, global_rank: int) -> int:
        """The rank's process is gone: its group leaves the quorum to replace it. Returns the group."""
        group = self.topology.group_of(global_rank)
        self.apply(group, RankLost(global_rank))
        return group

    def join(self, groups: list[int]) -> None:
        """Ready groups enter the quorum together: one new generation for all of them."""
        for group in groups:
            self.groups[group] = transition(self.groups[group], Joined())
        if groups:
            self.generation += 1

    def remove_group(self, group: int) -> None:
        if self.groups.pop(group).stage is GroupStage.LIVE:
            self.generation += 1

    def stage_of(self, group: int) -> GroupStage:
        return self.groups[group].stage

    def groups_in(self, stage: GroupStage) -> tuple[int, ...]:
        return tuple(sorted(g for g, lifecycle in self.groups.items() if lifecycle.stage is stage))

    def live_groups(self) -> tuple[int, ...]:
        return self.groups_in(GroupStage.LIVE)

    def waiting_groups(self) -> dict[int, str]:
        """Groups not in the quorum, with the stage each is waiting in."""
        return {g: r.stage.value for g, r in sorted(self.groups.items()) if r.stage is not GroupStage.LIVE}

    def quorum(self) -> Quorum:
        return Quorum(self.generation, self.live_groups())

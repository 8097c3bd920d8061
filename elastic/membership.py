"""Membership and quorum: which replica groups train at the next step. Pure, no Ray.

A rank is the unit of failure and a replica group the unit of elasticity. A group is
``live`` when all its ranks are built and hold the job's state; a group that lost a rank
(or whose world broke) sits out as ``healing`` until its members rebuild and copy state
from a live peer. Every change to the set of live groups bumps the generation, which names
the process groups the workers rebuild.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class GroupState(str, Enum):
    LIVE = "live"
    HEALING = "healing"
    JOINING = "joining"


@dataclass
class GroupRecord:
    group: int
    state: GroupState
    dead_ranks: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Quorum:
    generation: int
    groups: tuple[int, ...]

    def replica_rank(self, group: int) -> int:
        return self.groups.index(group)


class Membership:
    def __init__(self, shard: int, tp: int):
        self.ranks_per_group = shard * tp
        self.tp = tp
        self.generation = 0
        self.groups: dict[int, GroupRecord] = {}
        self._next_group = 0

    def global_ranks(self, group: int) -> range:
        return range(group * self.ranks_per_group, (group + 1) * self.ranks_per_group)

    def ranks_of(self, groups) -> list[int]:
        return [rank for group in groups for rank in self.global_ranks(group)]

    def group_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_group

    def position_of(self, global_rank: int) -> tuple[int, int]:
        local = global_rank % self.ranks_per_group
        return divmod(local, self.tp)

    def add_group(self) -> int:
        group = self._next_group
        self._next_group += 1
        self.groups[group] = GroupRecord(group, GroupState.JOINING)
        return group

    def live_groups(self) -> tuple[int, ...]:
        return tuple(sorted(g for g, record in self.groups.items() if record.state is GroupState.LIVE))

    def waiting_groups(self) -> tuple[int, ...]:
        return tuple(sorted(g for g, record in self.groups.items() if record.state is not GroupState.LIVE))

    def quorum(self) -> Quorum:
        return Quorum(self.generation, self.live_groups())

    def _leave(self, group: int, state: GroupState) -> None:
        if self.groups[group].state is GroupState.LIVE:
            self.generation += 1
        self.groups[group].state = state

    def evict_rank(self, global_rank: int) -> int:
        group = self.group_of(global_rank)
        self.groups[group].dead_ranks.add(global_rank)
        self._leave(group, GroupState.HEALING)
        return group

    def mark_broken(self, group: int) -> None:
        self._leave(group, GroupState.HEALING)

    def replaced(self, global_rank: int) -> None:
        self.groups[self.group_of(global_rank)].dead_ranks.discard(global_rank)

    def join(self, groups: list[int]) -> None:
        for group in groups:
            self.groups[group].state = GroupState.LIVE
        if groups:
            self.generation += 1

    def remove_group(self, group: int) -> None:
        self._leave(group, GroupState.HEALING)
        del self.groups[group]

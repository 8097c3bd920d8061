"""A failed step's recovery, planned from its diagnosis: who is evicted, which groups rebuild,
which groups still train. Pure; the controller carries the plan out once.

Culprits (dead, hung, or raising about themselves) are replaced with fresh processes. A
rank stuck in its own group's collectives cannot be released either, and its group heals
from a live peer anyway, so it is replaced too. Every group that lost a rank or whose world
failed leaves the quorum to rebuild; the other live groups survive with their committed
state, rebuild only their cross-group process groups, and are the sources to heal from.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from elastic.core.diagnosis import Cause, Diagnosis
from elastic.core.topology import Topology


@dataclass(frozen=True)
class Eviction:
    rank: int
    group: int
    cause: Cause  # the diagnosis' cause for a culprit, STUCK_IN_COLLECTIVE for a stuck rank

    @property
    def failed_the_step(self) -> bool:
        return self.cause != Cause.STUCK_IN_COLLECTIVE


@dataclass(frozen=True)
class RecoveryPlan:
    cause: str
    evictions: tuple[Eviction, ...]
    rebuilding: tuple[int, ...]  # groups leaving the quorum to rebuild (and heal)
    survivors: tuple[int, ...]  # live groups that keep their state

    @property
    def affected_groups(self) -> frozenset[int]:
        """Groups whose ranks may no longer hold (or be writing) their state."""
        return frozenset(self.rebuilding)


def plan_recovery(diagnosis: Diagnosis, topology: Topology, live_groups: Iterable[int]) -> RecoveryPlan:
    evictions = tuple(
        [Eviction(rank, topology.group_of(rank), cause) for rank, cause in sorted(diagnosis.culprits.items())]
        + [Eviction(rank, topology.group_of(rank), Cause.STUCK_IN_COLLECTIVE) for rank in diagnosis.stuck]
    )
    rebuilding = set(diagnosis.broken_groups) | {eviction.group for eviction in evictions}
    survivors = tuple(sorted(set(live_groups) - rebuilding))
    return RecoveryPlan(diagnosis.cause, evictions, tuple(sorted(rebuilding)), survivors)

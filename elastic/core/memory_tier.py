"""The in-memory tier of the run's state: where copies of each rank's committed state live in
host memory, and the plan to restore from them when no live group holds a shard position.

Every ``checkpoint.memory_every`` committed steps each rank copies its committed state (its
parameter and optimizer shards, its random generators, and the data cursor with them) into
host memory, and sends a copy to its *buddy*: a rank at another shard position, on another
node where the cluster has one, else in another group. Losing a rank then loses its own
copies and the copies it kept for others, never both copies of one state, unless the rank
and its buddy fail together (the tier below, storage, covers that).

A rank sends a snapshot only once its buddy has the one before (it waits for it, which
costs step time only where a transfer outlasts ``memory_every`` steps), and keeps its own
copies of the newest two snapshot steps, as the buddy keeps the newest two it received. So
whatever dies, and whichever copies were on their way, every rank can return to the
snapshot before the newest: the survivors from their own copies, the replacements from
their buddies'. Four copies of a rank's state in host memory (``docs/presets.md`` gives
the bytes per preset). Pure: the ranks report what they hold (``Holdings``), this module
decides.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastic.core.data_plan import DataCursor
from elastic.core.topology import Topology


@dataclass(frozen=True)
class Holdings:
    """What one live rank holds in host memory."""

    own: dict[int, DataCursor]  # step -> the data cursor at it: copies of its own state
    held: dict[int, dict[int, DataCursor]]  # owner rank -> step -> cursor: copies it keeps for others
    nbytes: int = 0  # host memory the tier takes on this rank


@dataclass(frozen=True)
class MemoryRestore:
    """Every rank of the restoring groups back at ``step``, from host memory."""

    step: int
    cursor: DataCursor
    own: tuple[int, ...]  # ranks that load their own copy
    transfers: tuple[tuple[int, int], ...]  # (holder, owner): the holder's copy of the owner's state into the owner

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted((*self.own, *(owner for _, owner in self.transfers))))


def choose_buddies(topology: Topology, groups: Iterable[int], node_of: Mapping[int, str]) -> dict[int, int]:
    """Each rank's buddy among the ranks of ``groups``: the first candidate on another node
    (where ``node_of`` knows both), else the first. Candidates, in order: the next position
    of the next group (so the two copies of a position's state are never both at that
    position: losing every copy of a shard, one rank per group, keeps its buddies), then the
    next group's ranks at other positions, then the other positions of the rank's own group.
    A rank with no candidate (one position, one group) has no buddy."""
    groups = sorted(groups)
    per_group = topology.ranks_per_group
    buddies = {}
    for index, group in enumerate(groups):
        others = groups[index + 1:] + groups[:index]
        for rank in topology.global_ranks(group):
            offset = topology.group_rank(rank)
            # Walked lazily, up to the first on another node: listing every candidate for
            # every rank took time in the square of the ranks (minutes at 16 k ranks).
            candidates = itertools.chain(
                (other * per_group + (offset + shift) % per_group for other in others
                 for shift in (*range(1, per_group), 0)),
                (group * per_group + (offset + shift) % per_group for shift in range(1, per_group)))
            first = next(candidates, None)
            if first is None:
                continue
            home = node_of.get(rank)
            buddies[rank] = next((candidate for candidate in itertools.chain((first,), candidates)
                                  if node_of.get(candidate) is not None and node_of.get(candidate) != home), first)
    return buddies


def plan_memory_restore(ranks: Iterable[int], holdings: Mapping[int, Holdings],
                        at_most: int | None = None) -> MemoryRestore | None:
    """The newest step (up to ``at_most``, if given) every rank of ``ranks`` can return to
    from host memory: its own copy, or else a live rank's copy of its state. ``holdings``:
    what every live rank holds (a fresh process holds nothing). None when no step is
    covered for every rank."""
    ranks = sorted(ranks)
    if not ranks:
        return None
    cursors: dict[int, DataCursor] = {}
    for held in holdings.values():
        cursors.update(held.own)
        for copies in held.held.values():
            cursors.update(copies)
    for step in sorted((step for step in cursors if at_most is None or step <= at_most), reverse=True):
        own, transfers = [], []
        for rank in ranks:
            if step in holdings.get(rank, Holdings({}, {})).own:
                own.append(rank)
                continue
            holder = next((holder for holder, held in sorted(holdings.items()) if step in held.held.get(rank, {})),
                          None)
            if holder is None:
                break
            transfers.append((holder, rank))
        else:
            return MemoryRestore(step, cursors[step], tuple(own), tuple(transfers))
    return None

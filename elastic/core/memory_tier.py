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

import bisect
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


class BuddyPairing:
    """Each rank's buddy among the ranks of the quorum's groups, kept across changes of the
    quorum: a change re-pairs only the ranks it can affect, so its cost follows the groups
    that changed, not the job's size (a pairing from nothing took 0.75 s at 98,304 ranks,
    on the recovery's critical path).

    A rank's buddy is the first candidate on another node (where ``node_of`` knows both),
    else the first. Candidates, in order: the next position of the next group (so the two
    copies of a position's state are never both at that position: losing every copy of a
    shard, one rank per group, keeps its buddies), then the next group's ranks at other
    positions, then the other positions of the rank's own group. A rank with no candidate
    (one position, one group) has no buddy.

    A rank's choice reads only the groups its walk passed, from its own group (exclusive) to
    its buddy's (inclusive), in the cyclic order of group numbers; so a change of the quorum
    can alter only the choices of ranks whose walk passed a group that left, or the place a
    group joined (the walk then passed the next group after it), and of ranks whose walk
    reached their own group (it passed every other). A rank's node is read when its group
    joins: a group whose processes were replaced is ``renewed``, as if it left and joined."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.groups: list[int] = []
        self.buddies: dict[int, int] = {}
        self.passed: dict[int, set[int]] = {}  # group -> the ranks whose walk passed it
        self.walked_of: dict[int, tuple[int, ...]] = {}  # rank -> the groups its walk passed
        self.everywhere: set[int] = set()  # ranks whose walk passed every group

    def update(self, groups: Iterable[int], node_of: Mapping[int, str],
               renewed: Iterable[int] = ()) -> dict[int, int | None]:
        """Pair the ranks of ``groups``. Returns the buddy (None: none) of each rank to tell:
        every rank of a group that joined or was renewed (new processes), and each other rank
        whose buddy changed or is one of those new processes. A rank whose walk passed a group
        that changed but ends at the buddy it had is not told again (on one node every walk
        passes every group, and most still end where they did)."""
        groups = sorted(set(groups))
        before = set(self.groups)
        renewed = set(renewed) & before & set(groups)
        left = (before - set(groups)) | renewed
        joined = (set(groups) - before) | renewed
        affected = set(self.everywhere)
        for group in left:
            affected |= self.passed.get(group, set())
        for group in joined:
            following = self._next_group(group)
            if following is not None:
                affected |= self.passed.get(following, set())
        for group in left:
            for rank in self.topology.global_ranks(group):
                self._forget(rank)
        self.groups = groups
        fresh = {rank for group in joined for rank in self.topology.global_ranks(group)}
        affected |= fresh
        live = set(groups)
        changes = {}
        for rank in sorted(rank for rank in affected if self.topology.group_of(rank) in live):
            had = self.buddies.get(rank)
            self._forget(rank)
            buddy = self._walk(rank, node_of)
            if buddy is not None:
                self.buddies[rank] = buddy
            if rank in fresh or buddy != had or buddy in fresh:
                changes[rank] = buddy
        return changes

    def _next_group(self, group: int) -> int | None:
        """The group after ``group`` in the cyclic order of the groups paired now."""
        if not self.groups:
            return None
        index = bisect.bisect_right(self.groups, group)
        return self.groups[index % len(self.groups)]

    def _forget(self, rank: int) -> None:
        self.buddies.pop(rank, None)
        self.everywhere.discard(rank)
        for group in self.walked_of.pop(rank, ()):
            self.passed[group].discard(rank)

    def _walk(self, rank: int, node_of: Mapping[int, str]) -> int | None:
        per_group = self.topology.ranks_per_group
        group, offset = self.topology.group_of(rank), self.topology.group_rank(rank)
        index = bisect.bisect_left(self.groups, group)
        home = node_of.get(rank)
        walked: list[int] = []
        first = None
        for step in range(1, len(self.groups) + 1):
            other = self.groups[(index + step) % len(self.groups)]
            own = other == group
            if not own:
                walked.append(other)
            for shift in range(1, per_group) if own else (*range(1, per_group), 0):
                candidate = other * per_group + (offset + shift) % per_group
                first = candidate if first is None else first
                if node_of.get(candidate) is not None and node_of.get(candidate) != home:
                    if own:
                        self.everywhere.add(rank)
                    else:
                        self._record(rank, walked)
                    return candidate
        self.everywhere.add(rank)
        return first

    def _record(self, rank: int, walked: list[int]) -> None:
        self.walked_of[rank] = tuple(walked)
        for group in walked:
            self.passed.setdefault(group, set()).add(rank)


def choose_buddies(topology: Topology, groups: Iterable[int], node_of: Mapping[int, str]) -> dict[int, int]:
    """Each rank's buddy among the ranks of ``groups``, paired from nothing (``BuddyPairing``)."""
    pairing = BuddyPairing(topology)
    pairing.update(groups, node_of)
    return pairing.buddies


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

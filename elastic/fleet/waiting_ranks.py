"""The ranks whose ``run`` waits for its next segment, and the words the driver writes them.

A rank that ended a segment stays in its stream and waits on the run's store for one word
(``workers.segment_handoff``). The fleet keeps those ranks with their streams: the next segment
goes to every one of them in one write (``hand_on``), and a call a segment does not make
(a build, a save, an evaluation, a heal or a restore outside a segment) first releases the
ranks it goes to, with their groups (``release``), so that it does not queue behind their wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from elastic.core.protocol import NextSegment, ReleaseWaiting, SegmentSpec
from workers.segment_handoff import encode


class WaitingRanks:
    def __init__(self, write: Callable[[int, int, bytes], None], group_of: Callable[[int], int]):
        self.write = write  # (attempt, release, word): the rendezvous' hand_off
        self.group_of = group_of
        self.streams: dict[int, object] = {}  # rank -> the stream it waits in
        self.attempt: int | None = None  # the attempt they ended
        self.releases = 0  # words written after it so far

    def add(self, rank: int, attempt: int, stream: object) -> None:
        """``rank`` ended ``attempt`` and waits in ``stream``."""
        if attempt != self.attempt:
            self.release(None)  # ranks of an older attempt wait for nothing now
            self.attempt, self.releases = attempt, 0
        self.streams[rank] = stream

    def forget(self, rank: int) -> None:
        """The rank's process is ended: it waits no more."""
        self.streams.pop(rank, None)

    def release(self, ranks: Iterable[int] | None) -> None:
        """The waiting ranks among ``ranks`` (None: all) return, with their groups' ranks."""
        if not self.streams:
            return
        if ranks is None:
            groups = None
        else:
            groups = frozenset(self.group_of(rank) for rank in ranks if rank in self.streams)
            if not groups:
                return
        self._write(ReleaseWaiting(groups))
        for rank in [rank for rank in self.streams if groups is None or self.group_of(rank) in groups]:
            del self.streams[rank]

    def hand_on(self, specs: dict[int, SegmentSpec]) -> dict[int, object]:
        """Hand the waiting ranks among ``specs`` their segment in one write; returns their
        streams. The other waiting ranks return, the segment's groups' by the groups of ``specs``."""
        # A waiting rank of the segment's groups that the segment leaves out must not run it: its
        # group is released (its ranks in the segment get a call each).
        groups = {self.group_of(rank) for rank in specs}
        self.release([rank for rank in self.streams if rank not in specs and self.group_of(rank) in groups])
        continuing = [rank for rank in self.streams if rank in specs]
        if not continuing:
            self.release(None)
            return {}
        spec = most_common([specs[rank] for rank in continuing])
        own = {rank: specs[rank] for rank in continuing if specs[rank] is not spec and specs[rank] != spec}
        self._write(NextSegment(spec, own))
        streams = {rank: self.streams[rank] for rank in continuing}
        self.streams.clear()
        return streams

    def _write(self, word: NextSegment | ReleaseWaiting) -> None:
        self.write(self.attempt, self.releases, encode(word))
        self.releases += 1


def most_common(specs: list[SegmentSpec]) -> SegmentSpec:
    """The spec most ranks share (the same object, or equal: an injected fault's differ)."""
    distinct: list[list[SegmentSpec]] = []
    for spec in specs:
        for kind in distinct:
            if spec is kind[0] or spec == kind[0]:
                kind.append(spec)
                break
        else:
            distinct.append([spec])
    return max(distinct, key=len)[0]

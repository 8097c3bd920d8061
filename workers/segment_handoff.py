"""A rank's next segment, read from the run's store instead of handed in a call of its own.

After a rank yields its ``SegmentEnd`` its ``run`` goes on: it waits on the attempt's handoff
key (``next_segment_key``) and reads one word, written once by the driver for every rank that
waits there (``elastic.fleet.ray_fleet``):

- a ``NextSegment``: a rank of one of its spec's groups runs it, in the same stream; a rank of
  another group (its group broken, or evicted from the quorum) returns;
- a ``ReleaseWaiting``: the ranks of its groups return, for the driver's calls that a segment
  does not make (a build, a save, an evaluation, a heal or a restore outside a segment); the
  others wait on the attempt's next key.

So the next segment after a failure or a pause costs the driver one write, whatever the number
of ranks, and not one call to each. Only a group's first rank reads the word from the store; it
passes it on to the rest of its group over the group's own channel (``World.handoff_group``, a
broadcast, gloo's binomial tree: log2 of the group's size in hops), so the store serves one
read per group, not one per rank. A rank whose broadcast fails (a peer gone, or one that does
not take the word within the collective timeout) closes the channel, so that every rank of the
group reads the store from then on: none is left waiting, and none is taken for gone. A rank
that rebuilds its world closes its old channel too, freeing a peer still waiting there.
Values are sealed with the run's secret (``workers.keyed_store``): a client without it cannot
plant one, so unpickling what the driver wrote runs nothing that Ray's own calls would not; a
group's other ranks take it from their first rank, which read it sealed.
"""

from __future__ import annotations

import datetime
import logging
import pickle

import torch
import torch.distributed as dist

from elastic.core.protocol import NextSegment, ReleaseWaiting, SegmentSpec, describe_error
from workers.attempt_watch import FOREVER
from workers.world import close_connections

log = logging.getLogger(__name__)


def next_segment_key(attempt: int, release: int) -> str:
    """The key of the ``release``-th word (0 first) to the ranks waiting after ``attempt``."""
    return f"attempt{attempt}/next{release}"


def encode(word: NextSegment | ReleaseWaiting) -> bytes:
    return pickle.dumps(word, protocol=pickle.HIGHEST_PROTOCOL)


# A word passes on in one broadcast of this many bytes, its length first: every rank of a group
# then makes the same one call per word, whatever happens to any of them in it. A word that
# does not fit (a segment of thousands of groups) goes by the store, as do words no channel carries.
CAPACITY = 1 << 16
HEADER = 8
READ_THE_STORE = -1  # the length the first rank sends when it has no word to pass on


def pass_on(channel: dist.ProcessGroup, payload: bytes | None, timeout: datetime.timedelta) -> None:
    """``payload`` from this rank (the channel's rank 0) to the rest of its group, or (None, or
    too long) the word that they read it from the store. ``timeout``: the group's ranks wait in
    their receive already; one that does not must not hold this rank."""
    buffer = torch.zeros(HEADER + CAPACITY, dtype=torch.uint8)
    fits = payload is not None and len(payload) <= CAPACITY
    buffer[:HEADER].view(torch.int64)[0] = len(payload) if fits else READ_THE_STORE
    if fits:
        buffer[HEADER:HEADER + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    _broadcast(channel, buffer, timeout)


def receive(channel: dist.ProcessGroup) -> bytes | None:
    """What the group's first rank passed on; None: read the word from the store."""
    buffer = torch.empty(HEADER + CAPACITY, dtype=torch.uint8)
    _broadcast(channel, buffer, None)
    size = int(buffer[:HEADER].view(torch.int64)[0])
    return None if size == READ_THE_STORE else buffer[HEADER:HEADER + size].numpy().tobytes()


def _broadcast(channel: dist.ProcessGroup, buffer: torch.Tensor, timeout: datetime.timedelta | None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout is not None:
        options.timeout = timeout
    channel.broadcast([buffer], options).wait()


class SegmentHandoff:
    def __init__(self, store: dist.Store, pass_on_timeout: datetime.timedelta):
        self.store = store  # a wait holds its connection: one of its own
        self.pass_on_timeout = pass_on_timeout
        self.failed_channel: dist.ProcessGroup | None = None  # closed: its world's words come by the store

    def next_spec(self, attempt: int, global_rank: int, group: int,
                  channel: dist.ProcessGroup | None = None) -> SegmentSpec | None:
        """The spec this rank runs after ``attempt``, or None: it returns. ``channel``: its
        group's handoff channel, None in a group of one rank; its rank 0 reads each word from
        the store and passes it on, and the others read the store themselves when it cannot. A
        word that cannot be read (the store gone with its driver, a connection reset, a value
        without the run's tag) ends the stream of the rank that read it: the driver reads that
        as the rank gone, and replaces it."""
        release = 0
        while True:
            key = next_segment_key(attempt, release)
            payload = self._word(key, global_rank, attempt, None if channel is self.failed_channel else channel)
            if payload is None:
                log.warning("rank %d: the word after attempt %d could not be read, the rank leaves its stream",
                            global_rank, attempt)
                return None
            word = pickle.loads(payload)
            if isinstance(word, NextSegment):
                spec = word.own.get(global_rank, word.spec)
                return spec if group in spec.groups else None
            if word.groups is None or group in word.groups:
                return None
            release += 1

    def _word(self, key: str, global_rank: int, attempt: int, channel: dist.ProcessGroup | None) -> bytes | None:
        """The word under ``key``; None: it could not be read."""
        if channel is not None and channel.rank() != 0:
            try:
                payload = receive(channel)
            except Exception as error:  # noqa: BLE001 - the word is in the store all the same
                self._failed(channel, global_rank, attempt, error)
                payload = None
            return payload if payload is not None else self._read(key, global_rank, attempt)
        payload = self._read(key, global_rank, attempt)
        if channel is not None:
            try:
                pass_on(channel, payload, self.pass_on_timeout)
            except Exception as error:  # noqa: BLE001 - the others read the store then
                self._failed(channel, global_rank, attempt, error)
        return payload

    def _read(self, key: str, global_rank: int, attempt: int) -> bytes | None:
        try:
            self.store.wait([key], FOREVER)
            return self.store.get(key)
        except Exception as error:  # noqa: BLE001 - logged; the stream's end is the rank's report
            log.warning("rank %d: reading the word after attempt %d: %s", global_rank, attempt,
                        describe_error(error, 300))
            return None

    def _failed(self, channel: dist.ProcessGroup, global_rank: int, attempt: int, error: Exception) -> None:
        """Close the channel, so that every peer's wait in it raises and reads the store: no
        rank of the group stays waiting for a broadcast that one of them left."""
        close_connections([channel])
        self.failed_channel = channel
        # a peer gone, which the driver reports as itself: the consequence stays quiet
        log.info("rank %d: the handoff channel failed after attempt %d, its words come by the store: %s",
                 global_rank, attempt, describe_error(error, 300))

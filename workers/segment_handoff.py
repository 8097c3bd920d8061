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
read per group, not one per rank. A rank whose channel fails (its first rank gone, or a rank
between it and the first in the tree) reads the word from the store itself: it is not taken
for gone.
Values are sealed with the run's secret (``workers.keyed_store``): a client without it cannot
plant one, so unpickling what the driver wrote runs nothing that Ray's own calls would not; a
group's other ranks take it from their first rank, which read it sealed.
"""

from __future__ import annotations

import logging
import pickle

import torch
import torch.distributed as dist

from elastic.core.protocol import NextSegment, ReleaseWaiting, SegmentSpec, describe_error
from workers.attempt_watch import FOREVER

log = logging.getLogger(__name__)


def next_segment_key(attempt: int, release: int) -> str:
    """The key of the ``release``-th word (0 first) to the ranks waiting after ``attempt``."""
    return f"attempt{attempt}/next{release}"


def encode(word: NextSegment | ReleaseWaiting) -> bytes:
    return pickle.dumps(word, protocol=pickle.HIGHEST_PROTOCOL)


# What a group's first rank passes on when it could not read the word: its group leaves too.
LEFT = b""


def pass_on(channel: dist.ProcessGroup, payload: bytes) -> None:
    """``payload`` from this rank (the channel's rank 0) to the rest of its group."""
    _broadcast(channel, torch.tensor([len(payload)], dtype=torch.int64))
    if payload:
        _broadcast(channel, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def receive(channel: dist.ProcessGroup) -> bytes:
    """What the group's first rank passed on."""
    size = torch.zeros(1, dtype=torch.int64)
    _broadcast(channel, size)
    if not size.item():
        return LEFT
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    _broadcast(channel, data)
    return data.numpy().tobytes()


def _broadcast(channel: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    channel.broadcast([tensor], options).wait()


class SegmentHandoff:
    def __init__(self, store: dist.Store):
        self.store = store  # a wait holds its connection: one of its own

    def next_spec(self, attempt: int, global_rank: int, group: int,
                  channel: dist.ProcessGroup | None = None) -> SegmentSpec | None:
        """The spec this rank runs after ``attempt``, or None: it returns. ``channel``: its
        group's handoff channel, None in a group of one rank; its rank 0 reads each word from
        the store and passes it on. A word that cannot be read (the store gone with its driver,
        a connection reset, a value without the run's tag) ends the stream of the rank that read
        it, and of its group's other ranks with it: the driver reads that as the ranks gone,
        and replaces them."""
        release = 0
        while True:
            key = next_segment_key(attempt, release)
            payload, channel = self._word(key, global_rank, attempt, channel)
            if payload == LEFT:
                return None
            word = pickle.loads(payload)
            if isinstance(word, NextSegment):
                spec = word.own.get(global_rank, word.spec)
                return spec if group in spec.groups else None
            if word.groups is None or group in word.groups:
                return None
            release += 1

    def _word(self, key: str, global_rank: int, attempt: int,
              channel: dist.ProcessGroup | None) -> tuple[bytes, dist.ProcessGroup | None]:
        """The word under ``key`` (``LEFT``: none could be read), and the channel to take the
        next one from (None once it failed: from then on the store)."""
        if channel is not None and channel.rank() != 0:
            try:
                return receive(channel), channel
            except Exception as error:  # noqa: BLE001 - the word is in the store all the same
                # a peer gone, which the driver reports as itself: the consequence stays quiet
                log.info("rank %d: its group's first rank did not pass on the word after attempt %d, read from "
                         "the store instead: %s", global_rank, attempt, describe_error(error, 300))
                channel = None
        try:
            self.store.wait([key], FOREVER)
            payload = self.store.get(key)
        except Exception as error:  # noqa: BLE001 - logged; the stream's end is the rank's report
            log.warning("rank %d: the word after attempt %d could not be read, the rank leaves its stream: %s",
                        global_rank, attempt, describe_error(error, 300))
            payload = LEFT
        if channel is not None:
            try:
                pass_on(channel, payload)
            except Exception as error:  # noqa: BLE001 - the others read the store then
                log.info("rank %d: the word after attempt %d did not reach the rest of its group, which reads "
                         "it from the store: %s", global_rank, attempt, describe_error(error, 300))
                channel = None
        return payload, channel

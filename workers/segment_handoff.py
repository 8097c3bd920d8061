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
of ranks, and not one call to each. Values are sealed with the run's secret
(``workers.keyed_store``): a client without it cannot plant one, so unpickling what the
driver wrote runs nothing that Ray's own calls would not.
"""

from __future__ import annotations

import logging
import pickle

import torch.distributed as dist

from elastic.core.protocol import NextSegment, ReleaseWaiting, SegmentSpec, describe_error
from workers.attempt_watch import FOREVER

log = logging.getLogger(__name__)


def next_segment_key(attempt: int, release: int) -> str:
    """The key of the ``release``-th word (0 first) to the ranks waiting after ``attempt``."""
    return f"attempt{attempt}/next{release}"


def encode(word: NextSegment | ReleaseWaiting) -> bytes:
    return pickle.dumps(word, protocol=pickle.HIGHEST_PROTOCOL)


class SegmentHandoff:
    def __init__(self, store: dist.Store):
        self.store = store  # a wait holds its connection: one of its own

    def next_spec(self, attempt: int, global_rank: int, group: int) -> SegmentSpec | None:
        """The spec this rank runs after ``attempt``, or None: it returns. A word that cannot be
        read (the store gone with its driver, a connection reset, a value without the run's
        tag) ends the stream too: the driver reads that as the rank gone, and replaces it."""
        release = 0
        while True:
            key = next_segment_key(attempt, release)
            try:
                self.store.wait([key], FOREVER)
                word = pickle.loads(self.store.get(key))
            except Exception as error:  # noqa: BLE001 - logged; the stream's end is the rank's report
                log.warning("rank %d: the word after attempt %d could not be read, the rank leaves its stream: %s",
                            global_rank, attempt, describe_error(error, 300))
                return None
            if isinstance(word, NextSegment):
                spec = word.own.get(global_rank, word.spec)
                return spec if group in spec.groups else None
            if word.groups is None or group in word.groups:
                return None
            release += 1

"""The driver's abort as one key in the run's store, not a call to each rank.

The driver ends an attempt (a segment or an evaluation: ``SegmentSpec.attempt``) by setting
its key (``attempt_over_key``) once: early, at a failure, when the ranks still in it must
stop; after its end otherwise, so no rank's watch of it outlives it. Each rank waits for the
key on a thread of its own (``AttemptWatch``), on a store connection of its own (a wait
holds its connection), and turns it into the same request the control thread made before
(``DriverSignals.request_abort``): the group stops at its next micro-batch boundary, or at
the cross-group wait. A rank computing its own share is healthy: it ends its micro-batch, so
its group keeps its committed state and stays a source to heal from; one stuck inside its
group's FSDP or TP collectives cannot leave on its own, and the driver releases it
(``RankWorker.release_step``). The store's server wakes every waiter at the set, so the driver's work
does not grow with the ranks; the rank waits in ticks, so a watch whose key never comes (the
driver gone) ends with its attempt.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch.distributed as dist

from workers.control_surface import DriverSignals

# How long one wait for the key lasts before the rank looks whether its attempt is still on.
TICK_S = 5.0


def attempt_over_key(attempt: int) -> str:
    return f"attempt{attempt}/over"


class AttemptWatch:
    def __init__(self, connect: Callable[[], dist.Store], signals: DriverSignals):
        self.connect = connect
        self.signals = signals
        self.store: dist.Store | None = None  # connected at the first watch

    def watch(self, attempt: int) -> None:
        """Wait for ``attempt``'s key while the rank is in it, on a thread; abort it at the key."""
        if self.store is None:
            self.store = self.connect()
        threading.Thread(target=self._wait, args=(self.store, attempt), name=f"attempt{attempt}",
                         daemon=True).start()

    def _wait(self, store: dist.Store, attempt: int) -> None:
        key = attempt_over_key(attempt)
        while self.signals.in_attempt(attempt):
            try:
                store.wait([key], datetime.timedelta(seconds=TICK_S))
            except RuntimeError:  # the tick passed (or the store is gone: the attempt ends without it)
                continue
            self.signals.request_abort(attempt)
            return

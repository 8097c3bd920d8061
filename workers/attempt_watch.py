"""The driver's abort as one key in the run's store, not a call to each rank.

The driver ends an attempt (a segment or an evaluation: ``SegmentSpec.attempt``) by setting
its key (``attempt_over_key``) once: early, at a failure, when the ranks still in it must
stop; after its end otherwise, so no rank's watch of it outlives it. Each rank waits for the
key on a thread of its own (``AttemptWatch``), on a store connection of its own (a wait
holds its connection), and, while the rank is still in that attempt, turns it into the
request the control thread made before (``DriverSignals.request_abort``): the group stops at
its next micro-batch boundary, or at the cross-group wait. A rank computing its own share is
healthy: it ends its micro-batch, so its group keeps its committed state and stays a source
to heal from; one stuck inside its group's FSDP or TP collectives cannot leave on its own,
and the driver releases it (``RankWorker.release_step``). The store's server wakes every
waiter at the set, so the driver's work does not grow with the ranks.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable

import torch.distributed as dist

from workers.control_surface import DriverSignals

# A wait for the key has no end of its own (a timed wait that ends logs c10d's warning each
# time): the driver sets every attempt's key when it is done with it.
FOREVER = datetime.timedelta(days=365)


def attempt_over_key(attempt: int) -> str:
    return f"attempt{attempt}/over"


class AttemptWatch:
    def __init__(self, connect: Callable[[], dist.Store], signals: DriverSignals):
        self.connect = connect
        self.signals = signals
        self.store: dist.Store | None = None  # the connection the last watch waits on
        self.waiting: threading.Thread | None = None

    def watch(self, attempt: int) -> None:
        """Wait for ``attempt``'s key on a thread; abort the attempt at the key if the rank is
        still in it. A watch still waiting (its key never came: a driver gone) keeps its
        connection, and this one waits on a new one."""
        if self.waiting is not None and self.waiting.is_alive():
            self.store = None
        if self.store is None:
            self.store = self.connect()
        self.waiting = threading.Thread(target=self._wait, args=(self.store, attempt), name=f"attempt{attempt}",
                                        daemon=True)
        self.waiting.start()

    def _wait(self, store: dist.Store, attempt: int) -> None:
        try:
            store.wait([attempt_over_key(attempt)], FOREVER)
        except RuntimeError:  # the store is gone: so is the driver that would abort
            return
        self.signals.during(attempt, lambda: self.signals.request_abort(attempt))

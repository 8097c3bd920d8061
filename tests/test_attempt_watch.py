"""The driver's abort as one key in the run's store (``workers.attempt_watch``): the driver's
``Rendezvous`` sets it, a rank's watch turns it into its abort, on a real loopback store."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from functools import partial

import pytest
import torch.distributed as dist

from elastic.fleet.rendezvous import Rendezvous
from tests.test_step_transaction import rank_spec
from workers.attempt_watch import AttemptWatch, attempt_over_key
from workers.control_surface import DriverSignals
from workers.world import connect_store


@pytest.fixture
def rendezvous() -> Rendezvous:
    return Rendezvous.start("127.0.0.1")


def in_attempt(rendezvous: Rendezvous, attempt: int) -> tuple[AttemptWatch, DriverSignals]:
    """A rank's signals and watch, connecting as a rank does, the rank in ``attempt`` and
    watching for its key."""
    signals = DriverSignals()
    spec = replace(rank_spec(0, group=0, group_rank=0, shard=1, port=rendezvous.port), store_secret=rendezvous.secret)
    watch = AttemptWatch(partial(connect_store, spec), signals)
    signals.begin(attempt)
    watch.watch(attempt)
    return watch, signals


def aborted_within(signals: DriverSignals, seconds: float) -> bool:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        if signals.abort_requested():
            return True
        time.sleep(0.01)
    return False


def test_the_drivers_one_key_aborts_the_attempt_a_rank_is_in(rendezvous):
    _, signals = in_attempt(rendezvous, 3)
    assert not aborted_within(signals, 0.2)
    rendezvous.end_attempt(3)
    assert aborted_within(signals, 2.0)


def test_a_watch_whose_key_never_came_holds_up_neither_the_next_attempt_nor_its_abort(rendezvous):
    """Attempt 3 ends without its key (a driver gone before it set it): attempt 4's watch
    waits on a connection of its own, and 3's key, set late, aborts nothing after it."""
    watch, signals = in_attempt(rendezvous, 3)
    signals.end()
    signals.begin(4)
    watch.watch(4)
    rendezvous.end_attempt(3)
    assert not aborted_within(signals, 0.3)
    rendezvous.end_attempt(4)
    assert aborted_within(signals, 2.0)


def test_a_key_without_the_runs_secret_is_not_the_attempts(rendezvous):
    """A client that reaches the store but lacks the secret cannot abort the run."""
    _, signals = in_attempt(rendezvous, 3)
    dist.TCPStore("127.0.0.1", rendezvous.port, is_master=False, wait_for_workers=False).set(
        attempt_over_key(3), "")
    assert not aborted_within(signals, 0.3)


def test_a_wait_for_a_signalled_end_sleeps_until_the_end_or_the_abort():
    """``DriverSignals.wait_for``, a rank's wait on a rendezvous of the cross-group groups: no polling
    (a 1 ms poll spent 20-50 ms of CPU a second), woken by the end or by the attempt's abort,
    and not put to sleep by an abort already pending."""
    signals = DriverSignals()
    signals.begin(1)
    ended = threading.Event()
    threading.Timer(1.0, ended.set).start()
    cpu = time.thread_time()
    signals.wait_for(ended, 60)
    assert ended.is_set() and time.thread_time() - cpu < 0.01
    never = threading.Event()
    threading.Timer(0.2, signals.request_abort, args=(1,)).start()
    started = time.perf_counter()
    signals.wait_for(never, 60)
    assert signals.abort_requested() and time.perf_counter() - started < 30
    started = time.perf_counter()
    signals.wait_for(threading.Event(), 60)
    assert time.perf_counter() - started < 30

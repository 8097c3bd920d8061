"""A segment's ranks enter its cross-group groups themselves (``StepTransaction.enter_replicas``),
with no call of the driver's: two processes on a loopback store, two groups of one rank. A
rendezvous whose replica never comes ends at the driver's abort or at the step's deadline,
as a cross-group wait does (the rank is a victim, not a culprit), and leaves the rank free
to enter the next build with its replica. A rank whose step failed closes its connections
as it leaves (``World.fail_replicas``), so its replica's wait ends at once. A rebuild reuses the
store connection of the last rendezvous that ended, not one a rendezvous given up still waits on."""

from __future__ import annotations

import datetime
import threading
import time
from dataclasses import replace

import pytest
import torch.distributed as dist

from elastic.core.protocol import Failure, Phase
from elastic.testing.gloo_ranks import gloo_ranks, loopback_store
from tests.test_step_transaction import (
    RUN,
    TIMEOUT_S,
    FailingCrossGroupSum,
    new_transaction,
    rank_batches,
    rank_spec,
    segment_spec,
    take_step,
)
from workers.control_surface import NO_FAULTS
from workers.failures import classify
from workers.step_transaction import Committed
from workers.world import World

ABORT_AFTER_S = 0.3


def entering(rank: int, port: int) -> dict:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    spec = rank_spec(rank, group=rank, group_rank=0, shard=1, port=port)
    world = World(spec, store)
    world.join_group(world_build=rank)  # each group its own world of one rank
    transaction, signals = new_transaction(spec, world)
    found: dict = {}
    transaction.enter_replicas(replace(segment_spec(), replicas_build=1))
    found["replica_rank"] = world.replica_rank
    entered = world.replicate_group
    first_connection = world._replicas_store
    transaction.enter_replicas(replace(segment_spec(), replicas_build=1))  # already in it: nothing rebuilt
    found["kept_its_group"] = world.replicate_group is entered
    result = take_step(transaction, 0, rank_batches(rank, 0))
    found["first_loss"] = result.outcome.record.loss if isinstance(result.outcome, Committed) else result.raised
    if rank == 0:  # rank 1 never enters build 2 or 3: the driver aborts the one, the deadline ends the other
        timer = threading.Timer(ABORT_AFTER_S, signals.request_abort, args=(RUN,))
        timer.start()
        found["aborted"] = gave_up(transaction, replace(segment_spec(), replicas_build=2))
        timer.join()
        signals.begin(RUN + 1)
        found["timed_out"] = gave_up(transaction, replace(segment_spec(), replicas_build=3, deadline_s=ABORT_AFTER_S))
        found["left"] = (world.replicas_build, world.replicate_group)
        signals.begin(RUN)
    transaction.enter_replicas(replace(segment_spec(), replicas_build=4))
    found["reconnected"] = world._replicas_store is not first_connection
    result = take_step(transaction, 1, rank_batches(rank, 1))
    found["after_loss"] = result.outcome.record.loss if isinstance(result.outcome, Committed) else result.raised
    # rank 1's step fails before its cross-group sum, and it leaves as a failed rank does
    started = time.perf_counter()
    result = take_step(transaction, 2, rank_batches(rank, 2), faults=FailingCrossGroupSum() if rank == 1 else NO_FAULTS)
    if rank == 1:
        world.fail_replicas()
        store.wait(["replica-ended"])  # alive meanwhile: its process's end would close the connections too
    else:
        store.set("replica-ended", "")
    found["failed"] = (result.raised, time.perf_counter() - started)
    return found


def gave_up(transaction, spec) -> tuple[str, str, float]:
    """What entering ``spec``'s build raised, its kind, and how long the rank waited."""
    started = time.perf_counter()
    try:
        transaction.enter_replicas(spec)
    except Exception as error:  # noqa: BLE001 - the test reads which
        return type(error).__name__, classify(error, Phase.REPLICATE).value, time.perf_counter() - started
    return "nothing", "", time.perf_counter() - started


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    store = loopback_store(TIMEOUT_S)
    return gloo_ranks(entering, 2, str(tmp_path_factory.mktemp("replicas") / "init"), store.port)


def test_the_ranks_enter_the_segments_build_once_and_sum_across_it(ranks):
    assert [found["replica_rank"] for found in ranks] == [0, 1]
    assert all(found["kept_its_group"] for found in ranks)
    # one cross-group sum: both replicas commit the same loss
    assert isinstance(ranks[0]["first_loss"], float) and ranks[0]["first_loss"] == ranks[1]["first_loss"]


def test_a_rendezvous_whose_replica_never_comes_ends_at_the_abort_or_the_deadline_as_a_victims_wait(ranks):
    aborted, kind, _ = ranks[0]["aborted"]  # ended by the abort, long before the 60 s deadline
    assert (aborted, kind) == ("CollectiveAborted", Failure.RELEASED.value)
    timed_out, kind, waited = ranks[0]["timed_out"]
    assert (timed_out, kind) == ("CollectiveTimedOut", Failure.RELEASED.value)
    assert waited >= ABORT_AFTER_S  # its own deadline, measured from inside the wait
    assert ranks[0]["left"] == (None, None)  # in no build: the next segment's is entered whole


def test_after_a_rendezvous_given_up_both_ranks_enter_the_next_build_and_sum_again(ranks):
    assert isinstance(ranks[0]["after_loss"], float) and ranks[0]["after_loss"] == ranks[1]["after_loss"]


def test_a_failed_ranks_closed_connections_end_its_replicas_wait_at_once_not_at_the_deadline(ranks):
    """``World.fail_replicas``: the failure reaches the other group with no call of the driver's
    (its wait would otherwise last the step's deadline, 60 s here)."""
    assert ranks[1]["failed"][0] == "CollectiveFailed"
    raised, waited = ranks[0]["failed"]
    assert raised == "CollectiveFailed" and waited < TIMEOUT_S / 4


def test_a_rebuild_reuses_the_connection_its_last_rendezvous_ended_with_not_one_given_up(ranks):
    """Every rank rebuilds at once, and a new connection costs the store's server an accept and
    c10d a reverse lookup of the address it logs (5 s where the resolver drops a burst)."""
    assert ranks[1]["reconnected"] is False  # build 4 on build 1's connection
    assert ranks[0]["reconnected"] is True  # builds 2 and 3 were given up, still waiting on theirs

"""A joining group's catch-up (``workers.catch_up``, ``JoiningRank``) on real gloo process
groups and no Ray: four processes on a loopback store, a live group of two ranks (FSDP2 over
shard 2) and a joining group of the same shape. The joining ranks' states land at different
steps, so one of them holds the state while its group peer still waits for its own: the group
must idle on together (its FSDP2 collectives are the whole group's) until every joining rank
has caught up, and then hold the live group's state bit for bit. The copy goes over the replicate
group (``World.copy_pair``), beside the steps' sums on it, and creates no process group."""

from __future__ import annotations

import datetime
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from checkpointing.healing import export_local_state
from elastic.testing.gloo_ranks import gloo_ranks, loopback_store
from tests.test_step_transaction import (
    MODEL_SEED,
    TIMEOUT_S,
    new_transaction,
    rank_batches,
    rank_spec,
    take_step,
)
from workers import rng
from workers.catch_up import CatchingUp
from workers.state_transfer import receive_state, send_state
from workers.step_transaction import Committed
from workers.world import World

STEPS = 3
LANDS_AFTER = {2: 0, 3: 1}  # joining rank -> the step after whose commit its state lands
GROUPS = (0, 1)  # the replicate group's, in replica order


def catching_up(rank: int, port: int) -> dict:
    """Ranks 0 and 1 are group 0 (live, each half of every step's samples), ranks 2 and 3 group 1
    (joining: each receives the state of step 0 from the rank at its position in group 0)."""
    group, group_rank = divmod(rank, 2)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    dist.barrier()  # every rank through the first world's rendezvous before the groups' own replace it
    spec = rank_spec(rank, group=group, group_rank=group_rank, shard=2, port=port)
    world = World(spec, store)
    world.join_group(world_build=0)
    world.take_replicas(world.joining_replicas(0, group, 2).result())
    # the joining group's weights are not the live one's
    transaction, _ = new_transaction(spec, world, fsdp=True, model_seed=MODEL_SEED + group, adam=True)
    copying = ThreadPoolExecutor(max_workers=1)
    source, target = (rank, rank + 2) if group == 0 else (rank - 2, rank)
    pair = world.copy_pair("catch-up-test", source, target, GROUPS)
    if group == 0:
        state = {**export_local_state(transaction.model, transaction.optimizer), "rng": rng.capture(on_gpu=False)}
        copying.submit(lambda: send_state([pair], state))
    else:
        received = copying.submit(lambda: receive_state(pair))
        arriving = Future()
        transaction.joining.begin(CatchingUp(arriving, source=rank - 2))
    caught_up, idle = [], []
    for step in range(STEPS):
        # A joining rank is handed a share too, as a padding micro-batch would be: it must not compute it.
        batches = rank_batches(group_rank, step) if group == 0 else rank_batches(group_rank, step)[:1]
        result = take_step(transaction, step, batches)
        assert isinstance(result.outcome, Committed), result.raised
        caught_up.append(result.outcome.caught_up)
        idle.append(transaction.joining.idle)
        if group == 1 and step == LANDS_AFTER[rank]:
            arriving.set_result((received.result(TIMEOUT_S), 0, 0.0))
    copying.shutdown()
    return {"caught_up": caught_up, "idle": idle, "receipt": transaction.joining.take_receipt(),
            "copied_over": (pair.group is world.replicate_group, pair.ranks),
            "state": export_local_state(transaction.model, transaction.optimizer)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    store = loopback_store(TIMEOUT_S)
    return gloo_ranks(catching_up, 4, str(tmp_path_factory.mktemp("catch_up") / "init"), store.port)


def test_a_joining_group_idles_together_until_every_rank_caught_up_then_holds_the_live_groups_state(ranks):
    # rank 2's state lands after step 0, rank 3's after step 1: all learn in step 2's vote
    assert all(rank["caught_up"] == [False, False, True] for rank in ranks)
    assert [rank["idle"] for rank in ranks[2:]] == [[True, True, False]] * 2  # rank 2 idled on in step 2
    assert [rank["receipt"].caught_up_steps for rank in ranks[2:]] == [1, 2]
    assert all(rank["copied_over"] == (True, (0, 1)) for rank in ranks)  # no group of the copy's own
    for joined, live in ((ranks[2], ranks[0]), (ranks[3], ranks[1])):
        for got, expected in zip(joined["state"]["model"], live["state"]["model"]):
            assert torch.equal(got, expected)
        for index, moments in live["state"]["optimizer"]["state"].items():
            for key, value in moments.items():
                assert torch.equal(joined["state"]["optimizer"]["state"][index][key], value), key


def test_a_state_that_has_not_landed_in_time_is_no_state_not_the_ranks_own_error():
    """A joining rank that kept as many updates as it may waits for its state at most a step's
    deadline: past it, it holds no state and its group rebuilds, as for a copy that failed;
    nothing of it is blamed on the rank."""
    from elastic.core.protocol import Failure, Phase
    from workers.failures import HealFailed, classify

    never = CatchingUp(Future(), source=0)
    with pytest.raises(HealFailed, match="from rank 0 did not arrive: TimeoutError") as waited:
        never.state(timeout=0.01)
    assert classify(waited.value, Phase.COMPUTE) is Failure.NO_STATE

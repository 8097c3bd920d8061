"""The step as a transaction (``workers.step_transaction``), on real gloo process groups and
no Ray: two processes on a loopback store, first as two groups of one rank (the
cross-group sum), then as one group of two ranks (the vote). Each process runs the scenarios
in turn and sends what each step did over a pipe; the tests read them."""

from __future__ import annotations

import datetime
import math
import pickle
import traceback
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from checkpointing.healing import export_local_state
from elastic.core.data_plan import DataCursor, RankShare
from elastic.core.lr_schedule import LRSchedule
from elastic.core.protocol import SegmentSpec
from elastic.core.topology import Topology
from elastic.testing.gloo_ranks import loopback_store, rank_processes
from workers import rng
from workers.catch_up import CatchingUp
from workers.failures import CollectiveFailed, HealFailed
from workers.state_transfer import receive_state, send_state
from workers.gradient_sum import GradientSum, trained
from workers.step_feed import StepBatches
from workers.rank_spec import RankSpec
from workers.control_surface import NO_FAULTS, ActivityTracker, DriverSignals, NoFaults
from workers.step_transaction import Committed, Discarded, StepTransaction
from workers.train_step import Batch, TokenLoss, accumulate_gradients, collate, token_cross_entropy
from workers.world import World

TIMEOUT_S = 60.0
VOCAB, SEQ, SAMPLES_PER_RANK = 11, 6, 2
GLOBAL_TOKENS = 2 * SAMPLES_PER_RANK * SEQ
LR = 0.5
RUN = 7
MODEL_SEED, TRAINING_SEED = 0, 1


class TinyModel(nn.Module):
    """Dropout draws from the generators, so a step that is discarded has something to rewind."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 8)
        self.dropout = nn.Dropout(0.5)
        self.output = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.dropout(self.embedding(ids)))


def rank_batches(rank: int, step: int) -> list[Batch]:
    """Rank ``rank``'s samples of ``step``: one micro-batch per sample."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    dataset = [torch.randint(0, VOCAB, (SEQ + 1,), generator=generator) for _ in range(SAMPLES_PER_RANK)]
    return [collate(dataset, [index], torch.device("cpu")) for index in range(SAMPLES_PER_RANK)]


def segment_spec() -> SegmentSpec:
    return SegmentSpec(attempt=RUN, first_step=0, stop_step=10, cursor=DataCursor(), dataset_len=64,
                       global_batch=2 * SAMPLES_PER_RANK, seed=0, group_weights={0: 1.0, 1: 1.0}, micro_batch=1,
                       seq_len=SEQ, schedule=LRSchedule(LR), clip_grad_norm=None, deadline_s=TIMEOUT_S)


def share(step: int) -> RankShare:
    return RankShare(step, 0, DataCursor(position=4 * (step + 1)), ((0,), (1,)), GLOBAL_TOKENS,
                     2 * SAMPLES_PER_RANK, {0: SAMPLES_PER_RANK, 1: SAMPLES_PER_RANK})


def loaded(batches: list[Batch]) -> Future:
    future = Future()
    future.set_result(StepBatches(batches))
    return future


class FailingCrossGroupSum(NoFaults):
    """A fault plan whose rank's cross-group sum fails as a dead peer's would."""

    def before_cross_group_sum(self) -> None:
        raise CollectiveFailed("the cross-group sum failed here")


class SentBeforeWaiting(NoFaults):
    """A fault plan that injects nothing and counts the gradient buckets already sent when
    the rank starts waiting for the sum: those backward sent."""

    def __init__(self, gradient_sum: GradientSum):
        self.gradient_sum = gradient_sum
        self.sent = -1

    def before_cross_group_sum(self) -> None:
        self.sent = self.gradient_sum.sent_in_backward


@dataclass
class StepResult:
    """What one rank's step did."""

    outcome: Committed | Discarded | None
    raised: str | None  # the type of what the step raised
    parameters: list[torch.Tensor]
    parameters_unchanged: bool
    gradients_zero: bool
    generators_rewound: bool


def whole(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def take_step(transaction: StepTransaction, step: int, batches: list[Batch], records_due: bool = False,
              faults=NO_FAULTS) -> StepResult:
    parameters = [whole(param) for param in transaction.model.parameters()]
    generators = torch.get_rng_state()
    outcome, raised = None, None
    try:
        outcome = transaction.step(segment_spec(), share(step), loaded(batches), records_due, faults)
    except Exception as error:  # noqa: BLE001 - the test reads which
        raised = type(error).__name__
    after = [whole(param) for param in transaction.model.parameters()]
    return StepResult(
        outcome, raised, after,
        parameters_unchanged=all(torch.equal(a, b) for a, b in zip(parameters, after)),
        gradients_zero=all(not param.grad.any() for param in transaction.model.parameters()),
        generators_rewound=torch.equal(torch.get_rng_state(), generators),
    )


def rank_spec(rank: int, group: int, group_rank: int, shard: int, port: int) -> RankSpec:
    return RankSpec(global_rank=rank, group=group, group_rank=group_rank, shard_index=group_rank, tp_index=0,
                    layout=Topology(shard, 1), seed=0, use_gpu=False, store_host="127.0.0.1", store_port=port,
                    store_secret="00", collective_timeout_s=TIMEOUT_S)


def fsdp_units(model: TinyModel, world: World) -> TinyModel:
    """The model under FSDP2 on the group's mesh, the output layer a unit of its own."""
    fully_shard(model.output, mesh=world.mesh["shard"])
    return fully_shard(model, mesh=world.mesh["shard"])


def new_transaction(spec: RankSpec, world: World, fsdp: bool = False, model_seed: int = MODEL_SEED,
                    adam: bool = False) -> tuple[StepTransaction, DriverSignals]:
    """A rank's transaction over the tiny model of ``model_seed``'s weights, with SGD at ``LR``
    (or Adam, whose moments a copy of the state must carry); the training generators seeded."""
    torch.manual_seed(model_seed)
    model = fsdp_units(TinyModel(), world) if fsdp else TinyModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05) if adam else torch.optim.SGD(model.parameters(), lr=LR)
    signals = DriverSignals()
    transaction = StepTransaction(spec, world, model, optimizer, TokenLoss(token_cross_entropy),
                                  torch.device("cpu"), ActivityTracker(), signals)
    signals.begin(RUN)
    torch.manual_seed(TRAINING_SEED)
    return transaction, signals


def scenarios(rank: int, store: dist.Store, port: int) -> Iterator[tuple[str, StepResult]]:
    # two groups of one rank: rank ``rank`` is group ``rank``
    spec = rank_spec(rank, group=rank, group_rank=0, shard=1, port=port)
    world = World(spec, store)
    world.join_group(world_build=0)
    world.take_replicas(world.joining_replicas(0, rank, 2).result())
    transaction, signals = new_transaction(spec, world)
    yield "both apply", take_step(transaction, 0, rank_batches(rank, 0), records_due=rank == 0)
    batches = rank_batches(rank, 1)
    if rank == 1:
        batches = [batch._replace(weights=batch.weights * math.nan) for batch in batches]
    yield "a non-finite loss", take_step(transaction, 1, batches)
    if rank == 0:
        signals.request_pause(RUN)
    yield "a pause one rank saw", take_step(transaction, 1, rank_batches(rank, 1))

    # under FSDP2 (which calls the post-accumulate-grad hooks itself), one bucket per parameter
    transaction, _ = new_transaction(spec, world, fsdp=True)
    transaction.gradient_sum = GradientSum(trained(transaction.model), torch.float32, bucket_bytes=1)
    counting = SentBeforeWaiting(transaction.gradient_sum)
    result = take_step(transaction, 0, rank_batches(rank, 0), faults=counting)
    yield "buckets sent in backward", (result, counting.sent, len(transaction.gradient_sum.buckets))
    yield "a joining rank catches up", catch_up(rank, spec, world)
    yield "a joining rank takes the state before its first step", state_before_first_step(rank, spec, world)

    # one group of two ranks
    spec = rank_spec(rank, group=0, group_rank=rank, shard=2, port=port)
    world = World(spec, store)
    world.join_group(world_build=1)
    world.take_replicas(world.joining_replicas(1, 0, 1).result())
    transaction, _ = new_transaction(spec, world, fsdp=True)
    take_step(transaction, 0, rank_batches(rank, 0))
    before = export_local_state(transaction.model, transaction.optimizer)
    transaction.held_out_loss(1, rank_batches(rank, 1), GLOBAL_TOKENS)
    yield "a held-out loss", (before, export_local_state(transaction.model, transaction.optimizer))
    transaction, _ = new_transaction(spec, world)
    yield "one rank's sum fails", take_step(transaction, 0, rank_batches(rank, 0),
                                            faults=FailingCrossGroupSum() if rank == 0 else NO_FAULTS)


def state_before_first_step(rank: int, spec: RankSpec, world: World) -> dict:
    """Rank 1 joins with other weights and takes rank 0's state before its first step
    (``CatchUp.before_first_step``); then each trains its own samples with Adam. A copy that
    never lands ends its wait at the timeout, and leaves the rank without state."""
    transaction, _ = new_transaction(spec, world, model_seed=MODEL_SEED + rank, adam=True)
    if rank == 1:
        copying = ThreadPoolExecutor(max_workers=1)
        arriving = copying.submit(lambda: (receive_state(world.heal_pair("first-step-test", 0, 1)), 0, 0.0))
        transaction.joining.begin(CatchingUp(arriving, source=0))
        transaction.joining.take_state_now(TIMEOUT_S)
        copying.shutdown()
    else:
        state = {**export_local_state(transaction.model, transaction.optimizer), "rng": rng.capture(on_gpu=False)}
        send_state([world.heal_pair("first-step-test", 0, 1)], state)
    caught_up = []
    for step in range(2):
        result = take_step(transaction, step, rank_batches(rank, step))
        assert isinstance(result.outcome, Committed), result.raised
        caught_up.append(result.outcome.caught_up)
    outcome = {"caught_up": caught_up, "receipt": transaction.joining.take_receipt(),
               "state": export_local_state(transaction.model, transaction.optimizer)}
    if rank == 1:  # a copy that never lands
        lost, _ = new_transaction(spec, world)
        lost.joining.begin(CatchingUp(Future(), source=0))
        try:
            lost.joining.take_state_now(0.05)
        except HealFailed as error:
            outcome["never_landed"] = (str(error), lost.joining.holds_state)
    return outcome


def catch_up(rank: int, spec: RankSpec, world: World) -> dict:
    """Rank 1 joins with other weights and takes no samples; rank 0 trains every sample with
    Adam and sends its state of step 0 once it has committed step 1. Rank 1 sums zeros and
    keeps the committed updates meanwhile; the state lands before its step 2, where it loads
    it and applies the kept steps and that one."""
    # rank 1's weights are not rank 0's
    transaction, _ = new_transaction(spec, world, model_seed=MODEL_SEED + rank, adam=True)
    copying = ThreadPoolExecutor(max_workers=1)
    if rank == 1:
        received = copying.submit(lambda: receive_state(world.heal_pair("catch-up-test", 0, 1)))
        arriving = Future()
        transaction.joining.begin(CatchingUp(arriving, source=0))
    else:
        state = {**export_local_state(transaction.model, transaction.optimizer), "rng": rng.capture(on_gpu=False)}
    caught_up = []
    for step in range(3):
        batches = rank_batches(0, step) + rank_batches(1, step) if rank == 0 else []
        result = take_step(transaction, step, batches)
        assert isinstance(result.outcome, Committed), result.raised
        caught_up.append(result.outcome.caught_up)
        if step == 1 and rank == 0:
            copying.submit(lambda: send_state([world.heal_pair("catch-up-test", 0, 1)], state))
        if step == 1 and rank == 1:
            arrived = received.result(TIMEOUT_S)
            arriving.set_result((arrived, 0, 0.0))
    copying.shutdown()
    return {"caught_up": caught_up, "receipt": transaction.joining.take_receipt(),
            "holds_state": transaction.joining.holds_state,
            "state": export_local_state(transaction.model, transaction.optimizer)}


def rank_main(rank: int, port: int, results) -> None:
    """``results``: the sending end of a pipe, written whole before ``send_bytes`` returns.
    Plain pickle: the pipe's own would share the tensors' memory with a process about to end."""
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=TIMEOUT_S))
        for name, result in scenarios(rank, store, port):
            results.send_bytes(pickle.dumps((name, result)))
    except BaseException:  # noqa: BLE001 - the test reports it
        results.send_bytes(pickle.dumps(("failed", traceback.format_exc())))
    results.close()


@pytest.fixture(scope="module")
def results() -> dict[int, dict[str, StepResult]]:
    store = loopback_store(TIMEOUT_S)
    context = rank_processes()
    pipes = [context.Pipe(duplex=False) for _ in range(2)]
    ranks = [context.Process(target=rank_main, args=(rank, store.port, sender), daemon=True)
             for rank, (_, sender) in enumerate(pipes)]
    for process in ranks:
        process.start()
    received: dict[int, dict[str, StepResult]] = {}
    try:
        for rank, (receiver, sender) in enumerate(pipes):
            sender.close()  # the child holds its own copy: the pipe ends when the child's does
            received[rank] = {}
            while receiver.poll(TIMEOUT_S):
                try:
                    name, result = pickle.loads(receiver.recv_bytes())
                except EOFError:
                    break
                assert name != "failed", f"rank {rank} failed:\n{result}"
                received[rank][name] = result
    finally:
        for process in ranks:
            process.join(TIMEOUT_S)
            if process.is_alive():
                process.kill()
    return received


def scenario(results, name: str) -> list[StepResult]:
    assert all(name in by_name for by_name in results.values()), f"a rank did not get to {name!r}"
    return [results[rank][name] for rank in sorted(results)]


def reference_parameters() -> list[torch.Tensor]:
    """Step 0 in one process: both ranks' shares from the same generator state, summed, then SGD."""
    torch.manual_seed(MODEL_SEED)
    model = TinyModel()
    generators = torch.get_rng_state()
    try:
        for rank in range(2):
            torch.manual_seed(TRAINING_SEED)
            accumulate_gradients(model, token_cross_entropy, rank_batches(rank, 0), GLOBAL_TOKENS)
    finally:
        torch.set_rng_state(generators)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return [param.detach() for param in model.parameters()]


def test_every_rank_applies_a_step_that_succeeded_everywhere_as_one_process_would(results):
    ranks = scenario(results, "both apply")
    assert all(isinstance(rank.outcome, Committed) for rank in ranks)
    first, second = (rank.outcome for rank in ranks)
    # the same decided values in both groups; each group its own ranks and times
    assert replace(first.record, group=1, ranks=(1,), times=second.record.times) == second.record
    assert math.isfinite(first.record.loss) and first.record.lr == LR and first.record.clip_scale == 1.0
    assert (first.records_due, second.records_due) == (True, True)  # group 0's first rank asked: the sum tells group 1
    assert (first.pause, second.pause) == (False, False)
    for rank in ranks:
        assert rank.gradients_zero and not rank.parameters_unchanged
        for got, expected in zip(rank.parameters, reference_parameters()):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_the_gradient_buckets_go_out_during_backward_and_sum_as_one_flat_all_reduce_would(results):
    for result, sent_in_backward, buckets in scenario(results, "buckets sent in backward"):
        assert isinstance(result.outcome, Committed)
        assert buckets == 3 and sent_in_backward == buckets
        times = result.outcome.record.times[0]
        assert 0.0 <= times.grad_sum_exposed_s <= times.grad_sum_s
        for got, expected in zip(result.parameters, reference_parameters()):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_a_non_finite_loss_on_one_rank_is_discarded_by_every_rank(results):
    for rank in scenario(results, "a non-finite loss"):
        assert isinstance(rank.outcome, Discarded) and rank.outcome.integrity is None
        assert rank.outcome.nonfinite.step == 1 and math.isnan(rank.outcome.nonfinite.loss)
        assert rank.parameters_unchanged and rank.gradients_zero and rank.generators_rewound


def test_a_pause_one_rank_saw_stops_every_rank_after_the_same_step(results):
    ranks = scenario(results, "a pause one rank saw")
    assert all(isinstance(rank.outcome, Committed) and rank.outcome.pause for rank in ranks)
    assert [rank.outcome.record.step for rank in ranks] == [1, 1]


def test_every_rank_of_the_group_discards_when_one_ranks_cross_group_sum_fails(results):
    failed, peer = scenario(results, "one rank's sum fails")
    assert (failed.raised, peer.raised) == ("CollectiveFailed", "StepDiscarded")
    for rank in (failed, peer):
        assert rank.outcome is None
        assert rank.parameters_unchanged and rank.gradients_zero and rank.generators_rewound


def test_a_held_out_loss_leaves_the_shards_a_peer_heals_from(results):
    """FSDP2 keeps the root module's parameters gathered after a forward with no backward: the
    state a replacement heals from must be the rank's shards again, as before the evaluation."""
    for before, after in scenario(results, "a held-out loss"):
        assert [tuple(local.shape) for local in after["model"]] == [tuple(local.shape) for local in before["model"]]
        assert all(torch.equal(x, y) for x, y in zip(after["model"], before["model"]))


def test_a_joining_rank_that_takes_the_state_before_its_first_step_trains_its_share_as_its_replica(results):
    """Loaded before step 0, it took its own samples in steps 0 and 1: its weights and Adam's
    moments are the live rank's exactly, and no step counted it as catching up."""
    live, joined = scenario(results, "a joining rank takes the state before its first step")
    assert live["caught_up"] == joined["caught_up"] == [True, True]
    assert live["receipt"] is None and joined["receipt"].caught_up_steps == 0 and joined["receipt"].source == 0
    for got, expected in zip(joined["state"]["model"], live["state"]["model"]):
        assert torch.equal(got, expected)
    for index, moments in live["state"]["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(joined["state"]["optimizer"]["state"][index][key], value), key
    error, holds_state = joined["never_landed"]
    assert "did not arrive" in error and not holds_state


def test_a_joining_rank_that_caught_up_holds_its_replicas_state_bit_for_bit(results):
    """It kept steps 0 and 1 while its state was on the way, then loaded step 0's and applied
    the three as the live rank did: its weights and Adam's moments are the live rank's exactly."""
    live, joined = scenario(results, "a joining rank catches up")
    assert live["caught_up"] == joined["caught_up"] == [False, False, True]  # both learn it in step 2's vote
    assert live["receipt"] is None and joined["receipt"].caught_up_steps == 2 and joined["receipt"].source == 0
    assert joined["holds_state"]
    for got, expected in zip(joined["state"]["model"], live["state"]["model"]):
        assert torch.equal(got, expected)
    for index, moments in live["state"]["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(joined["state"]["optimizer"]["state"][index][key], value), key

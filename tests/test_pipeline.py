"""Pipeline stages inside a replica group (``workers.pipeline``): the split keeps every
parameter's name and initial value, the schedules from ``torch.distributed.pipelining`` train
the single process's losses with FSDP2 and TP (with sequence parallelism) inside the stages,
layouts the schedules cannot run are refused before any actor starts, and on a real Ray the
step stays a transaction across stages: faults in either stage and a change of ``pp`` at a
resume leave the single process's losses.

The schedules run on four gloo processes and no Ray, every layout and schedule in
turn in the same processes; each writes its losses to a file the test reads."""

from __future__ import annotations

import datetime
import json
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from elastic import ElasticTrainer
from elastic.core.data_plan import PADDING_INDEX
from elastic.setup.errors import ConfigError
from elastic.setup.hooks import check_hooks, resolve_hooks
from elastic.core.protocol import Failure
from elastic.core.topology import Topology
from elastic.testing.gloo_ranks import START_METHOD, gloo_ranks, loopback_store, rank_processes
from elastic.testing.paced import paced_model
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import FAST_DETECTION, tiny_config
from workers.model import ModelArgs, Transformer
from workers.parallelize import Parallelize
from workers.pipeline import (
    Pipeline,
    PipelineLayout,
    StagesOfRank,
    cut_stages,
    layers_of_stage,
    pipeline_micro_batches,
    split_transformer,
    stage_model,
)
from workers.failures import failure_outcome
from workers.rank_spec import RankSpec
from workers.control_surface import ActivityTracker, DriverSignals
from workers.train_step import accumulate_gradients, collate, evaluate_loss, token_cross_entropy
from workers.world import World

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
SEQ, GLOBAL_BATCH, MICRO_BATCH, STEPS = 16, 8, 2, 3
SCHEDULES = [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2)]
LAYOUTS = {"pp 2 x shard 2": (2, 2, 1), "pp 2 x tp 2, sequence parallel": (2, 1, 2)}


def whole_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


def test_stages_keep_the_whole_models_names_and_initial_values():
    whole = whole_model().state_dict()
    for layout in (PipelineLayout(pp=2), PipelineLayout(pp=2, schedule="Interleaved1F1B", stages_per_rank=2)):
        seen = {}
        for pp_index in range(layout.pp):
            stages = cut_stages(whole_model(), split_transformer, layout.stages_of(pp_index), layout.n_stages)
            rank_part = stages[0] if len(stages) == 1 else StagesOfRank(stages)
            state = rank_part.state_dict()
            assert not set(state) & set(seen), "a parameter on two ranks"
            seen |= state
        assert set(seen) == set(whole)
        assert all(torch.equal(seen[name], whole[name]) for name in whole)
    assert [list(layers_of_stage(5, stage, 2)) for stage in range(2)] == [[0, 1], [2, 3, 4]]


def test_a_ranks_stages_run_only_through_the_schedule():
    layout = PipelineLayout(pp=2, schedule="Interleaved1F1B", stages_per_rank=2)
    stages = StagesOfRank(cut_stages(whole_model(), split_transformer, layout.stages_of(0), layout.n_stages))
    # stages 0 and 2 of 4: the embedding and layers 0 and 2, not the head
    assert sorted(stages.layers) == ["0", "2"] and stages.tok_embeddings is not None and not hasattr(stages, "output")
    with pytest.raises(RuntimeError, match="pipeline schedule"):
        stages(torch.zeros(1, 4, dtype=torch.long))


def test_micro_batches_are_padded_to_one_size_and_a_multiple_of_the_stages():
    layout = PipelineLayout(pp=2, micro_batch=3)
    padded = pipeline_micro_batches(((1, 2, 3), (4,), (5, 6, 7)), layout)
    assert padded == ((1, 2, 3), (4, PADDING_INDEX, PADDING_INDEX), (5, 6, 7), (PADDING_INDEX,) * 3)
    assert pipeline_micro_batches(((1,),), PipelineLayout()) == ((1,),)  # no pipeline: as planned


def test_layouts_the_schedules_cannot_run_are_refused_before_any_actor_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"scaling.pp=2 stages need at least 2 micro-batches .* lower micro_batch to 1"):
        tiny_config(tmp_path, groups=2, global_batch=4, scaling__pp=2)
    with pytest.raises(ConfigError, match="model.tie_embeddings"):
        tiny_config(tmp_path, model__tie_embeddings=True, scaling__pp=2)
    with pytest.raises(ConfigError, match="at least 4 layers"):
        tiny_config(tmp_path, scaling__pp=2, scaling__pp_schedule="Interleaved1F1B")
    with pytest.raises(ConfigError, match="one stage per rank"):
        tiny_config(tmp_path, scaling__pp=2, scaling__pp_stages_per_rank=2)
    with pytest.raises(ConfigError, match="InterleavedZeroBubble.*wrong weight gradients with FSDP2 or TP"):
        tiny_config(tmp_path, shard=2, scaling__pp=2, scaling__pp_schedule="InterleavedZeroBubble")
    config = tiny_config(tmp_path, scaling__pp=2)

    class Custom(torch.nn.Module):
        def forward(self, ids):
            return ids

    with pytest.raises(ConfigError, match="scaling.pp = 2 needs the model split into stages: pass split_fn"):
        check_hooks(config, resolve_hooks(config, model_fn=Custom))


def shard_batches(dataset, step: int, shard_index: int, shard: int, layout: PipelineLayout) -> list:
    """The micro-batches of ``step`` at ``shard_index``, padded for ``layout``'s pipeline."""
    batch = list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
    mine = batch[shard_index * GLOBAL_BATCH // shard:(shard_index + 1) * GLOBAL_BATCH // shard]
    micro_batches = tuple(tuple(mine[i:i + MICRO_BATCH]) for i in range(0, len(mine), MICRO_BATCH))
    return [collate(dataset, mb, torch.device("cpu")) for mb in pipeline_micro_batches(micro_batches, layout)]


class Phases:
    """What a stage reports of itself (``ActivityTracker``'s chunk calls), in order."""

    def __init__(self):
        self.seen = []

    def chunk_started(self) -> None:
        self.seen.append("compute")

    def chunk_ended(self) -> None:
        self.seen.append("stage-wait")


def summed(share: float, counts: bool) -> float:
    """The group's loss: the shares of the ranks that count one, summed."""
    total = torch.tensor([share if counts else 0.0], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item()


def train_every_layout(rank: int, port: int, out: str) -> None:
    """Each layout and schedule trains ``STEPS`` steps, then takes the held-out loss of the
    first step's batch (forward only, through the schedule's ``eval``); rank 0 adds one
    process's."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=timeout)
    generator = torch.Generator().manual_seed(1)
    dataset = [torch.randint(0, ARGS.vocab_size, (SEQ + 1,), generator=generator) for _ in range(GLOBAL_BATCH * STEPS)]
    global_tokens = GLOBAL_BATCH * SEQ
    results, phases = {}, Phases()
    for name, shape in LAYOUTS.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "shard", "tp"))
        pp_index, shard_index, tp_index = mesh.get_coordinate()
        for schedule, stages_per_rank in SCHEDULES:
            layout = PipelineLayout(2, schedule, stages_per_rank, MICRO_BATCH)
            part, stages = stage_model(whole_model(), split_transformer, Parallelize(sequence_parallel=shape[2] > 1),
                                       layout, pp_index, mesh)
            pipeline = Pipeline(layout, pp_index, stages, mesh["pp"].get_group(), torch.device("cpu"),
                                token_cross_entropy, phases if not results else None)
            counts = pipeline.holds_last_stage and tp_index == 0
            optimizer = torch.optim.AdamW(part.parameters(), lr=1e-2)
            losses = []
            for step in range(STEPS):
                batches = shard_batches(dataset, step, shard_index, shape[1], layout)
                losses.append(summed(pipeline.loss_share(batches, global_tokens), counts))
                optimizer.step()
                optimizer.zero_grad()
            held_out = shard_batches(dataset, 0, shard_index, shape[1], layout)
            losses.append(summed(pipeline.held_out_loss_share(held_out, global_tokens), counts))
            results[f"{name}, {schedule}"] = losses
    if rank == 0:
        model = whole_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reference = []
        for step in range(STEPS):
            reference.append(accumulate_gradients(model, token_cross_entropy,
                                                  shard_batches(dataset, step, 0, 1, PipelineLayout()), global_tokens))
            optimizer.step()
            optimizer.zero_grad()
        reference.append(evaluate_loss(model, token_cross_entropy, shard_batches(dataset, 0, 0, 1, PipelineLayout()),
                                       global_tokens))
        with open(out, "w") as file:
            json.dump({"reference": reference, "runs": results, "phases": phases.seen}, file)
    dist.destroy_process_group()


def test_every_schedule_trains_and_evaluates_the_single_process_losses_with_fsdp2_and_tp_inside_the_stages(
        tmp_path):
    out = tmp_path / "losses.json"
    rank_processes()  # sets what the fork server the ranks come from imports before it starts
    # The test holds the store, on a port it was given: a free port picked, then bound by a rank,
    # could be taken in between by another test's process.
    store = loopback_store(120)
    mp.start_processes(train_every_layout, args=(store.port, str(out)), nprocs=4, start_method=START_METHOD)
    found = json.loads(out.read_text())
    assert sorted(found["runs"]) == sorted(f"{name}, {schedule}" for name in LAYOUTS for schedule, _ in SCHEDULES)
    # Stage 0 of the first run: waiting, not computing, until its first chunk (a hang before it
    # is not blamed on the stage that waits); every chunk of compute is followed by a wait.
    phases = found["phases"]
    assert phases[:2] == ["stage-wait", "compute"] and phases[-1] == "stage-wait"
    assert all(after == "stage-wait" for before, after in zip(phases, phases[1:]) if before == "compute")
    reference = found["reference"]  # the steps' losses, then the held-out loss
    assert len(reference) == STEPS + 1
    for run, losses in found["runs"].items():
        assert len(losses) == len(reference), run
        assert max(abs(a - b) / b for a, b in zip(losses, reference)) <= 1e-5, (run, losses, reference)


class StageThatFails(ActivityTracker):
    """A stage's activity that raises at its second chunk once ``failing``: the rank fails out
    of the step on its own and stays alive, its connections open."""

    def __init__(self):
        super().__init__()
        self.failing, self.chunks = False, 0

    def chunk_started(self) -> None:
        super().chunk_started()
        self.chunks += self.failing
        if self.chunks == 2:
            raise RuntimeError("the stage's own fault")


ATTEMPT = 3


def leave_the_step(rank: int, port: int, shape: tuple[int, int, int], leaving: int) -> tuple[int, str, bool]:
    """One group of ``shape`` (pp, shard, tp) trains a step; in the next, rank ``leaving``
    fails out of the step alive, and once it has, every other rank's control thread releases
    it as the driver does (``RankWorker.release_step``): its failed step's number, what the
    failure points at, and whether the group is broken."""
    pp, shard, tp = shape
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    spec = RankSpec(global_rank=rank, group=0, group_rank=rank, shard_index=rank // tp % shard, tp_index=rank % tp,
                    layout=Topology(shard, tp, pp=pp), seed=0, use_gpu=False, store_host="127.0.0.1",
                    store_port=port, store_secret="00", collective_timeout_s=600, micro_batch=MICRO_BATCH,
                    pp_index=rank // (shard * tp))
    layout = spec.pipeline
    dist.barrier()  # every rank through the first world's rendezvous before the group's own replaces it
    world = World(spec, store)
    mesh = world.join_group(world_build=0)
    activity = StageThatFails()
    part, stages = stage_model(whole_model(), split_transformer, Parallelize(sequence_parallel=tp > 1), layout,
                               spec.pp_index, mesh)
    pipeline = Pipeline(layout, spec.pp_index, stages, mesh["pp"].get_group(), torch.device("cpu"),
                        token_cross_entropy, activity)
    signals = DriverSignals()
    signals.begin(ATTEMPT)
    if rank != leaving:
        threading.Thread(target=lambda: (store.wait(["left"]), signals.during(ATTEMPT, world.close_connections)),
                         daemon=True).start()
    generator = torch.Generator().manual_seed(1)
    dataset = [torch.randint(0, ARGS.vocab_size, (SEQ + 1,), generator=generator) for _ in range(GLOBAL_BATCH * 2)]
    optimizer = torch.optim.AdamW(part.parameters(), lr=1e-2)
    for step in range(2):
        activity.failing = rank == leaving and step == 1
        try:
            pipeline.loss_share(shard_batches(dataset, step, spec.shard_index, shard, layout), GLOBAL_BATCH * SEQ)
        except Exception as error:  # noqa: BLE001 - what it points at is the answer
            signals.end()
            if rank == leaving:  # alive until every peer has left: its process's end would free them
                store.set("left", "")
                store.wait(["all left"])
            elif store.add("left the step", 1) == pp * shard * tp - 1:
                store.set("all left", "")
            outcome = failure_outcome(rank, step, error, activity.phase)
            return step, outcome.failure, outcome.group_broken
        optimizer.step()
        optimizer.zero_grad()
    return 2, "", False


@pytest.mark.parametrize("shape, leaving", [((2, 1, 1), 1), ((2, 2, 1), 3), ((2, 1, 2), 1), ((2, 2, 2), 3)],
                         ids=["pp 2", "pp 2 x shard 2", "pp 2 x tp 2", "pp 2 x shard 2 x tp 2"])
def test_stages_waiting_on_a_peer_that_left_the_step_are_released_as_victims(tmp_path, shape, leaving):
    """A rank fails out of a step alive (its connections stay open, unlike a dead one's), so
    its neighbours wait on it in the pipeline's sends and receives and the stages' FSDP2 and
    TP collectives, far past any settle (the collective timeout is 10 minutes). Released from
    their control threads, every one of them leaves the step, blaming a peer, its group broken:
    the driver rebuilds the group instead of replacing them."""
    store = loopback_store(120)
    answers = gloo_ranks(leave_the_step, shape[0] * shape[1] * shape[2], str(tmp_path / "init"), store.port, shape,
                         leaving)
    for rank, (step, failure, group_broken) in enumerate(answers):
        assert step == 1 and group_broken, (rank, answers)
        assert Failure(failure).blames_peers == (rank != leaving), (rank, answers)


def events_of(summary, kind):
    return [event for event in summary["events"] if event["kind"] == kind]


def test_faults_in_either_stage_commit_the_single_process_losses_and_read_nothing_from_storage(
        ray_cluster, tmp_path):
    """Two groups of two stages (1F1B) on a real Ray, neither training without the other
    (``min_groups = 2``, so every fault finds both live): a rank killed in stage 0, a hang in
    stage 1, a bit flipped in stage 1 (found by the check the step begins with: both groups go
    back to a verified state), then both copies of stage 1 killed at once (the memory tier
    restores them). Every committed loss is the single process's, and the
    checkpoints the run writes are never read."""
    steps = 16
    inject = "kill:rank=0,step=3;hang:rank=3,step=6;flip:rank=1,step=8;kill:rank=1,step=12;kill:rank=3,step=12"
    config = tiny_config(tmp_path, groups=2, min_groups=2, steps=steps, scaling__pp=2, scaling__spares=1,
                         integrity__every=4, checkpoint__memory_every=2, checkpoint__every=5,
                         fault_tolerance__inject=inject, **FAST_DETECTION)
    result = ElasticTrainer(config, model_fn=paced_model(config, 0.1), split_fn=split_transformer).fit()
    summary = result.summary
    assert result.ok, (result.exit, [e for e in summary["events"] if "checkpoint" not in e["kind"]])
    assert summary["topology"] == {"groups": 2, "pp": 2, "shard": 1, "cp": 1, "tp": 1, "ep": 1, "ranks": 4}
    failed = sorted((event["step"], event["rank"], event["cause"]) for event in events_of(summary, "rank-failed"))
    assert failed == [(3, 0, "death"), (6, 3, "hang"), (12, 1, "death"), (12, 3, "death")]
    [found] = events_of(summary, "integrity-mismatch")
    assert (found["step"], found["position"], found["suspects"]) == (8, [1, 0, 0, 0], [0, 1])
    # the double kill left no live copy of stage 1: the memory tier's newest (its snapshot
    # of step 12 may still be on its way to the buddy, then step 10's) restores it
    killed_at = max(event["t"] for event in events_of(summary, "rank-failed"))
    [restored] = [event for event in events_of(summary, "restored-from-memory") if event["t"] > killed_at]
    assert restored["step"] in (10, 12) and restored["groups"]
    assert events_of(summary, "checkpoint-committed") and not events_of(summary, "restored-from-checkpoint")
    assert [record["step"] for record in summary["steps"]] == list(range(steps))
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5


def test_a_checkpoint_resumes_across_a_change_of_pipeline_stages(ray_cluster, tmp_path):
    """Saved at pp 2 (1F1B), resumed at pp 1, saved again and resumed at pp 2 with two stages
    per rank (InterleavedZeroBubble, which runs where no stage has FSDP2 or TP): DCP reshards
    by name, and the losses go on as one uninterrupted single-process run's."""
    legs = [(6, {"scaling__pp": 2}), (10, {}),
            (14, {"scaling__pp": 2, "scaling__pp_schedule": "InterleavedZeroBubble"})]
    start = 0
    for stop, layout in legs:
        config = tiny_config(tmp_path, groups=1, steps=stop, checkpoint__every=2, model__n_layers=4, **layout)
        result = ElasticTrainer(config).fit()
        assert result.ok, result.exit
        assert result.summary["resumed_from_step"] == (start or None)
        reference, _ = reference_run(config, stop)
        assert max_relative_difference(result.losses, reference[start:]) <= 1e-5, (layout, start)
        start = stop

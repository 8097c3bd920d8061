"""The mixture-of-experts model (``workers.experts.MoE``): each token's output is what its own
experts compute for it alone, the grouped GEMM's padded CUDA form is the plain one, and on a
real Ray the experts train the single process's losses through a kill, a hang, a flipped
bit and a resume at another layout; layouts it cannot hold are refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from safetensors.torch import load_file

from elastic import ElasticTrainer
from elastic.cli import main
from elastic.setup.hooks import resolve_hooks
from elastic.setup.errors import ConfigError
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_trace
from tests.test_pretrained import (
    as_trained, exports_back_bit_for_bit, first_batch_loss_of, tiny_qwen3_moe, write_checkpoint,
)
from tests.tiny import FAST_DETECTION, tiny_config
from workers.experts import MoE, grouped_mm, looped_mm, set_row_shares
from workers.model import ModelArgs
from workers.train_step import token_cross_entropy

EXPERTS = {"model__experts": 4, "model__experts_per_token": 2, "model__shared_experts": 1,
           "model__dense_layers": 1, "model__expert_hidden": 48}
# DeepSeek-V3's two balancers, at rates a run of a few steps shows
BALANCED = {"model__expert_bias_rate": 0.01, "model__aux_loss_weight": 0.01, "model__router_scores": "sigmoid"}


def token_alone(moe: MoE, token: torch.Tensor) -> torch.Tensor:
    """What ``moe`` gives one token routed by itself, expert by expert: no grouping, no sorting."""
    logits = moe.router(token).float()
    scores = logits.softmax(-1) if moe.scores == "softmax" else logits.sigmoid()
    weights, chosen = scores.topk(moe.top_k)
    out = moe.shared(token)
    experts = moe.experts
    for weight, expert in zip(weights / weights.sum(), chosen):
        hidden = F.silu(experts.w1[expert] @ token) * (experts.w3[expert] @ token)
        out = out + weight * (experts.w2[expert] @ hidden)
    return out


@pytest.mark.parametrize("scores", ["softmax", "sigmoid"])
def test_each_token_gets_what_its_own_experts_compute_for_it_alone(scores):
    torch.manual_seed(0)
    args = ModelArgs(dim=16, ffn_hidden=24, experts=6, experts_per_token=2, shared_experts=1, router_scores=scores)
    moe = MoE(args, layer=0)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    x = torch.randn(3, 5, 16)
    expected = torch.stack([token_alone(moe, token) for token in x.reshape(-1, 16)]).view_as(x)
    torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-6)


def test_the_balance_loss_adds_deepseeks_sequence_wise_loss_to_the_gradient_and_nothing_to_the_output():
    """Each row's ``alpha * sum_i f_i P_i`` weighted by its share of the step's loss, written out
    here from DeepSeek-V3's definition: its gradient is what the layer adds; a row that does
    not count (a padding row, share 0) adds nothing."""
    torch.manual_seed(0)
    args = ModelArgs(dim=16, ffn_hidden=24, experts=4, experts_per_token=2, router_scores="sigmoid",
                     aux_loss_weight=0.1)
    moe = MoE(args, layer=0)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    x, shares = torch.randn(3, 5, 16), torch.tensor([0.2, 0.3, 0.0])
    set_row_shares([moe], shares)
    with_loss = moe(x)
    with_loss.sum().backward()
    added = moe.router.weight.grad.clone()
    moe.zero_grad()
    set_row_shares([moe], None)  # outside a step: no balance loss
    plain = moe(x)
    scores = moe.router(x.reshape(-1, 16)).float().sigmoid()
    chosen = scores.topk(2, dim=-1).indices.view(3, -1)
    probabilities = (scores / scores.sum(-1, keepdim=True)).view(3, 5, 4).mean(1)
    routed_share = torch.zeros(3, 4).scatter_add_(1, chosen, torch.ones(3, 10)) * 4 / (2 * 5)
    balance = 0.1 * ((routed_share * probabilities).sum(-1) * shares).sum()
    (plain.sum() + balance).backward()
    torch.testing.assert_close(with_loss, plain, rtol=0, atol=0)
    torch.testing.assert_close(added, moe.router.weight.grad, rtol=1e-5, atol=1e-5)


def test_groups_padded_for_the_cuda_kernel_and_a_matmul_per_group_give_the_grouped_gemm_and_its_gradients():
    torch.manual_seed(0)
    rows, weights = torch.randn(10, 8, requires_grad=True), torch.randn(4, 12, 8, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2])  # an expert no token chose among them
    upstream = torch.randn(10, 12)
    results = []
    # the grouped GEMM (CPU), padded to 16 rows a group (the CUDA kernel's form), and the
    # fallback where neither runs (fp32 on CUDA, or under torch.compile)
    for product in (lambda: grouped_mm(rows, weights, counts, 1), lambda: grouped_mm(rows, weights, counts, 16),
                    lambda: looped_mm(rows, weights, counts)):
        rows.grad = weights.grad = None
        out = product()
        (out * upstream).sum().backward()
        results.append((out.detach(), rows.grad.clone(), weights.grad.clone()))
    for other in results[1:]:
        for grouped, same in zip(results[0], other):
            torch.testing.assert_close(same, grouped, rtol=1e-6, atol=1e-6)
    starts = [0, 3, 3, 8]
    by_expert = torch.cat([rows[start:start + count] @ weights[expert].T
                           for expert, (start, count) in enumerate(zip(starts, counts.tolist()))])
    torch.testing.assert_close(results[0][0], by_expert.detach())


def expert_parallel_rank(rank: int) -> tuple[dict, dict]:
    """Rank ``rank`` of 2 with the experts split over both (expert parallelism), FSDP2 over the
    rest: its loss share on its half of a batch and its gradients, as local tensors."""
    from torch.distributed.tensor import DTensor

    from elastic.core.topology import Topology
    from workers.model import Transformer
    from workers.parallelize import Parallelize
    from workers.train_step import accumulate_gradients
    from workers.world import group_mesh

    torch.manual_seed(0)
    model = Transformer(EP_ARGS)
    Parallelize()(model, group_mesh("cpu", Topology(shard=2, tp=1, ep=2)))
    batch = ep_batch()
    half = batch._replace(inputs=batch.inputs[rank::2], targets=batch.targets[rank::2], weights=batch.weights[rank::2])
    loss = accumulate_gradients(model, token_cross_entropy, [half], batch.weights.numel())
    layer = model.layers["1"].feed_forward
    local = {name: (param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad).clone()
             for name, param in model.named_parameters() if param.grad is not None}
    return {"loss": loss, "dispatched": layer.experts.dispatch_group is not None,
            "held": layer.experts.w1.to_local().shape[0]}, local


EP_ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden=48, max_seq_len=16,
                    experts=4, experts_per_token=2, shared_experts=1, dense_layers=1)


def ep_batch():
    from workers.train_step import collate

    torch.manual_seed(1)
    samples = [torch.randint(0, 64, (17,)) for _ in range(4)]
    return collate(samples, range(4), torch.device("cpu"))


def test_under_autocast_every_grouped_gemm_gets_rows_and_weights_in_autocasts_dtype(monkeypatch):
    # A group of one bf16 rank runs its forward under autocast, which does not cover the
    # grouped GEMM: its CUDA kernel refuses bf16 rows against fp32 weights (two H200 runs: the
    # norm's fp32 rows went a matmul per expert, whose bf16 output met fp32 weights after).
    import workers.experts as model_code

    products = []

    def recording(rows, weights, counts, align):
        products.append((rows.dtype, weights.dtype))
        return grouped_mm(rows, weights, counts, align)

    monkeypatch.setattr(model_code, "grouped_mm", recording)
    torch.manual_seed(0)
    layer = MoE(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_hidden=64, max_seq_len=16,
                          experts=4, experts_per_token=2, expert_hidden=48), layer=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(2, 8, 32)).float().sum().backward()  # fp32 rows, as the norm gives them
    assert len(products) == 3 and set(products) == {(torch.bfloat16, torch.bfloat16)}, products


def test_experts_split_over_the_ranks_give_each_token_and_each_expert_what_one_process_does(tmp_path):
    """Each rank holds two of the four experts whole and sends every other token to the
    other's; the loss shares add up to one process's loss, and each rank's experts' gradients
    are that process's gradients of those experts (the rest summed by FSDP2 over the ranks)."""
    from elastic.testing.gloo_ranks import gloo_ranks
    from workers.model import Transformer
    from workers.train_step import accumulate_gradients

    results = gloo_ranks(expert_parallel_rank, 2, str(tmp_path / "init"))
    torch.manual_seed(0)
    whole = Transformer(EP_ARGS)
    batch = ep_batch()
    loss = accumulate_gradients(whole, token_cross_entropy, [batch], batch.weights.numel())
    assert sum(facts["loss"] for facts, _ in results) == pytest.approx(loss, rel=1e-6)
    for rank, (facts, grads) in enumerate(results):
        assert facts["dispatched"] and facts["held"] == 2
        expected = whole.layers["1"].feed_forward.experts.w1.grad[2 * rank:2 * rank + 2]
        torch.testing.assert_close(grads["layers.1.feed_forward.experts.w1"], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("layout", [
    # pp 2 alone: its 1F1B schedule is pp2-ep2-balanced's, its stages' whole experts interleaved's
    {"scaling__pp": 2, "shard": 2, "scaling__ep": 2, **BALANCED},
    {"scaling__pp": 2, "scaling__pp_stages_per_rank": 2, "scaling__pp_schedule": "Interleaved1F1B",
     "compute__activation_checkpointing": "full", "model__n_layers": 4, **BALANCED},
    {"shard": 2, "scaling__ep": 2, "tp": 2, **BALANCED},
    # shard 4 with ep 2, balanced, each rank's experts sharded along the experts: the last leg
    # of the faults-and-resumes test below, its losses and loads the single process's
    {"shard": 4, "scaling__ep": 2, "model__experts": 2, "model__experts_per_token": 1},
    # Every block a mixture of experts: the dense block's compile (a third of the test's time)
    # is tests/test_training.py's compiled run's.
    {"shard": 2, "scaling__ep": 2, "compute__compile": True, "model__dense_layers": 0, **BALANCED},
    {"shard": 2, "tp": 2, "scaling__sequence_parallel": False, "model__qk_norm": True, "model__head_dim": 16,
     "model__normalize_top_k": False},
], ids=["pp2-ep2-balanced", "interleaved-checkpointed-balanced", "ep2-tp2-balanced",
        "shard4-ep2-experts-sharded-by-rows", "ep2-compiled-balanced",
        "shard2-tp2-no-sp-qwen3"])
def test_experts_in_pipeline_stages_and_tensor_parallel_rows_train_the_single_process_losses(
        ray_cluster, tmp_path, layout):
    """Experts split over blocks of ep shard ranks, FSDP2 sharding each rank's over the blocks
    (along the experts, or along their rows where they do not divide); each pipeline stage's
    experts split over its shard ranks, its layers' load counted in
    their places and balanced by the bias and the balance loss (each micro-batch's rows'
    shares set for the chunk a stage computes, its forward computed again in backward
    included); TP ranks routing the same tokens to the same experts, the shared expert split
    like a dense feed-forward, with and without sequence parallelism's shares around it;
    Qwen3's query-key norms over each TP rank's own heads. The losses and each step's load
    are the single process's."""
    config = tiny_config(tmp_path, steps=6, **{**EXPERTS, **layout})
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    trace = reference_trace(config, 6)
    assert max_relative_difference(result.losses, trace.losses) <= 1e-5
    recorded = [step["expert_load"] for step in result.summary["steps"]]
    assert recorded == [{str(layer): load for layer, load in loads.items()} for loads in trace.expert_loads]


def test_layouts_and_shapes_the_experts_cannot_hold_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"scaling.tp=4 does not divide model.expert_hidden x shared_experts=6"):
        tiny_config(tmp_path, tp=4, **{**EXPERTS, "model__expert_hidden": 6})
    with pytest.raises(ConfigError, match=r"scaling.ep=2 with model.experts = 0: a dense model has no experts"):
        tiny_config(tmp_path, shard=2, scaling__ep=2)
    with pytest.raises(ConfigError, match=r"scaling.ep=4 with scaling.shard=6: .* give an ep that divides 6"):
        tiny_config(tmp_path, shard=6, scaling__ep=4, **EXPERTS)
    with pytest.raises(ConfigError, match=r"scaling.ep=3 with model.experts=4 does not split evenly over 3 ranks; "
                                          r"set model.experts to a multiple of 3, or scaling.ep to one that divides"):
        tiny_config(tmp_path, shard=3, scaling__ep=3, **EXPERTS)
    with pytest.raises(ConfigError, match=r"experts_per_token=6 is more than experts=4"):
        tiny_config(tmp_path, **{**EXPERTS, "model__experts_per_token": 6})
    with pytest.raises(ConfigError, match=r"dense_layers=2 leaves none of the 2 layers to the experts"):
        tiny_config(tmp_path, **{**EXPERTS, "model__dense_layers": 2})
    write_checkpoint(tmp_path / "llama")
    with pytest.raises(ConfigError, match=r"model: experts 4 \(the source's 0\) differ from model.init_from's model"):
        tiny_config(tmp_path, model__init_from=str(tmp_path / "llama"), **EXPERTS)


def tiny_mixtral(transformers):
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))


@pytest.mark.parametrize("family", [tiny_mixtral, tiny_qwen3_moe], ids=["mixtral", "qwen3-moe"])
def test_a_tiny_moe_saved_by_transformers_trains_from_its_loss_and_exports_back_bit_for_bit(
        ray_cluster, tmp_path, family):
    """A family's experts, one tensor each in its safetensors, read into the stacked weights at
    shard 2 with the experts split over both ranks (each rank reads its own experts, whole),
    every weight drawn as training leaves it (the norms' too): the first step's loss is
    transformers' own on that batch, and after steps that change nothing (SGD at learning
    rate 0) the export gives back every one of the source's tensors, under the same family."""
    transformers = pytest.importorskip("transformers")
    source = tmp_path / "hf-moe"
    model = as_trained(family(transformers))
    model.save_pretrained(source)
    config = tiny_config(tmp_path, shard=2, scaling__ep=2, steps=2, checkpoint__every=2, model__init_from=str(source))
    assert (config.model.experts, config.model.experts_per_token, config.model.router_scores) == (4, 2, "softmax")
    result = ElasticTrainer(config, optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.0)).fit()
    assert result.ok, result.exit
    expected = first_batch_loss_of(lambda tokens: model(tokens).logits, config)
    assert abs(result.losses[0] - expected) <= 1e-4 * expected
    exports_back_bit_for_bit(result.run_dir, source, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")  # and transformers loads it
    assert type(back) is type(model) and back.config.num_experts_per_tok == 2


def test_expert_parallel_groups_keep_the_single_process_losses_through_faults_and_resumes_at_another_ep(
        ray_cluster, tmp_path):
    """Two groups of shard 2 with the experts split over each group's two ranks (ep 2), neither
    training without the other, the experts balanced by DeepSeek-V3's bias and its balance loss
    (each sequence's in the gradient, weighted by its share of the loss): a rank killed, a bit
    flipped (found by the integrity check, which reads the bias as it reads every parameter), a
    rank hung (its peer waits in the all-to-all: the hung one is the culprit), then both copies
    of one rank's experts killed at once (the memory tier restores them; no checkpoint is read).
    The bias moves only when a step commits, by the tokens every rank of every group routed.
    Saved at ep 2, resumed at ep 1 (FSDP2 shards the experts), saved again and resumed at shard
    4 with ep 2 (FSDP2 shards each rank's experts over the two blocks of ep ranks), a rank
    killed there: DCP reshards the experts by name. Every committed loss and each step's load,
    and every weight and bias exported after it, is the single process's.

    (One run for what were two: the same faults on two groups of shard 2 at ep 1, resumed as
    one rank, proved nothing this one does not: ep 1 at shard 2 is its second leg.)"""
    balanced = {**EXPERTS, **BALANCED}
    # The hang replaces rank 2, rank 1's buddy, and its copies go with it. A rank sends a
    # snapshot once its buddy has the one before: by step 10, the snapshot of step 8 has gone
    # out, so the buddy surely holds step 6's. (At step 6, only step 4's had been sent, and it
    # may still have been on its way: then storage is the tier below.)
    inject = "kill:rank=1,step=1;flip:rank=3,step=2;hang:rank=2,step=4;kill:rank=1,step=10;kill:rank=3,step=10"
    legs = [(12, {"groups": 2, "min_groups": 2, "scaling__ep": 2, "fault_tolerance__inject": inject,
                  "integrity__every": 3, "checkpoint__every": 12, "checkpoint__memory_every": 2, **FAST_DETECTION}),
            (14, {}),
            (18, {"shard": 4, "scaling__ep": 2, "fault_tolerance__inject": "kill:rank=2,step=16"})]
    losses, records = [], []
    for stop, layout in legs:
        config = tiny_config(tmp_path, steps=stop, **{"shard": 2, "checkpoint__every": 2, **balanced, **layout})
        result = ElasticTrainer(config).fit()
        assert result.ok, (result.exit, [e for e in result.summary["events"] if "checkpoint" not in e["kind"]])
        losses += result.losses
        records += result.summary["steps"]
        if layout.get("groups"):
            events = result.summary["events"]
            failed = sorted((e["step"], e["rank"], e["cause"]) for e in events if e["kind"] == "rank-failed")
            assert failed == [(1, 1, "death"), (4, 2, "hang"), (10, 1, "death"), (10, 3, "death")]
            assert [e["step"] for e in events if e["kind"] == "integrity-mismatch"] == [3]
            kinds = {e["kind"] for e in events}
            assert "restored-from-memory" in kinds and "restored-from-checkpoint" not in kinds
        if layout.get("shard") == 4:
            assert [(e["step"], e["rank"]) for e in result.summary["events"] if e["kind"] == "rank-failed"] == [(16, 2)]
    trace = reference_trace(config, 18)
    assert max_relative_difference(losses, trace.losses) <= 1e-5
    # each step's load, from the tokens every rank of every group routed: the one process's
    recorded = [step["expert_load"] for step in records]
    assert recorded == [{str(layer): load for layer, load in loads.items()} for loads in trace.expert_loads]
    assert all(load >= 1.0 for loads in recorded for load in loads.values())
    # Out whole from the ep 2 checkpoint, in the model's own names: the single process's
    # weights; HuggingFace's names are a dense Llama's, refused in one line.
    assert main(["export", result.run_dir, "--output", str(tmp_path / "native")]) == 0
    exported = load_file(tmp_path / "native" / "model.safetensors")
    names = [name for name, _ in resolve_hooks(config).model_fn().named_parameters()]
    assert exported["layers.1.feed_forward.experts.w1"].shape == (4, 48, 32)
    assert exported["layers.1.feed_forward.expert_bias"].abs().sum() > 0  # it moved, step by step
    for name, parameter in zip(names, trace.params, strict=True):
        torch.testing.assert_close(exported[name], parameter, rtol=1e-4, atol=1e-5, msg=name)
    assert main(["export", result.run_dir, "--output", str(tmp_path / "hf"), "--format", "huggingface"]) == 2

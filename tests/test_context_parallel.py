"""Context parallelism (``scaling.cp``): each sequence split over the cp ranks in load-balanced
chunks, attention over the keys and values gathered from all of them. Two gloo ranks give
one process's loss and gradients, causal and with packed documents; on a real Ray the
layouts with FSDP2, TP with sequence parallelism and pipeline stages train the single
process's losses, and so do two groups of cp 2 through a kill, a hang, a flipped bit and both
copies of one position killed, resumed at cp 1 and back at cp 2. What it cannot hold is
refused in one line."""

from __future__ import annotations

import pytest
import torch

from elastic import ElasticTrainer
from elastic.setup.errors import ConfigError
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run, reference_trace
from tests.tiny import FAST_DETECTION, tiny_config
from workers.context_parallel import ContextShare
from workers.model import ModelArgs, Transformer
from workers.train_step import Batch, accumulate_gradients, token_cross_entropy

ARGS = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)


def test_each_rank_holds_an_early_and_a_late_chunk_and_the_gather_puts_them_back_in_order():
    whole = torch.arange(16)[None]
    shares = [ContextShare(2, rank, 16) for rank in range(2)]
    assert [share.split(whole).tolist()[0] for share in shares] == [[0, 1, 2, 3, 12, 13, 14, 15],
                                                                  [4, 5, 6, 7, 8, 9, 10, 11]]
    assert [share.indices().tolist() for share in shares] == [share.split(whole).tolist()[0] for share in shares]
    by_rank = torch.cat([share.split(whole) for share in shares], dim=1)
    assert torch.equal(shares[0]._in_sequence_order(by_rank, 1), whole)
    with pytest.raises(ValueError, match="splits sequences of data.seq_len=16 tokens; a batch holds 12"):
        shares[0].split(torch.zeros(1, 12))


def packed_positions() -> torch.Tensor:
    """Two rows of documents packed end to end, one begun before its row."""
    starts = [[0, 5, 9], [0, 3, 11]]
    rows = []
    for row, begins in enumerate(starts):
        positions = torch.arange(16)
        for begin in begins:
            positions[begin:] = torch.arange(16 - begin)
        rows.append(positions + (2 if row == 1 else 0) * (torch.arange(16) < 3))
    return torch.stack(rows)


def one_batch(positions: torch.Tensor | None) -> Batch:
    torch.manual_seed(3)
    ids = torch.randint(0, ARGS.vocab_size, (2, 17))
    weights = torch.ones(2, 16)
    weights[1, :4] = 0  # ignored labels: each rank counts the targets it holds
    return Batch(ids[:, :-1], ids[:, 1:], weights, int(weights.sum()), positions)


def context_rank(rank: int, masked: bool):
    import torch.distributed as dist

    from workers.parallelize import split_sequences

    torch.manual_seed(0)
    model = Transformer(ARGS)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    split_sequences(model, mesh)
    batch = one_batch(packed_positions() if masked else None)
    own = batch.context_share(ContextShare(2, rank, 16))
    share = accumulate_gradients(model, token_cross_entropy, [own], batch.counted_tokens)
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    for grad in grads.values():  # FSDP2 would sum them over shard x cp
        dist.all_reduce(grad)
    return share, own.counted_tokens, grads


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "packed-documents"])
def test_two_ranks_of_chunks_give_one_process_loss_and_gradients(tmp_path, masked):
    """Each rank's queries against every rank's keys, rotated by their place in the sequence
    (or in their document), the keys' gradients sent back to their owners: the loss shares
    add up to one process's loss, each token counted once, and the summed gradients are its
    gradients."""
    from elastic.testing.gloo_ranks import gloo_ranks

    results = gloo_ranks(context_rank, 2, str(tmp_path / "init"), masked)
    torch.manual_seed(0)
    whole = Transformer(ARGS)
    batch = one_batch(packed_positions() if masked else None)
    loss = accumulate_gradients(whole, token_cross_entropy, [batch], batch.counted_tokens)
    assert sum(share for share, _, _ in results) == pytest.approx(loss, rel=1e-6)
    assert sum(counted for _, counted, _ in results) == batch.counted_tokens
    for name, param in whole.named_parameters():
        torch.testing.assert_close(results[0][2][name], param.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_layouts_context_parallelism_cannot_hold_are_refused_in_one_line(tmp_path):
    def model_fn():
        return torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))

    with pytest.raises(ConfigError, match=r"^scaling.cp = 2 needs the reference model, .*Sequential has none"):
        ElasticTrainer(tiny_config(tmp_path, scaling__cp=2), model_fn=model_fn)
    with pytest.raises(ConfigError, match=r"scaling.cp=3 with data.seq_len=32: .* divisible by 2 x cp = 6"):
        tiny_config(tmp_path, scaling__cp=3)
    with pytest.raises(ConfigError, match=r"scaling.cp=2 with model.dropout=0.1: .* set model.dropout = 0"):
        tiny_config(tmp_path, scaling__cp=2, model__dropout=0.1)
    with pytest.raises(ConfigError, match=r"scaling.cp=2 with model.experts=4: .* set scaling.cp = 1"):
        tiny_config(tmp_path, scaling__cp=2, model__experts=4)
    with pytest.raises(ConfigError, match=r"needs a cp rank's share of data.seq_len=32 \(8\) divisible by "
                                          r"scaling.tp=16.*multiple of 64"):
        tiny_config(tmp_path, scaling__cp=4, tp=16, scaling__sequence_parallel=True, model__dim=64,
                    model__n_heads=16, model__n_kv_heads=16, model__ffn_hidden=64, model__vocab_size=256)


@pytest.mark.parametrize("layout", [
    # cp 2 alone, two groups of it, and FSDP2 over shard 2 x cp 2: the faults-and-resumes test below
    {"scaling__cp": 2, "tp": 2, "scaling__sequence_parallel": True},
    {"scaling__cp": 2, "scaling__pp": 2},
], ids=["cp2-tp2-sp", "pp2-cp2"])
def test_context_parallel_layouts_train_the_single_process_losses(ray_cluster, tmp_path, layout):
    """FSDP2 sharding over shard x cp, TP ranks splitting each rank's chunks (and sequence
    parallelism splitting them again between TP regions), pipeline stages passing each
    rank's chunks on: the losses are the single process's."""
    config = tiny_config(tmp_path, steps=4, **layout)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert max_relative_difference(result.losses, reference_trace(config, 4).losses) <= 1e-5


def test_two_groups_of_cp_2_keep_the_single_process_losses_through_faults_and_resumes_at_another_cp(
        ray_cluster, tmp_path):
    """Two groups of cp 2: a rank killed, a bit flipped (found by the integrity check), a rank
    hung (its peer waits in the gather of keys and values: the hung one is the culprit), then
    both copies of one position killed at once (the memory tier restores them; no checkpoint
    is read). Saved at cp 2 and resumed at cp 1, saved there and resumed at cp 2 with shard 2
    (FSDP2 shards over the four ranks), a rank killed there: every committed loss is the
    single process's."""
    # As in test_experts: by step 10 the buddy of rank 1 surely holds a snapshot of its state.
    inject = "kill:rank=1,step=1;flip:rank=3,step=2;hang:rank=2,step=4;kill:rank=1,step=10;kill:rank=3,step=10"
    legs = [(12, {"groups": 2, "min_groups": 2, "scaling__cp": 2, "fault_tolerance__inject": inject,
                  "integrity__every": 3, "checkpoint__every": 12, "checkpoint__memory_every": 2, **FAST_DETECTION}),
            (14, {}),
            (17, {"shard": 2, "scaling__cp": 2, "fault_tolerance__inject": "kill:rank=3,step=15"})]
    losses = []
    for stop, layout in legs:
        config = tiny_config(tmp_path, steps=stop, **{"checkpoint__every": 2, **layout})
        result = ElasticTrainer(config).fit()
        assert result.ok, (result.exit, [e for e in result.summary["events"] if "checkpoint" not in e["kind"]])
        losses += result.losses
        failed = sorted((e["step"], e["rank"], e["cause"]) for e in result.summary["events"] if e["kind"] == "rank-failed")
        if layout.get("groups"):
            events = result.summary["events"]
            assert failed == [(1, 1, "death"), (4, 2, "hang"), (10, 1, "death"), (10, 3, "death")]
            assert [e["step"] for e in events if e["kind"] == "integrity-mismatch"] == [3]
            kinds = {e["kind"] for e in events}
            assert "restored-from-memory" in kinds and "restored-from-checkpoint" not in kinds
        elif layout:
            assert failed == [(15, 3, "death")]
    reference, _ = reference_run(config, 17)
    assert max_relative_difference(losses, reference) <= 1e-5


def saved_by_context_rank(rank: int, cp: int) -> int:
    from elastic.testing.memory import SavedBytes, held_storages
    from workers.parallelize import split_sequences

    torch.manual_seed(0)
    model = Transformer(ARGS)
    if cp > 1:
        split_sequences(model, torch.distributed.device_mesh.init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)))
    own = one_batch(None).context_share(ContextShare(cp, rank, 16)) if cp > 1 else one_batch(None)
    with SavedBytes(held_storages(model), floating_only=True) as saved:
        model(own.inputs)
    return saved.total


def test_the_activation_estimate_counts_what_a_cp_rank_saves(tmp_path):
    """A cp rank saves its own tokens' activations, every block's whole-sequence keys and
    values and its attention's output twice (by chunk and whole): what autograd saves on each
    of two ranks is the memory estimate's count, and what only the CPU saves. On CPU torch
    materialises the lower-right causal bias of a chunk whose keys outnumber its queries (the
    fused CUDA kernels take it as it is), and a rank's own positions' rotation angles are a
    table of their own, a few bytes per token that the estimate leaves out."""
    from elastic.setup.config import ModelConfig
    from elastic.setup.memory_estimate import activation_bytes
    from elastic.testing.gloo_ranks import gloo_ranks

    saved = gloo_ranks(saved_by_context_rank, 2, str(tmp_path / "init"), 2)
    model = ModelConfig(vocab_size=ARGS.vocab_size, dim=ARGS.dim, n_layers=ARGS.n_layers, n_heads=ARGS.n_heads,
                        n_kv_heads=ARGS.n_kv_heads, ffn_hidden=ARGS.ffn_hidden)
    estimate = activation_bytes(model, tp=1, tokens=2 * 8, compute=4, activation_checkpointing=False,
                                gathered_tokens=2 * 8)
    angles = 8 * ARGS.head_dim * 4
    for rank, rank_saved in enumerate(saved):
        chunk_ends = [(chunk + 1) * 4 for chunk in ContextShare(2, rank, 16).chunks]
        biases = ARGS.n_layers * sum(4 * end * 4 for end in chunk_ends if end > 4)
        assert rank_saved == estimate + angles + biases

"""The reference model's parallel plans against one process, on real gloo groups and no Ray.

Two processes form one replica group of ``shard 1 x tp 2`` and train the reference
model's forward and backward with and without sequence parallelism; their losses and every
gradient must equal a single process's, and sequence parallelism must save fewer bytes for
backward. Activation checkpointing runs in this process: each policy must give the same
loss and gradients as none, and recompute more than none and less than full.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from elastic.setup.config import ModelConfig
from elastic.setup.memory_estimate import activation_bytes
from workers.model import ModelArgs, Transformer
from elastic.testing.gloo_ranks import gloo_ranks
from elastic.testing.memory import SavedBytes, held_storages
from workers.parallelize import Parallelize, tensor_parallelize_transformer, wrap_blocks

ARGS = ModelArgs(vocab_size=16, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=8)
TP = 2


def batch() -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len + 1), generator=torch.Generator().manual_seed(5))


class MatmulsRun(TorchDispatchMode):
    """Counts the matmuls that run while inside: in backward, the gradients' and those recomputed."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, op, types, args=(), kwargs=None):
        self.count += op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
        return op(*args, **(kwargs or {}))


def train_once(parallelize, backward_matmuls: MatmulsRun | None = None) -> tuple[float, dict[str, torch.Tensor], int]:
    """One forward and backward of the seeded model: loss, full gradients by name, saved bytes."""
    torch.manual_seed(0)
    model = parallelize(Transformer(ARGS))
    tokens = batch()
    with SavedBytes() as saved:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, ARGS.vocab_size), tokens[:, 1:].reshape(-1))
    if backward_matmuls is None:
        loss.backward()
    else:
        with backward_matmuls:
            loss.backward()
    # A gradient left partial would be summed by full_tensor() here but stepped on as it is.
    assert not [name for name, p in model.named_parameters()
                if isinstance(p.grad, DTensor) and any(placement.is_partial() for placement in p.grad.placements)]
    # Names as a checkpoint records them: without the checkpoint wrappers' prefix.
    grads = {name.replace("_checkpoint_wrapped_module.", ""): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for name, p in model.named_parameters()}
    return loss.item(), grads, saved.total


def tensor_parallel_activation_bytes(tp_mesh, sequence_parallel: bool) -> int:
    """What the forward of the model under TP alone (no FSDP2, whose gathered weights would
    count) saves for backward, the parameters aside: the memory estimate's activations."""
    torch.manual_seed(0)
    model = Transformer(ARGS)
    tensor_parallelize_transformer(model, tp_mesh, sequence_parallel)
    with SavedBytes(held_storages(model)) as saved:
        model(batch()[:, :-1])
    return saved.total


def tp_rank(rank: int) -> dict:
    mesh = init_device_mesh("cpu", (1, TP), mesh_dim_names=("shard", "tp"))
    results = {}
    for sequence_parallel in (False, True):
        results[sequence_parallel] = train_once(
            lambda model: Parallelize(sequence_parallel=sequence_parallel)(model, mesh))
        results["activations", sequence_parallel] = tensor_parallel_activation_bytes(mesh["tp"], sequence_parallel)
    return results


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return gloo_ranks(tp_rank, TP, str(tmp_path_factory.mktemp("tp") / "init"))


def assert_same_training(result, reference) -> None:
    loss, grads, _ = result
    reference_loss, reference_grads, _ = reference
    assert abs(loss - reference_loss) <= 1e-5 * abs(reference_loss)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sequence-parallel"])
def test_tensor_parallel_ranks_train_as_one_process(tp_results, sequence_parallel):
    reference = train_once(lambda model: model)
    for rank_results in tp_results:
        assert_same_training(rank_results[sequence_parallel], reference)


def test_sequence_parallelism_saves_less_for_backward_by_the_memory_estimates_difference(tp_results):
    model = ModelConfig(vocab_size=ARGS.vocab_size, dim=ARGS.dim, n_layers=ARGS.n_layers, n_heads=ARGS.n_heads,
                        n_kv_heads=ARGS.n_kv_heads, ffn_hidden=ARGS.ffn_hidden)
    tokens = batch()[:, :-1].numel()
    estimate = {sequence_parallel: activation_bytes(model, tp=TP, tokens=tokens, compute=4,
                                                    activation_checkpointing=False,
                                                    sequence_parallel=sequence_parallel)
                for sequence_parallel in (False, True)}
    # Counted under TP alone: under FSDP2 as well, the gathered weights are freed after each
    # block's forward and their addresses reused, so a count by storage varied run to run
    # (125-150 kB here, sequence parallelism once within 0.2 % of plain).
    for rank_results in tp_results:
        plain, sequence_parallel = rank_results["activations", False], rank_results["activations", True]
        assert sequence_parallel < plain, (sequence_parallel, plain)
        # The estimate leaves out the logits and the loss's tensors, the same in both.
        assert plain - sequence_parallel == estimate[False] - estimate[True]


def checkpointing(mode: str, selective="op"):
    def apply(model: Transformer) -> Transformer:
        wrap_blocks(model, mode, compile_blocks=False, selective=selective)
        return model
    return apply


def test_every_activation_checkpointing_policy_trains_the_same_model_recomputing_less_than_full():
    matmuls = {mode: MatmulsRun() for mode in ("none", "full", "op", 2)}
    none = train_once(checkpointing("none"), matmuls["none"])
    full = train_once(checkpointing("full"), matmuls["full"])
    assert_same_training(full, none)
    assert full[2] < none[2]
    for selective in ("op", 2):
        result = train_once(checkpointing("selective", selective), matmuls[selective])
        assert_same_training(result, none)
        assert matmuls["none"].count < matmuls[selective].count < matmuls["full"].count, \
            {mode: run.count for mode, run in matmuls.items()}
    # Every other block keeps its activations; the per-op policy's saved outputs are held by
    # the checkpoint itself, out of the saved-tensor hooks' sight.
    every_other = train_once(checkpointing("selective", 2))
    assert full[2] < every_other[2] < none[2]


def test_a_group_of_one_rank_trains_in_bf16_under_autocast_as_a_plain_script_without_fsdp():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "tp"))
        loss, grads, _ = train_once(lambda model: Parallelize(precision="bf16")(model, mesh))
    finally:
        dist.destroy_process_group()
    assert not torch.is_autocast_enabled("cpu")  # the forward's context closed behind it
    torch.manual_seed(0)
    model = Transformer(ARGS)
    tokens = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    assert logits.dtype == torch.bfloat16
    reference = F.cross_entropy(logits.reshape(-1, ARGS.vocab_size), tokens[:, 1:].reshape(-1))
    reference.backward()
    assert loss == reference.item()
    for name, parameter in model.named_parameters():
        assert grads[name].dtype == torch.float32 and torch.equal(grads[name], parameter.grad), name

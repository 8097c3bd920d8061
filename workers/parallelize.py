"""Applies tensor parallelism, then FSDP2, to a model on a replica group's 2-D mesh.

The mesh has dimensions ``("shard", "tp")``. Tensor parallelism follows Megatron: q/k/v
and the SwiGLU gate/up projections are split column-wise, the attention output and down
projections row-wise, so each block needs one all-reduce forward and one backward. The
embedding is split by vocabulary rows and the output projection by vocabulary columns
with replicated logits, so every TP rank computes the same loss. FSDP2 then shards each
block and the root over the ``shard`` dimension.

Gradients are summed, never averaged: the loss is already divided by the global token
count (see ``workers.train_step``), which also keeps clear of gloo's AVG reduction.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from workers.model import Transformer


def tensor_parallelize_transformer(model: Transformer, tp_mesh: DeviceMesh) -> None:
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for block in model.layers:
        parallelize_module(block, tp_mesh, block_plan)
    if model.args.tie_embeddings:
        # Both layouts shard the vocabulary dimension, so the tie survives as one DTensor.
        model.output.weight = model.tok_embeddings.weight


def fully_shard_model(model: nn.Module, shard_mesh: DeviceMesh, blocks: list[nn.Module]) -> None:
    """FSDP2 per block, then at the root, with gradients summed across the shard dimension."""
    for block in blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    for module in [*blocks, model]:
        module.set_gradient_divide_factor(1.0)
        # Plain SUM collectives: gloo has no PREMUL_SUM, and AVG is where gloo goes wrong.
        module.set_force_sum_reduction_for_comms(True)


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """The default ``parallelize_fn``: TP (reference model only) then FSDP2."""
    if mesh["tp"].size() > 1:
        if not isinstance(model, Transformer):
            raise ValueError(
                "scaling.tp > 1 needs a tensor-parallel plan: pass parallelize_fn for a custom model"
            )
        tensor_parallelize_transformer(model, mesh["tp"])
    blocks = list(model.layers) if isinstance(model, Transformer) else []
    fully_shard_model(model, mesh["shard"], blocks)
    return model

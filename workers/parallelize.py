"""Applies tensor parallelism, activation checkpointing, compile and FSDP2, in that order
(TorchTitan's), to a model on a replica group's 2-D mesh.

The mesh has dimensions ``("shard", "tp")``. Tensor parallelism follows Megatron: q/k/v
and the SwiGLU gate/up projections are split column-wise, the attention output and down
projections row-wise, so each block needs one all-reduce forward and one backward. The
embedding is split by vocabulary rows and the output projection by vocabulary columns
with replicated logits, so every TP rank computes the same loss. FSDP2 then shards each
block and the root over the ``shard`` dimension.

Mixed precision goes through FSDP2's ``MixedPrecisionPolicy``: parameters are all-gathered
and computed in bf16 while the sharded master copy, the optimizer state and the gradient
reduction stay fp32. Gradients are summed, never averaged: the loss is already divided by
the global token count (see ``workers.train_step``), which also keeps clear of gloo's AVG
reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from workers.model import Transformer

Precision = Literal["auto", "fp32", "bf16"]


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


def compute_dtype(precision: Precision, mesh: DeviceMesh) -> torch.dtype:
    """``auto`` is bf16 on CUDA and fp32 on CPU, where the parity tests stay exact."""
    if precision == "auto":
        return torch.bfloat16 if mesh.device_type == "cuda" else torch.float32
    return torch.bfloat16 if precision == "bf16" else torch.float32


def mixed_precision_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def fully_shard_model(
    model: nn.Module, shard_mesh: DeviceMesh, blocks: list[nn.Module],
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
) -> None:
    """FSDP2 per block, then at the root, with gradients summed across the shard dimension."""
    for block in blocks:
        fully_shard(block, mesh=shard_mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=shard_mesh, mp_policy=mp_policy)
    for module in [*blocks, model]:
        module.set_gradient_divide_factor(1.0)
        # Plain SUM collectives: gloo has no PREMUL_SUM, and AVG is where gloo goes wrong.
        module.set_force_sum_reduction_for_comms(True)


def wrap_blocks(model: Transformer, activation_checkpointing: bool, compile_blocks: bool) -> list[nn.Module]:
    """Activation checkpointing, then ``torch.compile``, per transformer block.

    One compiled block serves every layer (same code, same shapes), so compile time does not
    grow with depth. FSDP2's hooks stay outside the compiled region. Checkpoint FQNs are
    unchanged: DCP's state dict drops the wrappers' prefixes.
    """
    for name, block in list(model.layers.named_children()):
        if activation_checkpointing:
            block = checkpoint_wrapper(block)
        if compile_blocks:
            block = torch.compile(block, fullgraph=True)
        model.layers.register_module(name, block)
    return list(model.layers)


@dataclass(frozen=True)
class Parallelize:
    """The default ``parallelize_fn``: TP (the reference model's plan, or a custom model's
    ``tp_plan(model, tp_mesh)``), per-block activation checkpointing and compile (reference
    model), then FSDP2 with the configured precision (none for a group of one fp32 rank)."""

    precision: Precision = "auto"
    activation_checkpointing: bool = False
    compile: bool = False
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None

    def __call__(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if mesh["tp"].size() > 1:
            if self.tp_plan is not None:
                self.tp_plan(model, mesh["tp"])
            elif isinstance(model, Transformer):
                tensor_parallelize_transformer(model, mesh["tp"])
            else:
                raise ValueError("scaling.tp > 1 needs a tensor-parallel plan for a custom model: pass tp_plan "
                                 "(FSDP2 and the precision stay the config's) or parallelize_fn")
        blocks = []
        if isinstance(model, Transformer):
            blocks = wrap_blocks(model, self.activation_checkpointing, self.compile)
        dtype = compute_dtype(self.precision, mesh)
        if mesh.size() == 1 and dtype == torch.float32:
            # A group of one rank with nothing to cast: FSDP2 would shard over one rank and
            # only add its per-op DTensor dispatch (a quarter of a small model's CPU step).
            return model
        fully_shard_model(model, mesh["shard"], blocks, mixed_precision_policy(dtype))
        return model


parallelize = Parallelize()

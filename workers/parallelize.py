"""Applies float8 training, tensor parallelism, activation checkpointing, compile and FSDP2, in
that order (TorchTitan's), to a model (or a pipeline stage of one: ``workers.pipeline``) on a replica
group's mesh.

The group's mesh (``workers.world.group_mesh``) names every dimension of the layout at every
degree: ``("pp", "expert_shard", "ep", "cp", "tp")``, with ``shard`` flattened from
``expert_shard x ep`` and ``shard_cp`` from ``expert_shard x ep x cp``; each degree is read
from it alone (``mesh_degree``), a dimension a mesh built by hand leaves out read as 1 (such a
mesh names at least ``shard`` and ``tp``). With context parallelism each rank computes its
chunks of every sequence (``split_sequences``, first, so that it holds before anything wraps
the blocks); a stage is parallelized over all but ``pp``. Tensor parallelism follows
Megatron: q/k/v and the SwiGLU gate/up projections are split column-wise, the attention
output and down projections row-wise. The embedding is split by vocabulary rows and the
output projection by vocabulary columns with replicated logits, so every TP rank computes
the same loss.
With sequence parallelism (TorchTitan's Llama plan) the residual stream, the norms and
dropout between the TP regions hold only the rank's share of the sequence: each region
all-gathers its input and reduce-scatters its output, the same bytes as one all-reduce,
and no TP rank holds the whole sequence's activations outside attention and the MLP.
Without it, each block needs one all-reduce forward and one backward, and the residual
stream is replicated. FSDP2 then shards each block and the root over the ``shard``
dimension (``shard_cp`` with context parallelism); with expert parallelism (``ep`` above 1)
the experts are split over ``ep`` first (``split_experts``).

Activation checkpointing is ``full`` (every block recomputed in backward) or ``selective``:
per op (TorchTitan's policy: the outputs of attention and of every other matmul are saved,
the cheap element-wise ops recomputed) or every Nth block.

Mixed precision goes through FSDP2's ``MixedPrecisionPolicy``: parameters are all-gathered
and computed in bf16 while the sharded master copy, the optimizer state and the gradient
reduction stay fp32. A group of one rank has nothing to shard: its model is left unwrapped
and its forward runs under ``torch.autocast``, as a single-device script trains (TorchTitan
does the same without FSDP). FSDP2 on one rank only adds copies and hooks: on an H200 the
206 M shape's step took 2.3x the plain script's through it. Gradients are summed, never
averaged: the loss is already divided by the global token count (see
``workers.train_step``), which also keeps clear of gloo's AVG reduction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from workers.context_parallel import ContextShare
from workers.experts import GroupedExperts, MoE
from workers.model import Transformer

Precision = Literal["auto", "fp32", "bf16", "fp16"]
ActivationCheckpointing = Literal["none", "full", "selective"]
# "op", or checkpoint every Nth block
SelectivePolicy = Literal["op"] | int
# float8's matmul (cuBLASLt, through torch._scaled_mm) takes sizes that are multiples of 16.
FLOAT8_MULTIPLE = 16


def convert_to_float8(model: nn.Module, device_type: str) -> None:
    """torchao's float8 training (TorchTitan's converter): every linear layer whose sizes suit
    float8's matmul becomes a ``Float8Linear`` (dynamic tensorwise scales: inputs and weights in
    e4m3, gradients in e5m2), except the output projection, whose logits float8 would coarsen.
    Before TP and FSDP2, which then shard the converted layers with their usual styles: TP's
    collectives carry the compute dtype. torchao's float8 TP styles, which gather in float8,
    are left out: gloo carries no float8 ("Invalid scalar type"), so no CPU test could hold
    them, and on one GPU there is no TP."""
    if device_type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        raise ValueError(f"compute.float8 needs a GPU of compute capability 8.9 or later (H100, L40S, ...); "
                         f"{torch.cuda.get_device_name()} is {torch.cuda.get_device_capability()}; "
                         "set compute.float8 = false")
    from torchao.float8 import convert_to_float8_training

    def suits(module: nn.Module, name: str) -> bool:
        return (name != "output" and isinstance(module, nn.Linear)
                and module.in_features % FLOAT8_MULTIPLE == 0 and module.out_features % FLOAT8_MULTIPLE == 0)

    convert_to_float8_training(model, module_filter_fn=suits)


def tensor_parallelize_transformer(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    # Between the TP regions the residual stream is sharded on the sequence (Shard(1)) with
    # sequence parallelism, replicated without.
    stream = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
        "output": ColwiseParallel(input_layouts=stream, output_layouts=Replicate()),
    }
    # A pipeline stage holds the embedding, the head, both or neither; between stages the
    # residual stream travels as each TP rank's local share of it.
    parallelize_module(model, tp_mesh, {name: style for name, style in root_plan.items()
                                        if getattr(model, name) is not None})
    block_plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=stream),
    }
    if model.args.qk_norm:
        # Each TP rank normalises its own heads (dimension 2) with the whole norm's weight,
        # whose gradient is then the sum of the ranks' parts.
        block_plan |= {f"attention.{norm}": SequenceParallel(sequence_dim=2, use_local_output=True)
                       for norm in ("q_norm", "k_norm")}
    if sequence_parallel:
        block_plan |= {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
    for block in model.layers.values():
        plan = expert_block_plan(block.feed_forward, block_plan, sequence_parallel) \
            if isinstance(block.feed_forward, MoE) else block_plan
        parallelize_module(block, tp_mesh, plan)
    if model.args.tie_embeddings:
        # Both layouts shard the vocabulary dimension, so the tie survives as one DTensor.
        model.output.weight = model.tok_embeddings.weight


def expert_block_plan(moe: MoE, block_plan: dict, sequence_parallel: bool) -> dict:
    """The TP plan of a block whose feed-forward is a mixture of experts: every TP rank routes
    the whole sequence's tokens (all-gathered from sequence parallelism's shares, which
    backward cuts again), the same on each, and computes them with the same experts (the
    routed experts are not split across TP ranks: expert parallelism splits them over the
    shard ranks); only the shared experts are split, like a dense feed-forward, their output
    all-reduced."""
    plan = {name: style for name, style in block_plan.items() if not name.startswith("feed_forward")}
    if moe.shared is not None:
        plan |= {"feed_forward.shared.w1": ColwiseParallel(), "feed_forward.shared.w3": ColwiseParallel(),
                 "feed_forward.shared.w2": RowwiseParallel(output_layouts=Replicate())}
    if sequence_parallel:
        plan["feed_forward"] = PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))
    return plan


def split_sequences(model: nn.Module, cp_mesh: DeviceMesh, causal_bias: bool = True) -> None:
    """Context parallelism: the model computes this rank's chunks of each sequence, its
    attention over every cp rank's keys and values (``workers.context_parallel``, which says
    what ``causal_bias`` chooses)."""
    if not isinstance(model, Transformer):
        raise ValueError("scaling.cp > 1 needs the reference model, whose attention gathers the sequence's keys "
                         f"and values; {type(model).__name__} does not: set scaling.cp = 1")
    share = ContextShare(cp_mesh.size(), cp_mesh.get_local_rank(), model.args.max_seq_len, cp_mesh.get_group(),
                         causal_bias)
    model.context = share
    for block in model.layers.values():
        block.attention.context = share


def compute_dtype(precision: Precision, mesh: DeviceMesh) -> torch.dtype:
    """``auto`` is bf16 on CUDA and fp32 on CPU, where the parity tests stay exact."""
    if precision == "auto":
        return torch.bfloat16 if mesh.device_type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)


def mixed_precision_policy(dtype: torch.dtype) -> MixedPrecisionPolicy:
    if dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def autocast_forward(model: nn.Module, device_type: str, dtype: torch.dtype) -> None:
    """``model``'s forward under ``torch.autocast`` (the weights stay fp32): mixed precision
    for a model FSDP2 does not wrap. The context closes even when the forward raises."""
    open_contexts = []

    def enter(module, args) -> None:
        context = torch.autocast(device_type, dtype=dtype)
        context.__enter__()
        open_contexts.append(context)

    def leave(module, args, output) -> None:
        open_contexts.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)


def mesh_degree(mesh: DeviceMesh, name: str) -> int:
    """The size of the mesh's dimension ``name``, flattened or not (``shard``, ``shard_cp``);
    1 where the mesh has none (a mesh built by hand, without the dimensions it does not split)."""
    try:
        return mesh[name].size()
    except KeyError:
        return 1


def split_experts(model: nn.Module, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> set[nn.Parameter]:
    """Expert parallelism: each rank of the ``ep`` dimension keeps its own experts of each
    expert layer (the stacks sharded along the experts, as DTensors of that dimension) and
    dispatches tokens to the others' by all-to-all (``GroupedExperts``). Where ``ep`` is less
    than ``shard`` (``expert_shard`` above 1), FSDP2 shards each rank's experts over
    ``expert_shard`` (along the experts where they divide evenly, else along their rows, as
    TorchTitan does), gathering them for the layer's forward. Returns the split weights FSDP2
    does not hold, which the model's FSDP2 must leave alone."""
    ep_mesh = mesh["ep"]
    expert_shard = mesh["expert_shard"] if mesh_degree(mesh, "expert_shard") > 1 else None
    split = set()
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for name, weight in list(module.named_parameters(recurse=False)):
                own = nn.Parameter(distribute_tensor(weight.data, ep_mesh, [Shard(0)], src_data_rank=None))
                module.register_parameter(name, own)
                split.add(own)
            module.dispatch_group = ep_mesh.get_group()
            if expert_shard is not None:
                held = module.w1.to_local().shape[0]
                along = Shard(0) if held % expert_shard.size() == 0 else Shard(1)
                fully_shard(module, mesh=expert_shard, mp_policy=mp_policy, shard_placement_fn=lambda _: along)
                summed_not_averaged(module)
    return set() if expert_shard is not None else split


def fully_shard_model(
    model: nn.Module, shard_mesh: DeviceMesh, blocks: list[nn.Module],
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), ignored: set[nn.Parameter] = frozenset(),
    reshard_after_forward: bool = True, offload: CPUOffloadPolicy | None = None,
) -> None:
    """FSDP2 per block, then at the root, with gradients summed across the shard dimension;
    ``ignored`` parameters (split experts) are not FSDP2's. ``reshard_after_forward``: ZeRO-3
    or ZeRO-2 for the blocks; ``offload``: the state in host memory."""
    ignored_params = set(ignored) or None
    options = dict(mesh=shard_mesh, mp_policy=mp_policy, ignored_params=ignored_params,
                   **({"offload_policy": offload} if offload is not None else {}))
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, **options)
    for module in [*blocks, model]:
        summed_not_averaged(module)


def summed_not_averaged(module: FSDPModule) -> None:
    """FSDP2's gradient reduction a plain sum: the loss is already divided by the global token
    count (``workers.train_step``). Plain SUM collectives: gloo has no PREMUL_SUM, and AVG
    is where gloo goes wrong."""
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


# Ops whose outputs the per-op policy saves: the matmuls (every other one, so that half of
# them are recomputed), attention (costly to recompute, small to keep) and the collectives
# TP, FSDP2 and context parallelism issue inside a block (recomputing one would repeat its
# communication).
_SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,  # context parallelism's keys and values
}


def _save_attention_and_every_other_matmul(counts: Counter, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    # Forward and recomputation count their matmuls apart, so both make the same choices.
    phase = "recompute" if ctx.is_recompute else "forward"
    if op == torch.ops.aten.mm.default:
        counts[phase] += 1
        if counts[phase] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _per_op_contexts():
    return create_selective_checkpoint_contexts(partial(_save_attention_and_every_other_matmul, Counter()))


def checkpointed(block: nn.Module, index: int, mode: ActivationCheckpointing, selective: SelectivePolicy) -> nn.Module:
    """``block`` (the ``index``-th) wrapped for the activation checkpointing ``mode`` asks."""
    if mode == "full":
        return checkpoint_wrapper(block)
    if mode == "selective" and selective == "op":
        return checkpoint_wrapper(block, context_fn=_per_op_contexts)
    if mode == "selective" and index % selective == 0:
        return checkpoint_wrapper(block)
    return block


def wrap_blocks(
    model: Transformer, activation_checkpointing: ActivationCheckpointing, compile_blocks: bool,
    selective: SelectivePolicy = "op",
) -> list[nn.Module]:
    """Activation checkpointing, then ``torch.compile``, per transformer block.

    One compiled block serves every layer (same code, same shapes), so compile time does not
    grow with depth; a block of experts compiles with graph breaks where its routing reads
    group sizes on the host. FSDP2's hooks stay outside the compiled region. Checkpoint FQNs are
    unchanged: DCP's state dict drops the wrappers' prefixes.
    """
    for index, (name, block) in enumerate(list(model.layers.named_children())):
        experts = isinstance(block.feed_forward, MoE)
        block = checkpointed(block, index, activation_checkpointing, selective)
        if compile_blocks:
            # A mixture of experts' routing sizes its groups of rows (and its all-to-all's
            # splits) on the host: graph breaks there, as TorchTitan compiles its MoE blocks,
            # and shapes that vary from the start, so that no step stalls to recompile.
            block = torch.compile(block, fullgraph=not experts, dynamic=True if experts else None)
        model.layers.register_module(name, block)
    return list(model.layers.values())


@dataclass(frozen=True)
class Parallelize:
    """The default ``parallelize_fn``: TP (the reference model's plan, with or without
    sequence parallelism, or a custom model's ``tp_plan(model, tp_mesh)``), per-block
    activation checkpointing and compile (reference model), then FSDP2 with the configured
    precision (none for a group of one fp32 rank)."""

    precision: Precision = "auto"
    activation_checkpointing: ActivationCheckpointing = "none"
    selective: SelectivePolicy = "op"
    compile: bool = False
    sequence_parallel: bool = False
    tp_plan: Callable[[nn.Module, DeviceMesh], None] | None = None
    float8: bool = False
    reshard_after_forward: bool = True  # ZeRO-3 (True) or ZeRO-2 (False): scaling.reshard_after_forward
    offload: bool = False  # FSDP2's CPUOffloadPolicy: compute.offload

    @staticmethod
    def splits_experts(mesh: DeviceMesh) -> bool:
        """Whether the experts are split over the ep ranks: the mesh's ``ep`` dimension above 1
        (at ``ep == shard`` too, where ``expert_shard`` is 1); a mesh built by hand without one
        splits none."""
        return mesh_degree(mesh, "ep") > 1

    def __call__(self, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if self.float8:
            convert_to_float8(model, mesh.device_type)
        cp = mesh_degree(mesh, "cp")
        if cp > 1:
            per_op = self.activation_checkpointing == "selective" and self.selective == "op"
            split_sequences(model, mesh["cp"], causal_bias=not (self.compile or per_op))
        if mesh["tp"].size() > 1:
            if self.tp_plan is not None:
                self.tp_plan(model, mesh["tp"])
            elif isinstance(model, Transformer):
                tensor_parallelize_transformer(model, mesh["tp"], self.sequence_parallel)
            else:
                raise ValueError("scaling.tp > 1 needs a tensor-parallel plan for a custom model: pass tp_plan "
                                 "(FSDP2 and the precision stay the config's) or parallelize_fn")
        blocks = []
        if isinstance(model, Transformer):
            blocks = wrap_blocks(model, self.activation_checkpointing, self.compile, self.selective)
        dtype = compute_dtype(self.precision, mesh)
        shard_mesh = mesh["shard_cp"] if cp > 1 else mesh["shard"]
        if shard_mesh.size() * mesh["tp"].size() == 1:
            # FSDP2 over one rank would only add copies, hooks and per-op DTensor dispatch.
            if dtype != torch.float32:
                autocast_forward(model, mesh.device_type, dtype)
            return model
        policy = mixed_precision_policy(dtype)
        experts = split_experts(model, mesh, policy) if self.splits_experts(mesh) else set()
        fully_shard_model(model, shard_mesh, blocks, policy, ignored=experts,
                          reshard_after_forward=self.reshard_after_forward,
                          offload=CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if self.offload else None)
        return model


parallelize = Parallelize()

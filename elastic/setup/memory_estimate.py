"""An estimate of the memory one rank needs to train a model shape on a layout: GPU memory
at the peak of a training step, and host memory for the committed state's copies.

Arithmetic on the shapes and the layout, not a measurement: it counts what this code keeps
alive at the peak of a training step (see docs/presets.md).
``python -m elastic.setup.preset_tables`` prints the tables in docs/presets.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from elastic.core.topology import Topology

# Only a type: the arithmetic reads the model's shape, its fields and the rules the owner
# derives from them (elastic.core.model_shape.ShapeRules), from a ModelShape (ModelArgs too) or
# a model section alike, and needs no pydantic to do it.
if TYPE_CHECKING:
    from elastic.core.model_shape import ModelShape
    from elastic.setup.config import ModelConfig

    Shape = ModelShape | ModelConfig

FP32_BYTES = 4
COMPUTE_BYTES = {"bf16": 2, "fp32": 4}
GIB = 2**30
# nvidia-smi shows an H100 80 GB as 81,559 MiB. A tenth of that is left for the CUDA
# context, NCCL buffers and allocator fragmentation, which this estimate does not count.
H100_GIB = 81_559 / 1024
H100_BUDGET_GIB = 0.9 * H100_GIB


def _routed_expert_parameters(model: Shape) -> int:
    """A block of experts' routed experts and router: whole on every TP rank (TP ranks route
    the same tokens to the same experts; expert parallelism splits them over shard ranks)."""
    return 3 * model.dim * model.expert_width * model.experts + model.dim * model.experts


def _block_parameters(model: Shape, tp: int, experts: bool | None = None) -> int:
    """One transformer block's parameters on one TP rank: projections split, norms, routed
    experts and router whole. A block of experts (by default the largest block the model
    has): every expert's SwiGLU, the shared experts' and the router."""
    head_dim = model.head_width
    attention = 2 * model.dim * (model.n_heads + model.kv_heads) * head_dim
    routed = 0
    if model.experts if experts is None else experts:
        feed_forward = 3 * model.dim * model.expert_width * model.shared_experts
        routed = _routed_expert_parameters(model)
    else:
        feed_forward = 3 * model.dim * model.ffn_hidden
    norms = 2 * model.dim + (2 * head_dim if model.qk_norm else 0)
    return (attention + feed_forward) // tp + routed + norms


def _root_parameters(model: Shape, tp: int, pp: int = 1) -> int:
    """The embedding, the output projection unless tied, and the final norm, on one TP rank;
    with pipeline stages, what the first or the last stage holds of them (one projection)."""
    projections = 1 if model.tie_embeddings or pp > 1 else 2
    return projections * model.vocab_size * model.dim // tp + model.dim


def _stage_layers(model: Shape, pp: int) -> int:
    """The blocks of the largest pipeline stage (``workers.pipeline.layers_of_stage``)."""
    return -(-model.n_layers // pp)


def parameter_count(model: Shape) -> int:
    dense = model.dense_layers if model.experts else model.n_layers
    return (_root_parameters(model, tp=1) + dense * _block_parameters(model, tp=1, experts=False)
            + (model.n_layers - dense) * _block_parameters(model, tp=1, experts=True))


def _norm_activation_bytes(dim: int, compute: int) -> int:
    """Per token, what one RMSNorm saves for backward: its input upcast to fp32 (twice in bf16,
    since ``x.float()`` is called twice; in fp32 that is the input itself, once), the
    normalised tensor and its product with the weight, and the fp32 inverse RMS."""
    fp32_copies = 2 if compute < FP32_BYTES else 1
    return (fp32_copies * FP32_BYTES + 2 * compute) * dim + FP32_BYTES


def _norm_and_projection_input_bytes(dim: int, compute: int, tp: int, sequence_parallel: bool) -> float:
    """Per token, a norm's saved tensors and the input the projections after it save.

    Without sequence parallelism both are whole on every TP rank, and the norm's output is
    the projections' input (one tensor). With it, the norm runs on the rank's ``1 / tp`` of
    the sequence, and the projections save the whole sequence's input, gathered after it.
    """
    norm = _norm_activation_bytes(dim, compute)
    if not sequence_parallel:
        return norm
    return (norm - compute * dim) / tp + compute * dim


def _layer_activation_bytes(model: Shape, tp: int, compute: int, sequence_parallel: bool) -> float:
    """Per token, what one transformer block saves for backward.

    The norms see the whole hidden state on every TP rank, or their share of the sequence
    with sequence parallelism. The rest is split by heads or by ffn columns: SDPA's fused
    kernel (flash or memory-efficient) saves q, k and v (k and v repeated to every head), its
    output (which is also wo's input) and an fp32 log-sum-exp per head, and no seq x seq
    matrix; SwiGLU saves w1's and w3's outputs, silu's output and their product. RoPE saves
    only its cos/sin buffer.
    """
    attention = 4 * compute * model.n_heads * model.head_width + FP32_BYTES * model.n_heads
    if model.qk_norm:
        # each head's query and key normed over its own width; the norm's output is what RoPE
        # took without it, counted above
        head_dim = model.head_width
        attention += (model.n_heads + model.kv_heads) * (_norm_activation_bytes(head_dim, compute) - compute * head_dim)
    # a token passes through its routed experts (whole on every TP rank) and the shared ones
    # (split like a dense feed-forward): SwiGLU's four per expert
    split_width = model.shared_width if model.experts else model.ffn_hidden
    routed = 4 * compute * model.expert_width * model.experts_per_token if model.experts else 0
    norms = 2 * _norm_and_projection_input_bytes(model.dim, compute, tp, sequence_parallel)
    return norms + (attention + 4 * compute * split_width) / tp + routed


def activation_bytes(
    model: Shape, *, tp: int, tokens: int, compute: int, activation_checkpointing: bool,
    sequence_parallel: bool = False, layers: int | None = None, gathered_tokens: int = 0,
) -> float:
    """What one micro-batch's forward saves for backward, logits and loss aside, over
    ``layers`` blocks (all of the model's by default). ``sequence_parallel``: the residual
    stream between TP regions is split over the TP ranks (``scaling.sequence_parallel``).
    ``gathered_tokens``: under context parallelism, the other cp ranks' tokens whose keys and
    values each block gathers and keeps for attention's backward (repeated to every head);
    the attention's output is then kept twice, by SDPA chunk by chunk and by the output
    projection whole (the chunks concatenated)."""
    layers = model.n_layers if layers is None else layers
    stream = tp if sequence_parallel else 1  # the residual stream's split
    outside_blocks = _norm_and_projection_input_bytes(model.dim, compute, tp, sequence_parallel)
    layer = _layer_activation_bytes(model, tp, compute, sequence_parallel)
    if gathered_tokens:
        heads_width = model.n_heads * model.head_width / tp
        layer += (gathered_tokens / tokens * 2 + 1) * compute * heads_width
    if model.dropout:
        # A one-byte mask per element (CUDA's fused dropout): the embedding's, and each
        # block's two residual branches'.
        outside_blocks += model.dim / stream
        layer += 2 * model.dim / stream
    if activation_checkpointing:
        # Each block keeps only its input; backward recomputes one block at a time.
        return tokens * (layers * compute * model.dim / stream + layer + outside_blocks)
    return tokens * (layers * layer + outside_blocks)


def memory_per_rank(
    model: Shape,
    layout: Topology,
    *,
    seq_len: int,
    micro_batch: int,
    precision: Literal["bf16", "fp32"] = "bf16",
    activation_checkpointing: bool = False,
    sequence_parallel: bool = False,
    reshard_after_forward: bool = True,
    offload: bool = False,
) -> dict[str, float]:
    """GiB one rank holds at the peak of a training step on ``layout`` (its degrees; the
    number of groups does not count), by what holds it, and the total.
    With context parallelism (``cp`` > 1) a rank computes ``1 / cp`` of each sequence's tokens
    and holds the keys and values of the rest in every block, and FSDP2 shards over
    ``shard x cp``.
    ``reshard_after_forward`` False (ZeRO-2) holds every block's gathered parameters from its
    forward to its backward; ``offload`` keeps the parameters, gradients and optimizer state
    in host memory (``host_memory_per_rank`` does not count them), none on the device.
    With expert parallelism (``ep`` > 1) a rank holds as many bytes of experts as FSDP2's
    shards of them, and FSDP2 gathers only its own experts (none where ``ep`` = ``shard``).

    The terms are added as if they peaked together. They do not quite (the loss's fp32
    buffers are freed before the blocks' gradients appear), so the total leans high. With
    ``pp`` pipeline stages (1F1B) a rank holds the largest stage's blocks and one of the two
    projections; the first stage keeps ``pp`` micro-batches' activations in flight and the
    last the logits, counted here as if one rank held both (high again).
    """
    tp, pp, cp = layout.tp, layout.pp, layout.cp
    compute = COMPUTE_BYTES[precision]
    tokens = micro_batch * seq_len // cp
    layers = _stage_layers(model, pp)
    block, root = _block_parameters(model, tp), _root_parameters(model, tp, pp)
    shard_parameters = (root + layers * block) / layout.parameter_shards
    # FSDP2 gathers a layer's experts that a rank computes: every expert at ep 1, the rank's
    # own 1 / ep of them below ep = shard, none at ep = shard (each rank holds its own whole)
    gathered_experts = 0.0 if layout.experts_held_whole else 1 / layout.ep
    routed_weights = _routed_expert_parameters(model) - model.dim * model.experts
    gathered_block = block - routed_weights * (1 - gathered_experts)
    output_projection = model.vocab_size * model.dim // tp
    on_device = 0 if offload else 1
    held_bytes = {
        "parameters": on_device * FP32_BYTES * shard_parameters,
        "gradients": on_device * FP32_BYTES * shard_parameters,
        "optimizer": on_device * 2 * FP32_BYTES * shard_parameters,
        # FSDP2 keeps the root's parameters gathered from forward through backward and
        # gathers two blocks at a time (the running one and the prefetched next), or, not
        # resharding after forward, holds every block's until its backward. In backward the
        # output projection's gradient waits for the root's reduce-scatter, and a block's
        # gradient is copied into an fp32 buffer to be reduce-scattered.
        "unsharded": (compute * (root + (2 if reshard_after_forward else layers) * gathered_block
                                 + output_projection)
                      + (compute + FP32_BYTES) * gathered_block),
        "activations": pp * activation_bytes(
            model, tp=tp, tokens=tokens, compute=compute, activation_checkpointing=activation_checkpointing,
            sequence_parallel=sequence_parallel, layers=layers, gathered_tokens=micro_batch * seq_len - tokens,
        ),
        # Logits are replicated across TP ranks. Cross-entropy saves them as fp32
        # log-probabilities (the compute-dtype logits are freed once the loss is computed),
        # and its backward makes two fp32 gradients of the same size.
        "logits": tokens * model.vocab_size * 3 * FP32_BYTES,
    }
    memory = {name: size / GIB for name, size in held_bytes.items()}
    memory["total"] = sum(memory.values())
    return memory


def host_memory_per_rank(model: Shape, layout: Topology) -> dict[str, float]:
    """GiB of host memory one rank holds for its committed state's copies on ``layout``, by what
    holds it.

    The committed state is the fp32 parameters and AdamW's two fp32 moments of the rank's
    shard, of ``shard x cp`` (the generators add bytes). The memory tier keeps two copies of it (the newest two
    snapshots) and two of the state of the rank it is buddy to (the same size at every
    position of a layout); a checkpoint's staging arena holds one more.
    """
    tp, pp = layout.tp, layout.pp
    parameters = _root_parameters(model, tp, pp) + _stage_layers(model, pp) * _block_parameters(model, tp)
    state = 3 * FP32_BYTES * parameters / layout.parameter_shards
    memory = {"state": state / GIB, "memory_tier": 4 * state / GIB, "staging": state / GIB}
    memory["total"] = memory["memory_tier"] + memory["staging"]
    return memory

"""One step's math on one rank: gradients over its micro-batches (their cross-group sum is``workers.gradient_sum``'s).

The loss of a step is the sum of per-token losses over the whole global batch divided by
the global token count. Each rank adds its share of that sum, so the gradient is the same
however the driver splits the batch across groups, ranks and micro-batches. Where labels
are ignored, the ranks also sum the targets that count, and the step is rescaled to the mean
over those (``token_rescale``) once every share is in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from elastic.core.data_plan import PADDING_INDEX
from elastic.core.topology import MESH_FLATTENED
from elastic.data.tokenizing import IGNORE_INDEX  # a label that takes no part in the loss, as HuggingFace marks it
from workers.context_parallel import ContextShare
from workers.experts import MoE, add_micro_batch, expert_layers, set_row_shares

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Any model, any batch: (the batch's summed loss, how many things it summed over)
BatchLossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, "torch.Tensor | int"]]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default ``loss_fn``: per-token loss of shape (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(
        targets.shape
    )




def sample_ids(sample) -> tuple[torch.Tensor, torch.Tensor]:
    """A sample's ``seq_len + 1`` token ids and its labels, aligned with them. A sample is a
    1-D tensor of ids (its labels are the ids), or a dict as HuggingFace datasets give: its
    ``input_ids`` and, optionally, its ``labels``, where ``IGNORE_INDEX`` marks the positions
    that are not trained on (prompts, padding)."""
    if isinstance(sample, Mapping):
        ids = torch.as_tensor(sample["input_ids"])
        return ids, torch.as_tensor(sample["labels"]) if "labels" in sample else ids
    return sample, sample


def sample_positions(sample) -> torch.Tensor | None:
    """A packed sample's ``positions`` (each token's place in its document, 0 where one
    begins) where its documents must not see each other; None for any other sample."""
    return torch.as_tensor(sample["positions"]) if isinstance(sample, Mapping) and "positions" in sample else None


class Batch(NamedTuple):
    """A micro-batch: inputs and next-token targets of shape (batch, seq), each target's weight
    (0 for padding rows and ignored labels), and how many targets count; ``positions`` where
    packed documents must not see each other (the reference model takes them). For a
    ``batch_loss_fn``: ``inputs`` is what ``collate_fn`` made of the real samples, ``weights``
    one weight for them all (0 for a micro-batch of padding only), no targets."""

    inputs: Any
    targets: torch.Tensor
    weights: torch.Tensor
    counted_tokens: int
    positions: torch.Tensor | None = None

    def row_shares(self, global_count: float) -> torch.Tensor:
        """Each row's share of the step's loss: its weighted targets over ``global_count``,
        ``(batch,)``; for a ``batch_loss_fn``'s batch one share for every row."""
        weights = self.weights.reshape(self.weights.shape[0], -1).sum(-1) if self.weights.dim() else self.weights
        return weights / global_count

    def context_share(self, share: ContextShare) -> Batch:
        """This batch cut to a context-parallel rank's chunks of its sequences: its inputs,
        targets, weights and positions; its count, the targets it holds."""
        weights = share.split(self.weights)
        positions = None if self.positions is None else share.split(self.positions)
        return Batch(share.split(self.inputs), share.split(self.targets), weights, int(weights.sum().item()), positions)

    def to(self, device: torch.device) -> Batch:
        inputs = tree_map(lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, self.inputs)
        positions = None if self.positions is None else self.positions.to(device)
        return Batch(inputs, self.targets.to(device), self.weights.to(device), self.counted_tokens, positions)


def collate(dataset, indices: Sequence[int], device: torch.device, collate_fn: Callable | None = None) -> Batch:
    """Stack samples into a batch; padding rows carry zero weight. With ``collate_fn`` (a
    ``batch_loss_fn``'s samples), its batch of the real samples: padding rows are left out, and
    a micro-batch of padding only runs on sample 0 weighted 0, as its group's collectives must."""
    real = [i for i in indices if i != PADDING_INDEX]
    if collate_fn is not None:
        inputs = collate_fn([dataset[i] for i in (real or [0])])
        return Batch(inputs, torch.empty(0), torch.tensor(1.0 if real else 0.0), 0).to(device)
    first = dataset[real[0]] if real else dataset[0]
    template = sample_ids(first)
    samples = [dataset[i] if i != PADDING_INDEX else None for i in indices]
    rows = [sample_ids(sample) if sample is not None else tuple(map(torch.zeros_like, template)) for sample in samples]
    ids = torch.stack([row[0] for row in rows])
    targets = torch.stack([row[1] for row in rows])[:, 1:]
    ignored = targets == IGNORE_INDEX
    padding = torch.tensor([i == PADDING_INDEX for i in indices])
    weights = (~(ignored | padding[:, None])).float()
    # A loss_fn need not know IGNORE_INDEX: an ignored target is a valid id weighted 0.
    targets = targets.masked_fill(ignored, 0)
    positions = None
    if sample_positions(first) is not None:  # a padding row is one document
        positions = torch.stack([sample_positions(sample) if sample is not None else
                                 torch.arange(len(template[0])) for sample in samples])[:, :-1]
    return Batch(ids[:, :-1], targets, weights, int(weights.sum().item()), positions).to(device)


def per_target_losses(loss_fn: LossFn, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``loss_fn``'s losses, one per target, checked: another shape would fail far from the
    hook that made it, or broadcast into a wrong sum."""
    losses = loss_fn(logits, targets)
    if losses.shape != targets.shape:
        raise ValueError(f"loss_fn returned losses of shape {tuple(losses.shape)} for targets of shape "
                         f"{tuple(targets.shape)}: return one loss per target (reduction='none')")
    return losses.float()


def weighted_loss(loss_fn: LossFn, logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                  global_tokens: int) -> torch.Tensor:
    """A micro-batch's share of the global loss: its weighted token losses summed, over the
    global token count."""
    return (per_target_losses(loss_fn, logits, targets) * weights).sum() / global_tokens


@dataclass(frozen=True)
class TokenLoss:
    """The next-token form: ``loss_fn(logits, targets)``'s per-token losses, weighted, summed;
    the count is the targets that count."""

    loss_fn: LossFn

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, float]:
        logits = model(batch.inputs) if batch.positions is None else model(batch.inputs, positions=batch.positions)
        losses = per_target_losses(self.loss_fn, logits, batch.targets)
        return (losses * batch.weights).sum(), batch.counted_tokens


@dataclass(frozen=True)
class SampleLoss:
    """Any model, any batch: ``batch_loss_fn(model, batch) -> (loss_sum, count)``. The step is
    normalised by the count summed over every rank and group, so it is the same at any number
    of live groups."""

    batch_loss_fn: BatchLossFn

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, count = self.batch_loss_fn(model, batch.inputs)
        weight = batch.weights
        return loss_sum.float() * weight, torch.as_tensor(count, dtype=torch.float64, device=weight.device) * weight


MicroBatchLoss = TokenLoss | SampleLoss


def _loss_share(model: nn.Module, loss: MicroBatchLoss, batches: Sequence[Batch], global_tokens: int,
                on_micro_batch: Callable[[int], None], backward: bool,
                experts: Sequence[MoE] = (), loss_scale: float = 1.0) -> tuple[float, float]:
    """The micro-batches' summed loss shares over ``global_tokens`` and their summed counts,
    the shares summed on the device and read once, so the host never waits for the device
    between micro-batches. ``experts``: the expert layers that count the tokens the step routes
    to each expert (its load, and the bias's step) and weigh each row's balance loss.
    ``loss_scale``: what backward multiplies the loss by (fp16's), not the shares returned."""
    loss_share = torch.zeros((), device=batches[0].weights.device)
    counted = 0.0
    try:
        for index, batch in enumerate(batches):
            on_micro_batch(index)
            if experts:
                set_row_shares(experts, batch.row_shares(global_tokens))
            loss_sum, count = loss(model, batch)
            share = loss_sum / global_tokens
            if backward:
                (share * loss_scale if loss_scale != 1.0 else share).backward()
            add_micro_batch(experts, first=index == 0)
            loss_share += share.detach()
            counted = counted + count
    finally:
        set_row_shares(experts, None)
    return loss_share.item(), float(counted)


def counted_tokens(batches: Sequence[Batch]) -> int:
    return sum(batch.counted_tokens for batch in batches)


def accumulate_counted(model: nn.Module, loss: MicroBatchLoss, batches: Sequence[Batch], global_tokens: int,
                       on_micro_batch: Callable[[int], None] = lambda index: None,
                       experts: Sequence[MoE] | None = None, loss_scale: float = 1.0) -> tuple[float, float]:
    """Forward and backward over each micro-batch; returns this rank's share of the loss over
    ``global_tokens``, and what it counted (``token_rescale`` makes the step the mean over
    every rank's count). ``experts``: the model's expert layers, where the caller holds them
    (a step on a hot path), else found in the model."""
    experts = expert_layers(model) if experts is None else experts
    return _loss_share(model, loss, batches, global_tokens, on_micro_batch, backward=True, experts=experts,
                       loss_scale=loss_scale)


def accumulate_gradients(model: nn.Module, loss_fn: LossFn, batches: Sequence[Batch], global_tokens: int,
                         on_micro_batch: Callable[[int], None] = lambda index: None) -> float:
    """``accumulate_counted`` of the next-token form: the share of the loss."""
    return accumulate_counted(model, TokenLoss(loss_fn), batches, global_tokens, on_micro_batch)[0]


def evaluate_counted(model: nn.Module, loss: MicroBatchLoss, batches: Sequence[Batch], global_tokens: int,
                     on_micro_batch: Callable[[int], None] = lambda index: None) -> tuple[float, float]:
    """This rank's share of the held-out loss and its count, in eval mode (no dropout), with no
    gradients."""
    model.eval()
    try:
        with torch.no_grad():
            return _loss_share(model, loss, batches, global_tokens, on_micro_batch, backward=False)
    finally:
        model.train()
        reshard(model)


def reshard(model: nn.Module) -> None:
    """Back to sharded parameters after forwards with no backward. FSDP2 keeps a root module's
    parameters gathered after its forward, for the backward that follows; an evaluation has
    none, and healing, the memory tier and the integrity fingerprints read the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def evaluate_loss(model: nn.Module, loss_fn: LossFn, batches: Sequence[Batch], global_tokens: int,
                  on_micro_batch: Callable[[int], None] = lambda index: None) -> float:
    """``evaluate_counted`` of the next-token form: the share of the held-out loss."""
    return evaluate_counted(model, TokenLoss(loss_fn), batches, global_tokens, on_micro_batch)[0]


def _counted_here(tensor: torch.Tensor, coordinate: dict[str, int]) -> bool:
    """Whether this rank counts ``tensor`` toward the group's gradient norm: a tensor
    replicated along a mesh dimension (or not laid out on it at all) is counted only by the
    rank at coordinate 0 of that dimension, so every element is counted exactly once. A tensor
    sharded along a dimension flattened from others (``MESH_FLATTENED``: ``shard``,
    ``shard_cp``) is sharded along them, and one sharded along all of them along it."""
    if not isinstance(tensor, DTensor):
        return all(index == 0 for index in coordinate.values())
    names = tensor.device_mesh.mesh_dim_names or ()
    sharded = {name for name, placement in zip(names, tensor.placements) if not placement.is_replicate()}
    for whole, parts in MESH_FLATTENED.items():
        if whole in sharded:
            sharded.update(parts)
    for whole, parts in MESH_FLATTENED.items():
        if sharded.issuperset(parts):
            sharded.add(whole)
    return all(index == 0 for name, index in coordinate.items() if name not in sharded)


def squared_gradient_norm(model: nn.Module, coordinate: dict[str, int]) -> float:
    """This rank's part of the squared L2 norm of the group's gradients; the parts of a
    group's ranks add up to the whole. ``coordinate``: this rank's index on each dimension
    of the group's mesh, by name."""
    grads = [
        grad._local_tensor if isinstance(grad, DTensor) else grad
        for grad in (param.grad for param in model.parameters())
        if grad is not None and _counted_here(grad, coordinate)
    ]
    if not grads:
        return 0.0
    norms = torch._foreach_norm(grads)
    return torch.stack(norms).double().square().sum().item()


def scale_gradients(model: nn.Module, scale: float) -> None:
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    if grads and scale != 1.0:
        torch._foreach_mul_([g._local_tensor if isinstance(g, DTensor) else g for g in grads], scale)

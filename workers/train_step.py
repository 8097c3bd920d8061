"""One step's math on one rank: gradients over its micro-batches, then the cross-group sum.

The loss of a step is the sum of per-token losses over the whole global batch divided by
the global token count. Each rank adds its share of that sum, so the gradient is the same
however the driver splits the batch across groups, ranks and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from elastic.core.data_plan import PADDING_INDEX

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The default ``loss_fn``: per-token loss of shape (batch, seq)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(
        targets.shape
    )


def collate(dataset, indices: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into (tokens, sample mask); padding rows carry zero weight."""
    real = [i for i in indices if i != PADDING_INDEX]
    template = dataset[real[0]] if real else dataset[0]
    rows = [dataset[i] if i != PADDING_INDEX else torch.zeros_like(template) for i in indices]
    tokens = torch.stack(rows).to(device)
    mask = torch.tensor([i != PADDING_INDEX for i in indices], dtype=torch.float32, device=device)
    return tokens, mask


Batch = tuple[torch.Tensor, torch.Tensor]


def accumulate_gradients(
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Batch],
    global_tokens: int,
    on_micro_batch: Callable[[int], None] = lambda index: None,
) -> float:
    """Forward and backward over each micro-batch; returns this rank's share of the loss.

    The share is summed on the device and read once, so the host never waits for the device
    between micro-batches.
    """
    loss_share = torch.zeros((), device=batches[0][0].device)
    for index, (tokens, mask) in enumerate(batches):
        on_micro_batch(index)
        logits = model(tokens[:, :-1])
        token_losses = loss_fn(logits, tokens[:, 1:])
        loss = (token_losses.float() * mask[:, None]).sum() / global_tokens
        loss.backward()
        loss_share += loss.detach()
    return loss_share.item()


def local_gradients(model: nn.Module) -> list[torch.Tensor]:
    """This rank's gradient shards, in parameter order (identical layout across groups)."""
    grads = []
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        grad = param.grad
        grads.append(grad._local_tensor if isinstance(grad, DTensor) else grad)
    return grads


def sum_across_groups(model: nn.Module, replicate_group, wait: Callable, dtype: torch.dtype = torch.float32) -> None:
    """Sum gradient shards over the replicate group in one flat all-reduce, in ``dtype``.

    ``wait(work)`` blocks until the all-reduce is done; the worker's version can be cut
    short by the driver or by the step's deadline.
    """
    grads = local_gradients(model)
    flat = torch.cat([g.reshape(-1) for g in grads]).to(dtype)
    wait(replicate_group.allreduce([flat]))
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()

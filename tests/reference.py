"""A single-process reference: same model, data order, loss and optimizer; no Ray, no mesh."""

from __future__ import annotations

import numpy as np
import torch

from elastic.config import TrainConfig
from elastic.core.data_plan import DataCursor, take_global_batch
from elastic.hooks import resolve_hooks
from workers.train_step import accumulate_gradients, collate


def reference_run(config: TrainConfig, steps: int, chunks: int = 1) -> tuple[list[float], list[torch.Tensor]]:
    """``chunks`` > 1 accumulates the gradient over that many slices of each global batch:
    the same math summed in another order, as replica groups do."""
    hooks = resolve_hooks(config)
    torch.manual_seed(config.seed)
    model = hooks.model_fn()
    optimizer = hooks.optimizer_fn(model.parameters())
    dataset = hooks.dataset
    cursor, losses = DataCursor(), []
    for _ in range(steps):
        indices, cursor = take_global_batch(cursor, len(dataset), config.global_batch, config.seed)
        batches = [collate(dataset, part.tolist(), torch.device("cpu")) for part in np.array_split(indices, chunks)]
        losses.append(accumulate_gradients(model, hooks.loss_fn, batches, len(indices) * config.data.seq_len))
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


def max_parameter_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))

"""A single-process reference: same model, data order, loss and optimizer; no Ray, no mesh."""

from __future__ import annotations

import torch

from elastic.config import TrainConfig
from elastic.data_plan import DataCursor, take_global_batch
from elastic.hooks import resolve_hooks
from workers.train_step import accumulate_gradients, collate


def reference_run(config: TrainConfig, steps: int) -> tuple[list[float], list[torch.Tensor]]:
    hooks = resolve_hooks(config)
    torch.manual_seed(config.seed)
    model = hooks.model_fn()
    optimizer = hooks.optimizer_fn(model.parameters())
    dataset = hooks.dataset
    cursor, losses = DataCursor(), []
    for _ in range(steps):
        indices, cursor = take_global_batch(cursor, len(dataset), config.global_batch, config.seed)
        batch = collate(dataset, indices.tolist(), torch.device("cpu"))
        losses.append(accumulate_gradients(model, hooks.loss_fn, [batch], len(indices) * config.data.seq_len))
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))

"""A single-process reference: same model, data order, loss, optimizer, learning-rate schedule
and clipping; no Ray, no mesh. Clipping uses torch's own ``clip_grad_norm_``, not the
trainer's norm code, so the two are checked against each other."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from elastic.setup.config import TrainConfig
from elastic.core.data_plan import DataCursor, take_global_batch
from elastic.setup.hooks import resolve_hooks
from workers.experts import RoutedLayout, balance_experts, expert_layers, expert_load
from workers.train_step import accumulate_gradients, collate


@dataclass
class ReferenceTrace:
    losses: list[float]
    grad_norms: list[float]
    lrs: list[float]
    params: list[torch.Tensor]
    expert_loads: list[dict[int, float]] = field(default_factory=list)  # per step, as the step records hold them


def huggingface_loss(model, samples: list[dict]) -> torch.Tensor:
    """The mean next-token loss over the labels that are not -100, as HuggingFace's causal
    language models compute it: none of the trainer's code."""
    ids = torch.stack([torch.as_tensor(sample["input_ids"]) for sample in samples])
    labels = torch.stack([torch.as_tensor(sample["labels"]) for sample in samples])
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)


def reference_trace(config: TrainConfig, steps: int, chunks: int = 1, dataset=None) -> ReferenceTrace:
    """``chunks`` > 1 accumulates the gradient over that many slices of each global batch:
    the same math summed in another order, as replica groups do. A ``dataset`` of dict samples
    with labels is trained with ``huggingface_loss`` over each whole batch."""
    hooks = resolve_hooks(config, dataset=dataset)
    torch.manual_seed(config.seed)
    model = hooks.model_fn()
    optimizer = hooks.optimizer_fn(model.parameters())
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    schedule = config.lr_schedule
    max_norm = config.optimizer.clip_grad_norm or math.inf
    dataset = hooks.dataset
    cursor, trace = DataCursor(), ReferenceTrace([], [], [], [])
    for step in range(steps):
        indices, cursor = take_global_batch(cursor, len(dataset), config.global_batch, config.seed)
        if isinstance(dataset[0], dict):
            loss = huggingface_loss(model, [dataset[i] for i in indices.tolist()])
            loss.backward()
            trace.losses.append(loss.item())
        else:
            batches = [collate(dataset, part.tolist(), torch.device("cpu")) for part in np.array_split(indices, chunks)]
            trace.losses.append(accumulate_gradients(model, hooks.loss_fn, batches, len(indices) * config.data.seq_len))
        trace.grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        for group, base_lr in zip(optimizer.param_groups, base_lrs):
            group["lr"] = base_lr * schedule.factor(step)
        trace.lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        optimizer.zero_grad()
        experts = expert_layers(model)  # the one process routed every token of the step
        layout = RoutedLayout.of(model.args) if experts else RoutedLayout((), 0)
        routed = layout.routed_tokens(experts)
        trace.expert_loads.append(expert_load(layout, routed))
        balance_experts(experts, layout, routed)
    trace.params = [p.detach().clone() for p in model.parameters()]
    return trace


def reference_run(config: TrainConfig, steps: int, chunks: int = 1) -> tuple[list[float], list[torch.Tensor]]:
    trace = reference_trace(config, steps, chunks)
    return trace.losses, trace.params


def max_parameter_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


"""A single-process reference: same model, data order, loss, optimizer, learning-rate schedule
and clipping; no Ray, no mesh. Clipping uses torch's own ``clip_grad_norm_``, not the
trainer's norm code, so the two are checked against each other."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from elastic.setup.config import TrainConfig
from elastic.core.data_plan import DataCursor, split_across_groups, take_global_batch
from elastic.setup.hooks import resolve_hooks
from workers.experts import RoutedLayout, balance_experts, expert_layers, expert_load
from workers.train_step import accumulate_gradients, collate
from torch.optim.sgd import sgd


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



def reference_diloco(config: TrainConfig, steps: int, learners: list[list[int]] | None = None,
                     dropped: dict[int, list[int]] | None = None) -> tuple[list[float], list[torch.Tensor]]:
    """DiLoCo in one process, written from the paper, not from the trainer's code: one copy of
    the model and an inner optimizer per group, each stepping on its share of every global
    batch with its own mean gradient (clipped by its own norm); the experts' bias moved by every
    learner's routed tokens; every ``sync.outer_every`` steps the pseudo-gradients (global
    weights minus each learner's, weighted by its share of the round's tokens) summed, Nesterov
    SGD on the global weights, which every learner takes, and the inner optimizers' state
    zeroed. ``learners``: the groups that step at each step (default: every group, every
    step); ``dropped``: by step, the groups dropped from their round as it began
    (``sync.lost_learner = "drop"``): their samples of the round go back to the data plan, which
    the next steps take first. A group that steps inside a round it did not step in the step
    before, or was dropped from, starts from the round's start. Streaming DiLoCo
    (``sync.fragments``): block ``i``'s parameters are fragment ``(i + 1) % fragments``'s (the
    embeddings fragment 0's, the final norm and output the last's), fragment ``f`` synced after the round's
    step ``(f + 1) * outer_every // fragments`` with the tokens since its own last sync, and every
    fragment after each ``fragments``-th round's last step; with ``sync.sync_delay`` a turn's
    outer step (but where every fragment syncs) applied that many inner steps later, each learner
    keeping ``sync.fragment_alpha`` of its own weights of the fragment then (and at undelayed
    turns). Returns each step's loss (over every
    learner's tokens) and the final weights (the global ones, a round having just ended)."""
    hooks = resolve_hooks(config)
    rounds = config.sync.outer_rounds
    torch.manual_seed(config.seed)
    first = hooks.model_fn()
    groups = config.scaling.max_groups
    learners = learners or [list(range(groups))] * steps
    models = [copy.deepcopy(first) for _ in range(groups)]
    optimizers = [hooks.optimizer_fn(model.parameters()) for model in models]
    base_lrs = [group["lr"] for group in optimizers[0].param_groups]
    # the trained weights: the experts' bias is moved by the routed tokens alike on every learner
    global_weights = [param.detach().clone() for param in first.parameters() if param.requires_grad]
    momenta = [torch.zeros_like(param) for param in global_weights]
    max_norm = config.optimizer.clip_grad_norm or math.inf
    dataset, seq_len = hooks.dataset, config.data.seq_len
    cursor, losses = DataCursor(), []
    round_samples = [[] for _ in range(groups)]
    dropped = dropped or {}
    every, fragments = rounds.every, rounds.fragments
    fragment_tokens = [[0] * groups for _ in range(fragments)]
    pending = None  # a delayed outer step: (merged after step, fragment, its parameters, the pseudo-gradients' sum)
    names = [name for name, param in first.named_parameters() if param.requires_grad]
    blocks = [int(name.split(".")[1]) if name.startswith("layers.") else None for name in names]
    first_block = next(index for index, block in enumerate(blocks) if block is not None)
    fragment = [(block + 1) % fragments if block is not None else (0 if index < first_block else fragments - 1)
                for index, block in enumerate(blocks)]
    for step in range(steps):
        stepping = learners[step]
        for lost in dropped.get(step, []):  # its samples go back
            cursor = cursor.with_returned(round_samples[lost])
            fragment_tokens[0][lost], round_samples[lost] = 0, []  # a drop: one fragment
        joining = [] if rounds.at_boundary(step) else set(stepping) - (set(learners[step - 1]) - set(dropped.get(step, [])))
        for group in sorted(joining):
            to_round_start(models[group], optimizers[group], global_weights)
        indices, cursor = take_global_batch(cursor, len(dataset), config.global_batch, config.seed)
        plans = split_across_groups(indices, {group: 1.0 for group in stepping})
        step_tokens, loss = len(indices) * seq_len, 0.0
        for group in stepping:
            learner, optimizer = models[group], optimizers[group]
            part = plans[group].indices
            loss += accumulate_gradients(learner, hooks.loss_fn, [collate(dataset, part.tolist(), torch.device("cpu"))],
                                         step_tokens)
            for param in learner.parameters():
                if param.grad is not None:
                    param.grad.mul_(step_tokens / (len(part) * seq_len))
            for tokens in fragment_tokens:
                tokens[group] += len(part) * seq_len
            round_samples[group] += part.tolist()
            torch.nn.utils.clip_grad_norm_(learner.parameters(), max_norm)
            for param_group, base_lr in zip(optimizer.param_groups, base_lrs):
                param_group["lr"] = base_lr * config.lr_schedule.factor(step)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss)
        held = [expert_layers(models[group]) for group in stepping]
        if held[0]:
            layout = RoutedLayout.of(models[0].args)
            routed = [sum(counts) for counts in zip(*(layout.routed_tokens(experts) for experts in held))]
            for model in models:  # every learner's bias, one out of the round included, moves alike
                balance_experts(expert_layers(model), layout, routed)
        aligned = (step + 1) % (every * fragments) == 0
        if pending and pending[0] == step:  # a delayed outer step merges: each learner mixes in alpha of its own
            _, synced, held, pseudo = pending
            pending = None
            sgd([global_weights[index] for index in held], pseudo, [momenta[index] for index in held],
                weight_decay=0.0, momentum=rounds.momentum, lr=rounds.lr, dampening=0.0, nesterov=True,
                maximize=False)
            for model, optimizer in zip(models, optimizers):
                to_round_start(model, optimizer, global_weights, held, rounds.alpha)
        into_round = (step + 1) % every or every
        syncing = range(fragments) if aligned else [part for part in range(fragments)
                                                     if (part + 1) * every // fragments == into_round]
        for synced in syncing:
            held = [index for index, placed in enumerate(fragment) if placed == synced]
            total = sum(fragment_tokens[synced])
            weighted = [[(global_weights[index] - trained(model)[index].detach()) * (tokens / total) for index in held]
                        for model, tokens in zip(models, fragment_tokens[synced]) if tokens]
            pseudo = ([sum(parts) for parts in zip(*weighted)] if rounds.precision not in ("fp8", "int4")
                      else coded_sum(weighted, rounds.precision))
            fragment_tokens[synced] = [0] * groups
            if rounds.delay and not aligned:  # sent now, merged ``delay`` inner steps on
                pending = (step + rounds.delay, synced, held, pseudo)
                continue
            sgd([global_weights[index] for index in held], pseudo, [momenta[index] for index in held],
                weight_decay=0.0, momentum=rounds.momentum, lr=rounds.lr, dampening=0.0, nesterov=True,
                maximize=False)
            for model, optimizer in zip(models, optimizers):
                to_round_start(model, optimizer, global_weights, held, 0.0 if aligned else rounds.alpha)
        if (step + 1) % every == 0:
            round_samples = [[] for _ in range(groups)]
    final = [param.detach().clone() for param in models[learners[-1][0]].parameters()]
    return losses, final


def coded_sum(weighted: list[list[torch.Tensor]], precision: str) -> list[torch.Tensor]:
    """The learners' pseudo-gradients summed in ``precision``'s codes (streaming DiLoCo's
    quantized outer gradients): each learner's values, its parameters in order, coded in blocks
    of 64 with the block's largest magnitude as its scale and decoded; the sum in fp32, in the
    learners' order, coded and decoded once more, as every learner receives it."""
    def round_trip(values: torch.Tensor) -> torch.Tensor:
        blocks = torch.nn.functional.pad(values, (0, -values.numel() % 64)).view(-1, 64)
        largest_code = 7.0 if precision == "int4" else torch.finfo(torch.float8_e4m3fn).max
        largest = blocks.abs().amax(dim=1, keepdim=True)
        scale = torch.where(largest > 0, largest / largest_code, torch.ones_like(largest))
        scaled = (blocks / scale).clamp(-largest_code, largest_code)
        coded = torch.round(scaled) if precision == "int4" else scaled.to(torch.float8_e4m3fn).float()
        return (coded * scale).reshape(-1)[:values.numel()]

    shapes = [part.shape for part in weighted[0]]
    total = torch.zeros(sum(part.numel() for part in weighted[0]))
    for parts in weighted:
        total += round_trip(torch.cat([part.reshape(-1) for part in parts]))
    return [part.view(shape) for part, shape in zip(round_trip(total).split([shape.numel() for shape in shapes]), shapes)]


def to_round_start(model: torch.nn.Module, optimizer: torch.optim.Optimizer, global_weights: list[torch.Tensor],
                   held: list[int] | None = None, alpha: float = 0.0) -> None:
    """A learner at a round's start: the global weights (``alpha`` of its own mixed in), its
    inner optimizer's state zeroed (of the trained parameters ``held``, by index: default all)."""
    params = trained(model)
    held = range(len(params)) if held is None else held
    with torch.no_grad():
        for index in held:
            params[index].mul_(alpha).add_(global_weights[index], alpha=1.0 - alpha)
            for value in optimizer.state[params[index]].values():
                if torch.is_tensor(value):
                    value.zero_()


def trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [param for param in model.parameters() if param.requires_grad]

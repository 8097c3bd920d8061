"""The mixture of experts the reference model (``workers.model``) puts in place of its
feed-forward layers: ``MoE``'s token-choice top-k routing over ``GroupedExperts``, stacked
SwiGLU weights computed with one grouped GEMM, dropless, so a token's output is the same at any
layout; the routed tokens a step counts per expert (``RoutedLayout``), the load it records and
DeepSeek-V3's balancing by them. Also the SwiGLU ``FeedForward``: the dense layers' and the
shared experts'.

Parallelism is applied from outside (``workers.parallelize``: FSDP2 shards the stacks along
the experts; expert parallelism sets ``GroupedExperts.dispatch_group``). This module imports
nothing of the model's: it reads the model's shape (``elastic.core.model_shape.ModelShape``, of
which ``workers.model.ModelArgs`` is one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from elastic.core.model_shape import ModelShape


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# The CUDA kernel of ``torch._grouped_mm`` takes groups whose row counts are multiples of 16;
# the CPU one takes any. Rows of padding are zeros, dropped after.
GROUP_ROWS_CUDA = 16


def grouped_gemm_runs(rows: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these rows: its CUDA kernel, and the meta kernel
    torch.compile traces with, take bf16 only; its CPU kernel takes any dtype."""
    return rows.dtype == torch.bfloat16 or (rows.device.type == "cpu" and not torch.compiler.is_compiling())


def looped_mm(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``grouped_mm``'s product a group at a time (the group sizes read on the host)."""
    return torch.cat([part @ weight.T for part, weight in zip(rows.split(counts.tolist()), weights)])


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, align: int) -> torch.Tensor:
    """``rows`` (sorted by group, ``counts[g]`` of group ``g``) times each group's
    ``weights[g]`` (out x in, as ``nn.Linear`` holds it), in one grouped GEMM where it runs,
    else a matmul per group. Where ``align`` is over 1, each group's rows are padded with
    zeros to a multiple of it first."""
    if not grouped_gemm_runs(rows):
        return looped_mm(rows, weights, counts)
    if align == 1:
        return torch._grouped_mm(rows, weights.transpose(-2, -1), offs=torch.cumsum(counts, 0).to(torch.int32))
    padded = (counts + align - 1) // align * align
    # where each sorted row goes: its group's padded start, plus its place within the group
    group_of_row = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts,
                                           output_size=rows.shape[0])
    shift = (torch.cumsum(padded, 0) - padded) - (torch.cumsum(counts, 0) - counts)
    place = torch.arange(rows.shape[0], device=rows.device) + shift[group_of_row]
    spread = rows.new_zeros(int(padded.sum()), rows.shape[1]).index_copy(0, place, rows)
    out = torch._grouped_mm(spread, weights.transpose(-2, -1), offs=torch.cumsum(padded, 0).to(torch.int32))
    return out.index_select(0, place)


def autocast_dtype(rows: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes products in on the rows' device, or the rows' own outside it."""
    device = rows.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU feed-forwards, their weights stacked (expert, out, in): one grouped
    GEMM computes every expert's rows. FSDP2 shards the stacks along the experts; or, with
    expert parallelism (``workers.parallelize.split_experts``), each rank of the
    ``dispatch_group`` holds its own experts whole and the rows travel to them by all-to-all."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.dispatch_group = None  # the ranks the experts are split over; None: all here

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's SwiGLU over its rows: ``rows`` sorted by expert, ``counts`` per expert
        (of every expert, wherever it is held)."""
        if self.dispatch_group is None:
            # Autocast (a group of one rank) does not cover the grouped GEMM, whose CUDA kernel
            # takes bf16 alone: the rows (fp32 from the norm) and the weights go to autocast's
            # dtype here, as autocast would take a matmul's.
            dtype = autocast_dtype(rows)
            return self._swiglu(rows.to(dtype), counts, *(weight.to(dtype) for weight in (self.w1, self.w2, self.w3)))
        return self._dispatched(rows, counts)

    def _swiglu(self, rows, counts, w1, w2, w3) -> torch.Tensor:
        align = GROUP_ROWS_CUDA if rows.is_cuda else 1
        hidden = F.silu(grouped_mm(rows, w1, counts, align)) * grouped_mm(rows, w3, counts, align)
        return grouped_mm(hidden, w2, counts, align)

    def _dispatched(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows to the ranks holding their experts and back: every rank sends each peer the
        rows of the peer's experts (uneven splits), computes the rows it received with its own
        experts, and returns each its results in the order it sent them."""
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        group = self.dispatch_group
        ranks = dist.get_world_size(group)
        # this rank's experts, in the rows' precision (FSDP2 casts the weights it holds; not these)
        own = [(weight.to_local() if isinstance(weight, DTensor) else weight).to(rows.dtype)
               for weight in (self.w1, self.w2, self.w3)]
        local = own[0].shape[0]
        # what each peer sends each of this rank's experts (by peer, then expert)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        sent_splits = counts.view(ranks, local).sum(1).tolist()
        received_splits = received.view(ranks, local).sum(1).tolist()
        arrived = all_to_all_single_autograd(rows, received_splits, sent_splits, group)
        # by this rank's expert, the peers' rows of each in peer order
        expert_of_row = torch.arange(local, device=rows.device).repeat(ranks).repeat_interleave(received)
        by_expert = expert_of_row.argsort(stable=True)
        computed = self._swiglu(arrived[by_expert], received.view(ranks, local).sum(0), *own)
        returned = torch.empty_like(computed).index_copy(0, by_expert, computed)
        return all_to_all_single_autograd(returned, sent_splits, received_splits, group)


class MoE(nn.Module):
    """Token-choice top-k routing: each token goes to the ``experts_per_token`` experts of the
    router's highest scores (a softmax over the experts, as Qwen3-MoE and Mixtral; or each
    expert's sigmoid, as DeepSeek-V3), and their outputs are summed weighted by those scores,
    normalised to sum to one (unless ``normalize_top_k`` is off). The shared experts, one
    SwiGLU of their summed width, add theirs for every token.

    Dropless: every token reaches each of its experts whatever the others chose, so a token's
    output depends on nothing else in the batch, and the result is the same however the batch
    is split over groups, ranks and micro-batches.

    With ``expert_bias_rate``, a bias per expert is added to the scores that choose the
    experts (not to the weights of their outputs): DeepSeek-V3's auxiliary-loss-free load
    balancing. It is a parameter that takes no gradient, so that whatever carries the
    parameters (the heal, the memory tier, the integrity check, checkpoints) carries it; it
    changes only through ``balance_experts``, when a step commits."""

    def __init__(self, args: ModelShape, layer: int):
        super().__init__()
        hidden = args.expert_width
        self.layer = layer  # its number in the whole model, which the step records name its load by
        self.top_k, self.scores, self.normalize_top_k = args.experts_per_token, args.router_scores, args.normalize_top_k
        self.router = nn.Linear(args.dim, args.experts, bias=False)
        self.experts = GroupedExperts(args.dim, hidden, args.experts)
        self.shared = FeedForward(args.dim, hidden * args.shared_experts) if args.shared_experts else None
        self.bias_rate = args.expert_bias_rate
        self.expert_bias = nn.Parameter(torch.zeros(args.experts), requires_grad=False) if self.bias_rate else None
        self.aux_loss_weight = args.aux_loss_weight
        # The tokens the counted rows routed to each expert: the last micro-batch's, set by its
        # forward (a recomputation in backward sets the same), and the step's, added up from
        # them (``add_micro_batch``).
        self.register_buffer("micro_batch_routed", torch.zeros(args.experts), persistent=False)
        self.register_buffer("step_routed", torch.zeros(args.experts), persistent=False)
        # Each row's share of the step's loss, (batch,) or one for them all (``set_row_shares``):
        # the rows that count toward the load, and the weight of each one's balance loss. None
        # (the model called outside a step): every row counts, and no balance loss is added.
        self.row_shares: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens).float()
        scores = logits.softmax(-1) if self.scores == "softmax" else logits.sigmoid()
        if self.expert_bias is None:
            weights, chosen = scores.topk(self.top_k, dim=-1)
        else:
            chosen = (scores + self.expert_bias.float()).topk(self.top_k, dim=-1).indices
            weights = scores.gather(-1, chosen)
        if torch.is_grad_enabled():  # a training step's forward, not an evaluation's
            self._count_routed(chosen, x.shape[0])
        if self.normalize_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        # Each (token, choice) a row, sorted by expert: the experts' groups of rows.
        by_expert = chosen.flatten().argsort(stable=True)
        token_of_row = by_expert // self.top_k
        counts = torch.bincount(chosen.flatten(), minlength=self.router.out_features)
        rows = self.experts(tokens[token_of_row], counts) * weights.flatten()[by_expert, None].to(tokens.dtype)
        out = torch.zeros_like(tokens).index_add(0, token_of_row, rows)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.aux_loss_weight and self.row_shares is not None and torch.is_grad_enabled():
            out = AddAuxiliaryLoss.apply(out, self._balance_loss(scores, chosen, x.shape[0]))
        return out.view_as(x)

    def _balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor, batch: int) -> torch.Tensor:
        """DeepSeek-V3's sequence-wise balance loss, ``aux_loss_weight * sum_i f_i P_i`` per
        row: ``f_i`` its tokens' share routed to expert ``i`` (``experts / top_k`` when even),
        ``P_i`` its tokens' mean normalised score of ``i``. Each row's weighted by its share of
        the step's loss, so the sum over a step's micro-batches is the same at any layout."""
        experts = scores.shape[-1]
        per_row = scores.view(batch, -1, experts)
        probabilities = (per_row / per_row.sum(-1, keepdim=True)).mean(1)
        routed = chosen.view(batch, -1)  # each row's tokens' choices
        ones = torch.ones_like(routed, dtype=probabilities.dtype)
        load = torch.zeros_like(probabilities).scatter_add_(1, routed, ones) * experts / routed.shape[1]
        shares = self.row_shares.to(scores.device, torch.float32).expand(batch)
        return self.aux_loss_weight * ((load * probabilities).sum(-1) * shares).sum()

    @torch.compiler.disable  # a buffer written outside the graph: compiled blocks break here anyway
    def _count_routed(self, chosen: torch.Tensor, batch: int) -> None:
        rows = self.row_shares
        if rows is not None:  # padding rows route too, but a single process has none
            chosen = chosen.view(batch, -1)[(rows.to(chosen.device) > 0).expand(batch)]
        with torch.no_grad():
            self.micro_batch_routed.copy_(torch.bincount(chosen.flatten(), minlength=self.micro_batch_routed.numel()))


def expert_layers(model: nn.Module) -> list[MoE]:
    """The model's expert layers, in the model's order: each counts the tokens a step routes
    to its experts (its load, which the step records), and those with a bias balance by it."""
    return [module for module in model.modules() if isinstance(module, MoE)]


class AddAuxiliaryLoss(torch.autograd.Function):
    """``output`` as it is, with ``loss`` in its graph: backward gives ``loss`` a gradient of
    one, so the step's gradient is that of the training loss plus ``loss``, whose value the
    recorded loss leaves out (DeepSeek's own device for its balance losses)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.loss_dtype, device=ctx.loss_device)


def set_row_shares(layers: list[MoE], shares: torch.Tensor | None) -> None:
    """The next micro-batch's rows' shares of the step's loss (None: outside a step)."""
    for layer in layers:
        layer.row_shares = shares


def add_micro_batch(layers: list[MoE], first: bool) -> None:
    """The micro-batch's routed tokens into the step's (``first``: they start them)."""
    with torch.no_grad():
        for layer in layers:
            if first:
                layer.step_routed.copy_(layer.micro_batch_routed)
            else:
                layer.step_routed.add_(layer.micro_batch_routed)


@dataclass(frozen=True)
class RoutedLayout:
    """Where each expert layer's tokens per expert sit in a step's routed counts: the whole
    model's expert layers one after another, by number, whichever of them a rank holds (a
    pipeline stage fills its own layers' places and leaves the others' zero), so every rank's
    counts line up and add up."""

    layers: tuple[int, ...]  # the whole model's expert layers, by number
    experts: int  # each one's

    @classmethod
    def of(cls, args: ModelShape) -> RoutedLayout:
        return cls(tuple(layer for layer in range(args.n_layers) if args.has_experts(layer)), args.experts)

    @classmethod
    def of_held(cls, held: Sequence[MoE]) -> RoutedLayout:
        """A model with no ``ModelArgs`` (a custom one): the expert layers it holds."""
        return cls(tuple(layer.layer for layer in held), held[0].router.out_features if held else 0)

    @property
    def width(self) -> int:
        return len(self.layers) * self.experts

    def routed_tokens(self, held: Sequence[MoE]) -> list[float]:
        """The step's tokens per expert of the ``held`` layers, in their places: laid out where
        the counts are and read to the host once."""
        if not held:
            return [0.0] * self.width
        routed = held[0].step_routed.new_zeros(self.width)
        for layer in held:
            at = self.layers.index(layer.layer) * self.experts
            routed[at:at + self.experts] = layer.step_routed
        return routed.tolist()

    def per_layer(self, routed: Sequence[float]) -> dict[int, torch.Tensor]:
        """``routed``, as ``routed_tokens`` lays it out, cut into each layer's tokens per expert."""
        return dict(zip(self.layers, torch.tensor(routed, dtype=torch.float64).split(self.experts)))


def expert_load(layout: RoutedLayout, routed: Sequence[float]) -> dict[int, float]:
    """Each expert layer's load balance, by its number: its most loaded expert's tokens over
    the mean (1.0: even)."""
    return {layer: round((tokens.max() / tokens.mean()).item(), 4) if tokens.sum() else 1.0
            for layer, tokens in layout.per_layer(routed).items()}


def balance_experts(held: Sequence[MoE], layout: RoutedLayout, routed: Sequence[float]) -> None:
    """DeepSeek-V3's update, at a step's commit: each held layer's bias rises by its rate for
    an expert that got fewer tokens than the layer's mean and falls for one that got more.
    ``routed``: the step's tokens per expert of every layer (``layout``), summed over every
    rank and every group (exact integers), so every replica moves its bias the same."""
    by_layer = layout.per_layer(routed)
    with torch.no_grad():
        for layer in held:
            bias = layer.expert_bias
            if bias is None:
                continue
            tokens = by_layer[layer.layer]
            step = (layer.bias_rate * torch.sign(tokens.mean() - tokens)).to(bias.device, bias.dtype)
            if isinstance(bias, DTensor):  # FSDP2's shard of it: this rank's part of the step
                step = distribute_tensor(step, bias.device_mesh, bias.placements, src_data_rank=None)
            bias.add_(step)

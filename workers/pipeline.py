"""Pipeline stages inside a replica group: the model split into stages by layer, and the
schedule from ``torch.distributed.pipelining`` that runs a step's micro-batches through them.

A group of ``pp x shard x tp`` ranks holds ``pp x stages_per_rank`` stages; the rank at pipeline
index ``i`` holds stage ``i`` (and ``i + pp``, ``i + 2 pp``... under an interleaved schedule).
Each stage is a pruned copy of the whole model that keeps its parameters' fully qualified
names (``layers.5.attention.wq.weight`` is that name at any ``pp``), so a checkpoint is the
same set of names at every layout and DCP reshards it across a change of ``pp``. FSDP2 and TP
apply inside each stage, as to a whole model (``workers.parallelize``).

The step's micro-batches are the pipeline's: every rank of a stage computes the same
micro-batches of its shard position, all of one size and, so that every schedule accepts
them whatever share of the batch its group got, a multiple of ``pp`` of them (the missing
rows and micro-batches are padding, weighed zero). The loss comes from the last stage.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from elastic.core.data_plan import PADDING_INDEX, MicroBatches
from elastic.core.topology import SINGLE_STAGE_SCHEDULES
from workers.experts import add_micro_batch, expert_layers, set_row_shares
from workers.model import Transformer
from workers.train_step import Batch, LossFn, reshard, weighted_loss

# torch.distributed.pipelining's schedule classes by ``scaling.pp_schedule``: one stage per
# rank, or several (looped over the ranks: stage i on rank i mod pp).
SCHEDULES = {
    "GPipe": "ScheduleGPipe",
    "1F1B": "Schedule1F1B",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
}

# A custom model's split: the module of ``stage`` of ``n_stages``, cut from the whole model
# (which it may change: it is a copy where the rank holds several stages).
SplitFn = Callable[[nn.Module, int, int], nn.Module]


@dataclass(frozen=True)
class PipelineLayout:
    """A group's pipeline: ``pp`` ranks along it, ``stages_per_rank`` stages on each, and the
    rows of every micro-batch through it (the run's ``micro_batch``)."""

    pp: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    micro_batch: int = 1

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stages_of(self, pp_index: int) -> list[int]:
        """The stages the rank at ``pp_index`` holds."""
        return [pp_index + loop * self.pp for loop in range(self.stages_per_rank)]


def layers_of_stage(n_layers: int, stage: int, n_stages: int) -> range:
    """The layers of ``stage``: consecutive, as even a split as the count allows."""
    return range(stage * n_layers // n_stages, (stage + 1) * n_layers // n_stages)


def split_transformer(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """``model`` cut down to ``stage`` of ``n_stages``, in place: its layers, the embedding
    on the first stage, the final norm and the output head on the last."""
    keep = {str(layer) for layer in layers_of_stage(model.args.n_layers, stage, n_stages)}
    for name in [name for name in model.layers if name not in keep]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < n_stages - 1:
        model.norm = None
        model.output = None
    return model


class StagesOfRank(nn.Module):
    """The stages one rank holds, as one module whose parameters keep the whole model's names:
    what the optimizer, the checkpoint, the heal and the memory tier see of the rank. Its
    children are the stages' own modules (containers merged), so nothing is copied. Only
    the stages run forward, through the schedule."""

    def __init__(self, stages: Sequence[nn.Module]):
        super().__init__()
        for stage in stages:
            if any("." not in name for name in stage.state_dict()):
                raise ValueError(f"{type(stage).__name__}: a stage holding state of its own at its root cannot share "
                                 "one rank with another stage; give it to a submodule")
            for name, child in stage.named_children():
                mine = self._modules.get(name)
                if child is None or (mine is not None and next(child.parameters(), None) is None):
                    continue  # not in this stage, or stateless (dropout): each stage runs its own
                if not isinstance(child, (nn.ModuleDict, nn.ModuleList)):
                    if mine is not None:
                        raise ValueError(f"stages on one rank both hold {name!r}: split the model so that each "
                                         "module belongs to one stage")
                    self.register_module(name, child)
                    continue
                if mine is None:
                    mine = type(child)()
                    self.register_module(name, mine)
                for key, grandchild in child.named_children():
                    mine.register_module(key, grandchild)

    def forward(self, *args):
        raise RuntimeError("a rank's stages run through the pipeline schedule, not as one module")


def cut_stages(model: nn.Module, split_fn: SplitFn, stages: Sequence[int], n_stages: int) -> list[nn.Module]:
    """The modules of ``stages``, each cut from the whole ``model`` (a copy of it where there
    are several, so the same initial weights land in every stage)."""
    if len(stages) == 1:
        return [split_fn(model, stages[0], n_stages)]
    return [split_fn(copy.deepcopy(model), stage, n_stages) for stage in stages]


def pipeline_micro_batches(micro_batches: MicroBatches, layout: PipelineLayout) -> MicroBatches:
    """``micro_batches`` padded for the pipeline: each ``micro_batch`` rows (the stages pass
    activations of one shape), and a multiple of ``pp`` of them (every schedule torch
    offers accepts that count)."""
    if layout.pp == 1:
        return micro_batches
    size = layout.micro_batch
    rows = [tuple(chunk) + (PADDING_INDEX,) * (size - len(chunk)) for chunk in micro_batches]
    return tuple(rows) + ((PADDING_INDEX,) * size,) * (-len(rows) % layout.pp)


def stage_model(model: nn.Module, split_fn: SplitFn | None, parallelize_fn, layout: PipelineLayout, pp_index: int,
                mesh) -> tuple[nn.Module, list[nn.Module]]:
    """The rank's part of ``model``, parallelized on the group's ``mesh``: the module that
    holds its parameters (its stages as one), and its stage modules (none without a pipeline)."""
    if layout.pp == 1:
        return parallelize_fn(model, mesh) or model, []
    cut = cut_stages(model, split_fn, layout.stages_of(pp_index), layout.n_stages)
    stages = [parallelize_fn(module, mesh) or module for module in cut]
    return (stages[0] if len(stages) == 1 else StagesOfRank(stages)), stages


def _packed_targets(batches: Sequence[Batch]) -> torch.Tensor:
    """Targets and their weights in one integer tensor: the schedule splits one target
    tensor into micro-batches (weights are 0 or 1, so the packing is exact)."""
    return torch.cat([torch.stack([batch.targets, batch.weights.to(batch.targets.dtype)], dim=-1)
                      for batch in batches])


class ChunkWatcher(Protocol):
    def chunk_started(self) -> None: ...
    def chunk_ended(self) -> None: ...


# What a stage computes, one micro-batch at a time; the schedule waits on its neighbours
# between these calls.
CHUNK_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def _around_chunks(stage, around: Callable[[str, Callable], Callable]) -> None:
    """Each of ``stage``'s chunk methods replaced by ``around(name, method)``."""
    for name in CHUNK_METHODS:
        method = getattr(stage, name, None)
        if method is not None:
            setattr(stage, name, around(name, method))


def _watch_chunks(stage, activity: ChunkWatcher) -> None:
    """Tell ``activity`` when ``stage`` computes and when it waits: a rank stuck computing
    is told apart from the stages that wait for it (``elastic.core.diagnosis``)."""
    def watched(name: str, method: Callable) -> Callable:
        def watching(*args, **kwargs):
            activity.chunk_started()
            try:
                return method(*args, **kwargs)
            finally:
                activity.chunk_ended()

        return watching

    _around_chunks(stage, watched)


def _route_chunks(stage, shares: list) -> None:
    """Each chunk ``stage`` computes with its micro-batch's rows' shares of the loss set in
    its expert layers (the weights of their balance losses, the rows their load counts), in
    forward and in backward (which may compute the forward again); after a training
    forward, the chunk's routed tokens added to the step's. ``shares``: the step's, by
    micro-batch, filled by ``Pipeline._run``."""
    experts = expert_layers(stage.submod)
    if not experts:
        return

    def with_shares(name: str, method: Callable) -> Callable:
        def routed(chunk: int, *args, **kwargs):
            set_row_shares(experts, shares[chunk])
            try:
                return method(chunk, *args, **kwargs)
            finally:
                set_row_shares(experts, None)
                if name == "forward_one_chunk" and torch.is_grad_enabled():
                    add_micro_batch(experts, first=chunk == 0)

        return routed

    _around_chunks(stage, with_shares)


class Pipeline:
    """The stages of one rank and the schedule that runs a step's micro-batches over them."""

    def __init__(self, layout: PipelineLayout, pp_index: int, modules: Sequence[nn.Module], pp_group,
                 device: torch.device, loss_fn: LossFn, activity: ChunkWatcher | None = None):
        # Imported here, by ranks that hold stages: torch.distributed.pipelining imports
        # dynamo, 0.3 s of the 2.4 s a rank's start-up spends on imports.
        from torch.distributed import pipelining

        self.layout = layout
        self.schedule_class = getattr(pipelining, SCHEDULES[layout.schedule])
        self.stages = [pipelining.PipelineStage(module, stage, layout.n_stages, device, group=pp_group)
                       for module, stage in zip(modules, layout.stages_of(pp_index))]
        self.activity = activity
        self._row_shares: list[torch.Tensor] = []  # the step's micro-batches', for the expert layers
        for stage in self.stages:
            _route_chunks(stage, self._row_shares)
            if activity is not None:
                _watch_chunks(stage, activity)
        self.holds_last_stage = any(stage.is_last for stage in self.stages)
        self.loss_fn = loss_fn
        self._global_tokens = 1
        self._loss_scale = 1.0  # fp16's, for the step's backward: the schedule runs it
        # One at a time: a schedule sizes its stages' buffers for its micro-batch count.
        self._schedule, self._schedule_size = None, 0

    def _loss(self, logits: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        targets, weights = packed.unbind(-1)
        return weighted_loss(self.loss_fn, logits, targets, weights.float(), self._global_tokens) * self._loss_scale

    def _schedule_for(self, micro_batches: int):
        if self._schedule_size != micro_batches:
            stages = self.stages[0] if self.layout.schedule in SINGLE_STAGE_SCHEDULES else self.stages
            # Summed, never averaged: each micro-batch's loss is already its share of the global one.
            self._schedule = self.schedule_class(stages, micro_batches, loss_fn=self._loss, scale_grads=False)
            self._schedule_size = micro_batches
        return self._schedule

    def loss_share(self, batches: Sequence[Batch], global_tokens: int, loss_scale: float = 1.0) -> float:
        """Forward and backward of ``batches`` through the pipeline; this rank's share of the
        loss: the micro-batches' summed shares on the last stage, 0 elsewhere. ``loss_scale``
        multiplies the loss the schedule's backward starts from (fp16's), not the share."""
        self._loss_scale = loss_scale
        try:
            return self._run(batches, global_tokens, backward=True) / loss_scale
        finally:
            self._loss_scale = 1.0

    def held_out_loss_share(self, batches: Sequence[Batch], global_tokens: int) -> float:
        """This rank's share of the held-out loss, forward only, with every stage in eval mode
        (no dropout)."""
        for stage in self.stages:
            stage.submod.eval()
        try:
            with torch.no_grad():
                return self._run(batches, global_tokens, backward=False)
        finally:
            for stage in self.stages:
                stage.submod.train()
                reshard(stage.submod)

    def _run(self, batches: Sequence[Batch], global_tokens: int, backward: bool) -> float:
        self._global_tokens = global_tokens
        self._row_shares[:] = [batch.row_shares(global_tokens) for batch in batches]
        schedule = self._schedule_for(len(batches))
        inputs, targets = torch.cat([batch.inputs for batch in batches]), _packed_targets(batches)
        losses: list[torch.Tensor] = []
        if self.activity is not None:
            # A stage waits for its first input before its first chunk: waiting, not computing.
            self.activity.chunk_ended()
        if backward:
            schedule.step(inputs, target=targets, losses=losses, return_outputs=False)
        else:
            schedule.eval(inputs, target=targets, losses=losses)
        if not self.holds_last_stage:
            return 0.0
        return torch.stack([loss.detach().float() for loss in losses]).sum().item()

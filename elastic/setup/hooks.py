"""The user's hooks, each optional, and their defaults: the reference model, corpus and AdamW.

``resolve_hooks`` fills in the defaults from a config; ``check_hooks`` tries a sample and, for
tensor parallelism, the model on the meta device, before any actor starts.
"""

from __future__ import annotations

import importlib.util

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import default_collate

from elastic.data.mixture import at_epoch
from elastic.setup.config import TrainConfig
from elastic.setup.dataset import default_datasets
from elastic.setup.errors import ConfigError
from workers.model import ModelArgs, Transformer
from workers.parallelize import Parallelize
from workers.pipeline import SplitFn, split_transformer
from workers.train_step import (IGNORE_INDEX, Batch, BatchLossFn, MicroBatchLoss, SampleLoss, TokenLoss, collate,
                                sample_ids, token_cross_entropy)


INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


@dataclass(frozen=True)
class ReferenceModel:
    args: ModelArgs

    def __call__(self) -> nn.Module:
        return Transformer(self.args)


@dataclass(frozen=True)
class AdamW:
    lr: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float

    def __call__(self, params) -> torch.optim.Optimizer:
        params = list(params)
        # One fused kernel per step on CUDA instead of a loop of small ones.
        fused = all(param.is_cuda for param in params)
        return torch.optim.AdamW(
            params, lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps, fused=fused or None
        )


@dataclass(frozen=True)
class TrainHooks:
    model_fn: Callable[[], nn.Module]
    parallelize_fn: Callable[[nn.Module, Any], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    dataset: Any
    optimizer_fn: Callable[[Any], torch.optim.Optimizer]
    eval_dataset: Any = None  # held out for evaluation; None: the run has none
    # the module of pipeline stage ``stage`` of ``n_stages``, cut from the whole model; None:
    # the model cannot be split (scaling.pp = 1 only)
    split_fn: SplitFn | None = None
    # Any model, any loss: batch_loss_fn(model, batch) -> (loss_sum, count) over what
    # collate_fn made of a micro-batch's samples, in place of loss_fn's next-token form
    batch_loss_fn: BatchLossFn | None = None
    collate_fn: Callable[[list], Any] | None = None

    @property
    def micro_loss(self) -> MicroBatchLoss:
        return SampleLoss(self.batch_loss_fn) if self.batch_loss_fn is not None else TokenLoss(self.loss_fn)

    def micro_batch(self, indices, device: torch.device, held_out: bool = False, epoch: int = 0) -> Batch:
        """The micro-batch of these samples of the training data in ``epoch`` (or of the held-out data)."""
        return collate(self.eval_dataset if held_out else at_epoch(self.dataset, epoch), indices, device,
                       self.collate_fn)


def model_args(config: TrainConfig) -> ModelArgs:
    """The reference model's arguments: the config's model shape, RoPE computed for ``data.seq_len``."""
    return ModelArgs.of_shape(config.model.shape, max_seq_len=config.data.seq_len)


def default_parallelize(config: TrainConfig, tp_plan=None) -> Parallelize:
    compute = config.compute
    return Parallelize(
        precision=compute.precision,
        activation_checkpointing=compute.activation_checkpointing,
        selective=compute.selective_checkpointing,
        compile=compute.compile,
        sequence_parallel=config.sequence_parallel,
        tp_plan=tp_plan,
        float8=compute.float8,
        reshard_after_forward=config.scaling.reshards_after_forward,
        offload=compute.offload,
    )


def resolve_hooks(
    config: TrainConfig,
    model_fn=None,
    parallelize_fn=None,
    loss_fn=None,
    dataset=None,
    eval_dataset=None,
    optimizer_fn=None,
    tp_plan=None,
    split_fn=None,
    batch_loss_fn=None,
    collate_fn=None,
) -> TrainHooks:
    """The given hooks, defaults for the rest. A given ``dataset`` comes with its own
    ``eval_dataset`` (or none); otherwise both are made from ``config.data``, unless an
    ``eval_dataset`` is given."""
    optimizer = config.optimizer
    if dataset is None:
        # the reference model's vocabulary bounds the ids; a custom model's is its own
        dataset, default_eval = default_datasets(config, config.model.vocab_size if model_fn is None else None)
        eval_dataset = default_eval if eval_dataset is None else eval_dataset
    return TrainHooks(
        model_fn=model_fn or ReferenceModel(model_args(config)),
        parallelize_fn=parallelize_fn or default_parallelize(config, tp_plan),
        loss_fn=loss_fn or token_cross_entropy,
        dataset=dataset,
        optimizer_fn=optimizer_fn
        or AdamW(optimizer.lr, optimizer.weight_decay, (optimizer.beta1, optimizer.beta2), optimizer.eps),
        eval_dataset=eval_dataset,
        split_fn=split_fn or (split_transformer if model_fn is None else None),
        batch_loss_fn=batch_loss_fn,
        collate_fn=collate_fn or (default_collate if batch_loss_fn is not None else None),
    )


def check_batch_loss(config: TrainConfig, hooks: TrainHooks) -> None:
    """A ``batch_loss_fn`` run once on sample 0, model and batch on the meta device (no memory,
    no compute): it must return (loss_sum, count), the loss a floating-point scalar. An op the
    meta device cannot run leaves the check to the ranks."""
    if config.scaling.pp > 1:
        raise ConfigError(f"scaling.pp = {config.scaling.pp}: a batch_loss_fn trains without pipeline stages (their "
                          "schedule computes the next-token form); set scaling.pp = 1")
    if config.scaling.cp > 1:
        raise ConfigError(f"scaling.cp = {config.scaling.cp}: a batch_loss_fn's batches are its own, which context "
                          "parallelism cannot cut into chunks of sequences; set scaling.cp = 1")
    batch = hooks.micro_batch([0], torch.device("meta"))
    with torch.device("meta"):
        model = hooks.model_fn()
    try:
        result = hooks.batch_loss_fn(model, batch.inputs)
    except (NotImplementedError, RuntimeError) as error:
        if isinstance(error, NotImplementedError) or "meta" in str(error):
            return
        raise
    loss_sum = result[0] if isinstance(result, tuple) and len(result) == 2 else None
    if not (isinstance(loss_sum, torch.Tensor) and loss_sum.dim() == 0 and loss_sum.is_floating_point()):
        if loss_sum is None:
            described = f"a tuple of {len(result)}" if isinstance(result, tuple) else f"a {type(result).__name__}"
        elif isinstance(loss_sum, torch.Tensor):
            described = f"a loss of shape {tuple(loss_sum.shape)} and dtype {loss_sum.dtype}"
        else:
            described = f"a loss of type {type(loss_sum).__name__}"
        raise ConfigError(f"batch_loss_fn: on sample 0 it returned {described}; return (loss_sum, count): the "
                          "batch's summed loss as a floating-point scalar tensor, and how many things it summed over")


def check_optimizer(hooks: TrainHooks) -> None:
    """A custom ``optimizer_fn`` run once over the model's parameters on the meta device: it
    must return an optimizer (one returning None failed every rank's build, and the run spent
    its recoveries on it). A model the meta device cannot build leaves the check to the ranks."""
    if isinstance(hooks.optimizer_fn, AdamW):
        return
    try:
        with torch.device("meta"):
            model = hooks.model_fn()
    except (NotImplementedError, RuntimeError):
        return
    optimizer = hooks.optimizer_fn(model.parameters())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer_fn: returned {type(optimizer).__name__}, not an optimizer; return a "
                          "torch.optim.Optimizer over the parameters it is given")


SAMPLE_FORMS = ("each sample must be a 1-D integer tensor of data.seq_len + 1 = {n} token ids (inputs and the "
                "next-token targets), or a dict with input_ids of that shape and optional labels beside them "
                "({ignore} where no loss is taken)")


def check_sample(sample, seq_len: int, vocab_size: int | None) -> None:
    """``sample`` as the ranks read it, or a ``ConfigError`` naming what is wrong with it."""
    forms = SAMPLE_FORMS.format(n=seq_len + 1, ignore=IGNORE_INDEX)
    if isinstance(sample, Mapping) and "input_ids" not in sample:
        raise ConfigError(f"dataset: sample 0 is a dict with keys {sorted(sample)} and no input_ids; {forms}")
    try:
        ids, labels = sample_ids(sample)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(f"dataset: sample 0 cannot be read as token ids ({error}); {forms}") from None
    for name, tensor in (("input_ids", ids), ("labels", labels)):
        if not (isinstance(tensor, torch.Tensor) and tensor.dtype in INTEGER_DTYPES and tensor.shape == (seq_len + 1,)):
            described = (f"a tensor of dtype {tensor.dtype} and shape {tuple(tensor.shape)}"
                         if isinstance(tensor, torch.Tensor) else f"a {type(tensor).__name__}")
            where = "sample 0" if tensor is sample else f"sample 0's {name}"
            raise ConfigError(f"dataset: {where} is {described}; {forms}")
    targets = labels[labels != IGNORE_INDEX]
    for name, tensor in (("token id", ids), ("label", targets)):
        if tensor.numel() and tensor.min() < 0:
            raise ConfigError(f"dataset: sample 0 has a negative {name} ({tensor.min().item()}); {forms}")
        if vocab_size is not None and tensor.numel() and tensor.max() >= vocab_size:
            raise ConfigError(f"dataset: sample 0 has {name} {tensor.max().item()}, outside the model's vocabulary "
                              f"of {vocab_size}: raise model.vocab_size or re-tokenize")


def check_hooks(config: TrainConfig, hooks: TrainHooks) -> None:
    """What the ranks would fail on, found on the driver before any actor starts: a first
    sample that is not ``seq_len + 1`` integer token ids (or a dict of them), ids outside the
    reference model's vocabulary, ``scaling.tp > 1`` for a custom model with no
    tensor-parallel plan and ``scaling.cp > 1`` for one without the reference attention (its
    model is built on the meta device to tell),
    ``model.init_from`` with a custom model, ``compute.float8`` without torchao, and
    ``data.document_masking`` with any model but the reference one."""
    if config.data.document_masking and (hooks.batch_loss_fn is not None or not isinstance(hooks.model_fn,
                                                                                           ReferenceModel)):
        raise ConfigError("data.document_masking: only the reference model takes the documents' positions; unset it "
                          "for a custom model_fn or batch_loss_fn")
    if hooks.batch_loss_fn is not None:
        check_batch_loss(config, hooks)
    else:
        check_sample(hooks.dataset[0], config.data.seq_len,
                     hooks.model_fn.args.vocab_size if isinstance(hooks.model_fn, ReferenceModel) else None)
    check_optimizer(hooks)
    parallelize = hooks.parallelize_fn
    default = isinstance(parallelize, Parallelize)
    needs_plan = config.scaling.tp > 1 and default and parallelize.tp_plan is None  # the default, no tp_plan
    splits_sequences = config.scaling.cp > 1 and default
    if (needs_plan or splits_sequences) and not isinstance(hooks.model_fn, ReferenceModel):
        with torch.device("meta"):
            model = hooks.model_fn()
        if not isinstance(model, Transformer):
            if needs_plan:
                raise ConfigError(f"scaling.tp = {config.scaling.tp} needs a tensor-parallel plan for "
                                  f"{type(model).__name__}: pass tp_plan(model, tp_mesh) (or parallelize_fn), or set "
                                  "scaling.tp = 1")
            raise ConfigError(f"scaling.cp = {config.scaling.cp} needs the reference model, whose attention gathers "
                              f"the sequence's keys and values; {type(model).__name__} has none: set scaling.cp = 1")
    if config.compute.float8 and importlib.util.find_spec("torchao") is None:
        raise ConfigError("compute.float8 trains through torchao, which is not installed: pip install "
                          "'elastic-trainer[float8]', or set compute.float8 = false")
    if config.model.init_from and not isinstance(hooks.model_fn, ReferenceModel):
        raise ConfigError(f"model.init_from = {config.model.init_from} loads Llama weights into the reference model; a "
                          "custom model_fn loads its own (read them in model_fn), or leave model.init_from out")
    if config.scaling.pp > 1 and hooks.split_fn is None:
        raise ConfigError(f"scaling.pp = {config.scaling.pp} needs the model split into stages: pass "
                          "split_fn(model, stage, n_stages) returning the stage's module (keeping its parameters' "
                          "names), or set scaling.pp = 1")

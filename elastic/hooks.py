"""User hooks, each optional, and their defaults: the reference model, corpus and AdamW."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elastic.config import TrainConfig
from elastic.dataset import default_datasets
from elastic.errors import ConfigError
from workers.model import ModelArgs, Transformer
from workers.parallelize import Parallelize
from workers.train_step import token_cross_entropy


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


def model_args(config: TrainConfig) -> ModelArgs:
    model = config.model
    return ModelArgs(
        vocab_size=model.vocab_size,
        dim=model.dim,
        n_layers=model.n_layers,
        n_heads=model.n_heads,
        n_kv_heads=model.kv_heads,
        ffn_hidden=model.ffn_hidden,
        max_seq_len=config.data.seq_len,
        tie_embeddings=model.tie_embeddings,
        dropout=model.dropout,
    )


def default_parallelize(config: TrainConfig, tp_plan=None) -> Parallelize:
    compute = config.compute
    return Parallelize(
        precision=compute.precision,
        activation_checkpointing=compute.activation_checkpointing == "full",
        compile=compute.compile,
        tp_plan=tp_plan,
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
    )


def check_hooks(config: TrainConfig, hooks: TrainHooks) -> None:
    """What the ranks would fail on, found on the driver before any actor starts: a first
    sample that is not ``seq_len + 1`` integer token ids, and ``scaling.tp > 1`` for a custom
    model with no tensor-parallel plan (its model is built on the meta device to tell)."""
    seq_len = config.data.seq_len
    sample = hooks.dataset[0]
    if not (isinstance(sample, torch.Tensor) and sample.dtype in INTEGER_DTYPES and sample.shape == (seq_len + 1,)):
        described = (f"a tensor of dtype {sample.dtype} and shape {tuple(sample.shape)}"
                     if isinstance(sample, torch.Tensor) else f"a {type(sample).__name__}")
        raise ConfigError(f"dataset: sample 0 is {described}; each sample must be a 1-D integer tensor of "
                          f"data.seq_len + 1 = {seq_len + 1} token ids (inputs and the next-token targets)")
    parallelize = hooks.parallelize_fn
    planless = isinstance(parallelize, Parallelize) and parallelize.tp_plan is None  # the default, no tp_plan
    if config.scaling.tp > 1 and planless and not isinstance(hooks.model_fn, ReferenceModel):
        with torch.device("meta"):
            model = hooks.model_fn()
        if not isinstance(model, Transformer):
            raise ConfigError(f"scaling.tp = {config.scaling.tp} needs a tensor-parallel plan for "
                              f"{type(model).__name__}: pass tp_plan(model, tp_mesh) (or parallelize_fn), or set "
                              "scaling.tp = 1")

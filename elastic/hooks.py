"""User hooks, each optional, and their defaults: the reference model, corpus and AdamW."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elastic.config import TrainConfig
from elastic.dataset import default_datasets
from workers.model import ModelArgs, Transformer
from workers.parallelize import Parallelize
from workers.train_step import token_cross_entropy


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


def default_parallelize(config: TrainConfig) -> Parallelize:
    compute = config.compute
    return Parallelize(
        precision=compute.precision,
        activation_checkpointing=compute.activation_checkpointing == "full",
        compile=compute.compile,
    )


def resolve_hooks(
    config: TrainConfig,
    model_fn=None,
    parallelize_fn=None,
    loss_fn=None,
    dataset=None,
    eval_dataset=None,
    optimizer_fn=None,
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
        parallelize_fn=parallelize_fn or default_parallelize(config),
        loss_fn=loss_fn or token_cross_entropy,
        dataset=dataset,
        optimizer_fn=optimizer_fn
        or AdamW(optimizer.lr, optimizer.weight_decay, (optimizer.beta1, optimizer.beta2), optimizer.eps),
        eval_dataset=eval_dataset,
    )

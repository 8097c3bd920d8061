"""The reference model at a real step time: each forward waits, as a host thread waits on a
GPU, so steps take seconds while the CPU stays free. The math is the reference model's."""

from __future__ import annotations

import time
from dataclasses import dataclass

from elastic.setup.config import TrainConfig
from elastic.setup.hooks import model_args
from workers.model import ModelArgs, Transformer


class PacedTransformer(Transformer):
    def __init__(self, args: ModelArgs, forward_s: float):
        super().__init__(args)
        self.forward_s = forward_s

    def forward(self, tokens):
        time.sleep(self.forward_s)
        return super().forward(tokens)


@dataclass(frozen=True)
class PacedModel:
    args: ModelArgs
    forward_s: float

    def __call__(self) -> PacedTransformer:
        return PacedTransformer(self.args, self.forward_s)


def paced_model(config: TrainConfig, step_s: float) -> PacedModel:
    """A model_fn whose steps take about ``step_s`` on every rank of ``config``'s layout."""
    scaling = config.scaling
    samples_per_rank = config.global_batch // (scaling.max_groups * scaling.shard)
    micro_batches = -(-samples_per_rank // config.micro_batch)
    return PacedModel(model_args(config), step_s / micro_batches)

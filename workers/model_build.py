"""A rank's model with its first weights: the seed's, or pretrained ones.

From the seed, every rank builds the whole model from the same generator and keeps its
shards: the initial state is the same at any layout. From pretrained weights the model is
built on the meta device, split and sharded there, then each rank allocates only its shards
and reads their slices (``checkpointing.pretrained``): no rank ever holds the whole model,
so a rank's memory grows with its shards, not with the checkpoint (``bench/pretrained_memory.py``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from workers.model import Transformer

# The model split into the rank's stages and parallelized: the module that holds its
# parameters, and its stage modules (``workers.pipeline.stage_model``).
Place = Callable[[nn.Module], tuple[nn.Module, list[nn.Module]]]


def first_model(model_fn: Callable[[], nn.Module], place: Place, device: torch.device,
                load: Callable[[nn.Module], object] | None = None) -> tuple[nn.Module, list[nn.Module]]:
    """The rank's placed model: from ``model_fn`` on ``device``, or, with ``load`` (which
    fills every parameter), from the meta device, allocated on ``device`` once sharded."""
    if load is None:
        with device:
            return place(model_fn())
    with torch.device("meta"):
        model, stages = place(model_fn())
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, Transformer):
            module.init_buffers()
    load(model)
    return model, stages

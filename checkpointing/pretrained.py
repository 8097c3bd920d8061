"""The weights a run starts from (``model.init_from``): a HuggingFace Llama directory, or a
committed checkpoint of another run of this project (``RUN`` or ``RUN@STEP``: its model's
weights only; the optimizer and the data cursor start fresh). Either way every rank of a
build reads only the slices its shards hold, through DCP: over the safetensors files
(``checkpointing.huggingface``), or over the checkpoint's own files with the same safe
reader a resume uses (``rank_io.SafeReader``: nothing in storage runs code).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from torch import nn

from checkpointing.huggingface import CONFIG_NAME, LlamaLayout, PretrainedReader, llama_names
from checkpointing.storage import StorageOptions

# A run's checkpoint as a source: the run's URL, and the step after an @ (else its newest).
RUN_STEP = re.compile(r"^(?P<run>.+?)(?:@(?P<step>\d+))?$")


@dataclass(frozen=True)
class PretrainedSource:
    location: str  # a HuggingFace directory, or a checkpoint's URL
    layout: LlamaLayout | None  # a HuggingFace directory's name table; None: a checkpoint of this project


def is_huggingface(init_from: str) -> bool:
    return os.path.exists(os.path.join(init_from, CONFIG_NAME))


def run_and_step(init_from: str) -> tuple[str, int | None]:
    match = RUN_STEP.match(init_from)
    return match["run"], int(match["step"]) if match["step"] else None


def load_pretrained(model: nn.Module, source: PretrainedSource | None, options: StorageOptions,
                    process_group) -> int:
    """Overwrite the (sharded) model's parameters with ``source``'s weights; returns the bytes
    this rank read from a HuggingFace directory (nothing without a source)."""
    import torch.distributed.checkpoint as dcp

    if source is None:
        return 0
    if source.layout is None:
        from checkpointing.rank_io import load_weights

        load_weights(model, source.location, options, process_group)
        return 0
    names = llama_names(source.layout)
    state = {name: tensor for name, tensor in model.state_dict().items() if name in names}
    reader = PretrainedReader(source.location, source.layout)
    dcp.load(state, storage_reader=reader, process_group=process_group)
    return reader.bytes_read

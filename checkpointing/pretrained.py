"""The weights a run starts from (``model.init_from``): a HuggingFace Llama directory, or a
committed checkpoint of another run of this project (``RUN`` or ``RUN@STEP``: its model's
weights only; the optimizer and the data cursor start fresh). Either way every rank of a
build reads only the slices its shards hold, through DCP: over the safetensors files
(``checkpointing.huggingface``), or over the checkpoint's own files with the same safe
reader a resume uses (``rank_io.SafeReader``: nothing in storage runs code).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from torch import nn

from checkpointing.huggingface import (
    CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, LlamaLayout, PretrainedReader, llama_names,
)
from checkpointing.catalog import CHECKPOINTS_DIR, step_dir_name
from checkpointing.manifest import MANIFEST_NAME
from checkpointing.storage import StorageOptions, fingerprint, join_url

# A run's checkpoint as a source: the run's URL, and the step after an @ (else its newest).
RUN_STEP = re.compile(r"^(?P<run>.+?)(?:@(?P<step>\d+))?$")


@dataclass(frozen=True)
class PretrainedSource:
    location: str  # a HuggingFace directory, or a checkpoint's URL
    layout: LlamaLayout | None  # a HuggingFace directory's name table; None: a checkpoint of this project


def pretrained_source(model, options: StorageOptions) -> PretrainedSource | None:
    """What a model section's ``init_from`` names (``elastic.setup.config.ModelConfig``; preflight
    resolved a run's to ``RUN@STEP``), with the name table its fields give."""
    if not model.init_from:
        return None
    if is_huggingface(model.init_from):
        return PretrainedSource(model.init_from, LlamaLayout(model.n_layers, model.n_heads, model.kv_heads,
                                                             model.tie_embeddings))
    run, step = run_and_step(model.init_from)
    return PretrainedSource(join_url(run, CHECKPOINTS_DIR, step_dir_name(step)), None)


def is_huggingface(init_from: str) -> bool:
    return os.path.exists(os.path.join(init_from, CONFIG_NAME))


def run_and_step(init_from: str) -> tuple[str, int | None]:
    match = RUN_STEP.match(init_from)
    return match["run"], int(match["step"]) if match["step"] else None


def source_identity(init_from: str, options: StorageOptions) -> dict[str, str]:
    """What ``init_from`` (resolved to ``RUN@STEP`` for a run) is, file by file: a HuggingFace
    directory's config, index and weight files, or the manifest of a run's checkpoint (which
    holds the sha256 of every file it names). Files that are gone are left out: a resume never
    reads the source, so it may be deleted once the run has checkpoints of its own."""
    if is_huggingface(init_from):
        from fsspec.implementations.local import LocalFileSystem

        fs, directory = LocalFileSystem(), init_from
        names = [CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME]
        if os.path.exists(os.path.join(directory, INDEX_NAME)):
            with open(os.path.join(directory, INDEX_NAME)) as file:
                names += sorted(set(json.load(file)["weight_map"].values()))
    else:
        run, step = run_and_step(init_from)
        directory = join_url(run, CHECKPOINTS_DIR, step_dir_name(step))
        fs, directory = options.filesystem(directory)
        names = [MANIFEST_NAME]
    identity = {}
    for name in names:
        try:
            identity[name] = fingerprint(fs, f"{directory}/{name}")
        except FileNotFoundError:
            continue
    return identity


def changed_files(saved: dict[str, str], identity: dict[str, str]) -> list[str]:
    """The source's files that differ from what a run recorded when it started from it: changed
    or new (gone is not changed)."""
    return sorted(name for name, now in identity.items() if saved.get(name) != now)


def load_pretrained(model: nn.Module, source: PretrainedSource, options: StorageOptions, process_group) -> int:
    """Overwrite the (sharded) model's parameters with ``source``'s weights; returns the bytes
    this rank read from a HuggingFace directory (0 from a run's checkpoint)."""
    import torch.distributed.checkpoint as dcp

    if source.layout is None:
        from checkpointing.rank_io import load_weights

        load_weights(model, source.location, options, process_group)
        return 0
    names = llama_names(source.layout)
    state = {name: tensor for name, tensor in model.state_dict().items() if name in names}
    reader = PretrainedReader(source.location, source.layout)
    dcp.load(state, storage_reader=reader, process_group=process_group)
    return reader.bytes_read

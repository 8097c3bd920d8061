"""The weights a run starts from (``model.init_from``): a HuggingFace directory, or a
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

import torch
from torch import nn

from checkpointing.huggingface import (
    CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, HuggingFaceLayout, PretrainedReader, expert_names, huggingface_names,
    layout_of, stored_shapes, weight_files,
)
from checkpointing.catalog import CHECKPOINTS_DIR, step_dir_name
from checkpointing.manifest import MANIFEST_NAME
from checkpointing.storage import StorageOptions, fingerprint, join_url

# A run's checkpoint as a source: the run's URL, and the step after an @ (else its newest).
RUN_STEP = re.compile(r"^(?P<run>.+?)(?:@(?P<step>\d+))?$")


@dataclass(frozen=True)
class PretrainedSource:
    location: str  # a HuggingFace directory, or a checkpoint's URL
    layout: HuggingFaceLayout | None  # a HuggingFace directory's name table; None: a checkpoint of this project


def pretrained_source(model, options: StorageOptions) -> PretrainedSource | None:
    """What a model section's ``init_from`` names (``elastic.setup.config.ModelConfig``; preflight
    resolved a run's to ``RUN@STEP``), with the name table its fields give."""
    if not model.init_from:
        return None
    if is_huggingface(model.init_from):
        return PretrainedSource(model.init_from, layout_of(model.shape))
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
            names += sorted({os.path.relpath(path, directory) for path in weight_files(directory).values()})
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


def source_shapes(source: PretrainedSource, options: StorageOptions) -> dict[str, torch.Size]:
    """The shape of each tensor ``source`` holds, by the reference model's names: from a
    HuggingFace directory's safetensors headers, or a run's checkpoint's DCP metadata (read
    with the safe unpickler). ValueError (or ``CorruptCheckpoint``) says what is wrong."""
    if source.layout is not None:
        return stored_shapes(source.location, source.layout)
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from checkpointing.safe_loading import check_metadata

    metadata = check_metadata(*options.filesystem(source.location))
    prefix = "model."
    return {key[len(prefix):]: item.size for key, item in metadata.state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)}


class PretrainedUnloadable(ValueError):
    """The source's weights do not load into the model (preflight checks what it can first)."""


def load_pretrained(model: nn.Module, source: PretrainedSource, options: StorageOptions, process_group) -> int:
    """Overwrite the (sharded) model's parameters with ``source``'s weights; returns the bytes
    this rank read from a HuggingFace directory (0 from a run's checkpoint).
    ``PretrainedUnloadable`` when they do not load: the same on every process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    # DCP gathers a read's failure on any rank into every rank's CheckpointException (a
    # BaseException); a peer lost mid-load raises a collective's error instead, which passes.
    try:
        if source.layout is None:
            from checkpointing.rank_io import load_weights

            load_weights(model, source.location, options, process_group)
            return 0
        names = huggingface_names(source.layout) | expert_names(source.layout)
        state = {name: tensor for name, tensor in model.state_dict().items() if name in names}
        reader = PretrainedReader(source.location, source.layout)
        dcp.load(state, storage_reader=reader, process_group=process_group)
        return reader.bytes_read
    except CheckpointException as error:
        raise PretrainedUnloadable(f"{source.location} does not load: {first_failure(error)}") from None


def first_failure(error) -> str:
    """A ``CheckpointException``'s first failed rank's error, as one line."""
    cause, _ = next(iter(error.failures.values()))
    return " ".join(f"{type(cause).__name__}: {cause}".split())[:400]

"""Loading a checkpoint runs no code from storage, signed or not.

DCP unpickles ``.metadata`` with plain ``pickle`` and its default planner reads the
non-tensor items (the optimizer's hyperparameters) with ``torch.load(weights_only=False)``:
whoever can write the bucket could make every rank run their code on resume. Instead:

- ``.metadata`` goes through ``load_metadata`` here, an unpickler that resolves only the
  classes DCP's metadata is made of; the catalog checks it before picking a checkpoint, so
  a planted one is moved aside like a corrupt one, with an event, before any rank reads it;
- a rank loads through ``rank_io.SafeReader`` (``.metadata`` by ``load_metadata``) and
  ``rank_io.SafeLoadPlanner`` (the other items by ``torch.load(weights_only=True)``, which
  takes only tensors and plain containers).

Anything else is refused as ``UnsafeCheckpoint``. Importing this module imports no torch.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from checkpointing.manifest import DCP_FILE, CorruptCheckpoint

METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout from its name
    "torch": {"Size", *(  # the dtypes, by name
        "float64 float32 float16 bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz complex128 "
        "complex64 int64 int32 int16 int8 uint64 uint32 uint16 uint8 bool").split()},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # the checkpoint's id
    "collections": {"OrderedDict"},
}


class UnsafeCheckpoint(CorruptCheckpoint):
    """A checkpoint file that asks to run code: refused, never loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f".metadata refers to {module}.{name}, which DCP metadata never holds: refused, "
                               "not loaded (someone who can write the checkpoint storage may have planted it)")


def load_metadata(stream: io.BufferedIOBase):
    """DCP's ``Metadata`` from ``stream``, or ``UnsafeCheckpoint`` / ``CorruptCheckpoint``."""
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UnsafeCheckpoint:
        raise
    except Exception as error:
        raise CorruptCheckpoint(f".metadata does not load: {type(error).__name__}: {error}") from error
    if type(metadata).__module__ != "torch.distributed.checkpoint.metadata" or type(metadata).__name__ != "Metadata":
        raise UnsafeCheckpoint(f".metadata holds a {type(metadata).__name__}, not DCP metadata: refused")
    # Where each item's bytes lie: a file DCP writes, in the checkpoint's own directory. A
    # forged path (absolute, or with ..) would have a rank or an export read any file at all.
    for storage in (getattr(metadata, "storage_data", None) or {}).values():
        path = getattr(storage, "relative_path", None)
        if not isinstance(path, str) or not DCP_FILE.match(path) or path == ".metadata":
            raise UnsafeCheckpoint(f".metadata places data in {path!r}, not a file DCP writes in the checkpoint's "
                                   "directory: refused, not read")
    return metadata


def check_metadata(fs, directory: str):
    """``directory/.metadata``, checked to be plain DCP metadata: ``UnsafeCheckpoint`` (or
    ``CorruptCheckpoint``) unless it is."""
    with fs.open(f"{directory}/.metadata", "rb") as stream:
        return load_metadata(stream)

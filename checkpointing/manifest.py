"""The commit manifest: a checkpoint exists once, and only once, its manifest is written.

The driver writes it after every rank of the saving group reported its upload finished, with
each file's size and sha256 as read back from storage. Loading checks every file against it,
so a truncated shard, a flipped byte or a missing file makes the checkpoint unusable rather
than silently wrong.

Digests beside the files authenticate nothing against someone who can write the bucket, and
DCP loads ``.metadata`` with pickle. With a signing key in the driver's environment
(``ELASTIC_CHECKPOINT_KEY``, never stored with the checkpoints), each manifest carries an
HMAC-SHA256 of its content, and a checkpoint without a valid one is neither verified nor
loaded.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Annotated, Any, Literal

import fsspec
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, StringConstraints, field_validator

from checkpointing.signing import SIGNING_KEY_ENV
from checkpointing.storage import file_digest

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1
# The files DCP writes: one data file per rank and write bucket, and the metadata.
DCP_FILE = re.compile(r"^(__\d+_\d+\.distcp|\.metadata)$")


class CorruptCheckpoint(ValueError):
    pass


class UnloadableCheckpoint(CorruptCheckpoint):
    """A committed checkpoint whose files match its manifest but do not load into a rank
    (bytes written by someone without the signing key, or refused by the safe loader): the
    checkpoint is bad, not the rank. Raised by every rank of the load alike."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileRecord(_Strict):
    name: str
    size: NonNegativeInt
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]

    @field_validator("name")
    @classmethod
    def _a_dcp_file(cls, name: str) -> str:
        if not DCP_FILE.match(name):
            raise ValueError(f"{name!r} is not a file DCP writes (__<rank>_<n>.distcp or .metadata)")
        return name


class Manifest(_Strict):
    format_version: Literal[1] = FORMAT_VERSION
    step: NonNegativeInt
    sequence: NonNegativeInt = 0  # commit order within the run (0: written before it was recorded)
    # the data plan's cursor: epoch, position and the samples returned to it (``DataCursor``)
    cursor: dict[str, NonNegativeInt | tuple[NonNegativeInt, ...]]
    topology: dict[str, NonNegativeInt]
    config_hash: str
    config: dict[str, Any] = Field(default_factory=dict)  # the settings the state depends on
    data: dict[str, str] = Field(default_factory=dict)  # what the data was: file -> size and fingerprint
    source: dict[str, str] = Field(default_factory=dict)  # what model.init_from was: file -> fingerprint
    lease_generation: NonNegativeInt = 0  # of the driver that committed it (0: before leases)
    files: tuple[FileRecord, ...] = Field(min_length=1)
    timings: dict[str, float] = Field(default_factory=dict)
    # the generator states of each shard position's stream, base64, by shard index (see workers.rng)
    rng: dict[str, dict[str, str]] = Field(default_factory=dict)
    # fp16's loss scale at this step (elastic.core.loss_scale: value, good_steps); empty without one
    loss_scale: dict[str, float] = Field(default_factory=dict)
    signature: str | None = None  # HMAC-SHA256 of the rest, when the run has a signing key

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files)

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        """Any manifest that does not parse, or does not match the schema, is a corrupt checkpoint."""
        try:
            return cls.model_validate_json(data, strict=True)
        except Exception as error:  # ValidationError, UnicodeDecodeError: all mean "corrupt"
            raise CorruptCheckpoint(f"unreadable manifest: {' '.join(str(error).split())[:300]}") from None


def _mac(manifest: Manifest, key: bytes) -> str:
    return hmac.new(key, manifest.model_dump_json(exclude={"signature"}).encode(), hashlib.sha256).hexdigest()


def sign(manifest: Manifest, key: bytes) -> Manifest:
    return manifest.model_copy(update={"signature": _mac(manifest, key)})


def check_signature(manifest: Manifest, key: bytes) -> None:
    if manifest.signature is None:
        raise CorruptCheckpoint(f"the manifest is not signed, and {SIGNING_KEY_ENV} is set")
    if not hmac.compare_digest(manifest.signature, _mac(manifest, key)):
        raise CorruptCheckpoint(f"the manifest's signature does not match {SIGNING_KEY_ENV}")


def write_manifest(fs: fsspec.AbstractFileSystem, directory: str, manifest: Manifest) -> None:
    """Write-then-rename on filesystems where that is atomic; an S3 PUT is atomic by itself."""
    final = f"{directory}/{MANIFEST_NAME}"
    staging = f"{final}.tmp"
    with fs.open(staging, "w") as handle:
        handle.write(manifest.to_json())
    fs.mv(staging, final)


def read_manifest(fs: fsspec.AbstractFileSystem, directory: str) -> Manifest:
    path = f"{directory}/{MANIFEST_NAME}"
    if not fs.exists(path):
        raise CorruptCheckpoint("no manifest (the checkpoint was never committed)")
    with fs.open(path, "rb") as handle:
        return Manifest.from_json(handle.read())


def verify(fs: fsspec.AbstractFileSystem, directory: str, manifest: Manifest) -> None:
    """Raise ``CorruptCheckpoint`` naming the first file that is missing or differs."""
    for record in manifest.files:
        path = f"{directory}/{record.name}"
        if not fs.exists(path):
            raise CorruptCheckpoint(f"{record.name} is missing")
        size, sha256 = file_digest(fs, path)
        if size != record.size:
            raise CorruptCheckpoint(f"{record.name} has {size} bytes, the manifest says {record.size}")
        if sha256 != record.sha256:
            raise CorruptCheckpoint(f"{record.name} checksum mismatch")

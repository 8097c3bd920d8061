"""The commit manifest: a checkpoint exists once, and only once, its manifest is written.

The driver writes it after every rank of the saving group reported its upload finished, with
each file's size and sha256 as read back from storage. Loading checks every file against it,
so a truncated shard, a flipped byte or a missing file makes the checkpoint unusable rather
than silently wrong.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import fsspec

from checkpointing.storage import file_digest

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


class CorruptCheckpoint(ValueError):
    pass


@dataclass(frozen=True)
class FileRecord:
    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    cursor: dict
    topology: dict
    config_hash: str
    files: tuple[FileRecord, ...]
    timings: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        try:
            data = json.loads(text)
            files = tuple(FileRecord(**record) for record in data.pop("files"))
            return cls(files=files, **data)
        except (ValueError, TypeError, KeyError) as error:
            raise CorruptCheckpoint(f"unreadable manifest: {error}") from None


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
    with fs.open(path, "r") as handle:
        return Manifest.from_json(handle.read())


def verify(fs: fsspec.AbstractFileSystem, directory: str, manifest: Manifest) -> None:
    """Raise ``CorruptCheckpoint`` naming the first file that is missing or differs."""
    if manifest.format_version != FORMAT_VERSION:
        raise CorruptCheckpoint(f"format version {manifest.format_version}, expected {FORMAT_VERSION}")
    if not manifest.files:
        raise CorruptCheckpoint("the manifest lists no files")
    for record in manifest.files:
        path = f"{directory}/{record.name}"
        if not fs.exists(path):
            raise CorruptCheckpoint(f"{record.name} is missing")
        size, sha256 = file_digest(fs, path)
        if size != record.size:
            raise CorruptCheckpoint(f"{record.name} has {size} bytes, the manifest says {record.size}")
        if sha256 != record.sha256:
            raise CorruptCheckpoint(f"{record.name} checksum mismatch")

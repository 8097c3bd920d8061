"""The run's checkpoint catalog: where checkpoints live, which are committed, which to keep.

Layout under the run's storage URL::

    <run>/checkpoints/step-00000040/   DCP files (__<rank>_<n>.distcp, .metadata)
                                       manifest.json  (written last: the commit)

A directory without a manifest is partial (a save that failed or whose driver died) and is
never loaded; it is deleted once no save is writing into it. The last ``keep`` committed
checkpoints are kept. Storage calls only, no Ray, no torch.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from checkpointing.manifest import (
    MANIFEST_NAME,
    CorruptCheckpoint,
    FileRecord,
    Manifest,
    read_manifest,
    verify,
    write_manifest,
)
from checkpointing.storage import StorageOptions, join_url

log = logging.getLogger("elastic.checkpoint")

STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


@dataclass(frozen=True)
class Restorable:
    """A committed checkpoint that passed verification."""

    url: str
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step


class CheckpointCatalog:
    def __init__(self, run_url: str, options: StorageOptions, every: int, keep: int):
        self.root_url = join_url(run_url, "checkpoints")
        self.options = options
        self.every = every
        self.keep = keep

    def url(self, step: int) -> str:
        return join_url(self.root_url, step_dir_name(step))

    def is_due(self, step: int) -> bool:
        return self.every > 0 and step > 0 and step % self.every == 0

    def _filesystem(self):
        return self.options.filesystem(self.root_url)

    def _step_dirs(self) -> dict[int, str]:
        fs, root = self._filesystem()
        try:
            entries = fs.ls(root, detail=False)
        except FileNotFoundError:
            return {}
        steps = {}
        for entry in entries:
            match = STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
            if match:
                steps[int(match.group(1))] = entry.rstrip("/")
        return steps

    def latest(self, on_skip: Callable[[int, str], None] = lambda step, reason: None) -> Restorable | None:
        """The newest committed checkpoint whose files all match its manifest."""
        fs, _ = self._filesystem()
        for step, path in sorted(self._step_dirs().items(), reverse=True):
            try:
                manifest = read_manifest(fs, path)
                verify(fs, path, manifest)
            except CorruptCheckpoint as problem:
                log.warning("skipping checkpoint at step %d: %s", step, problem)
                on_skip(step, str(problem))
                continue
            return Restorable(self.url(step), manifest)
        return None

    def commit(self, step: int, cursor: dict, topology: dict, config_hash: str,
               files: dict[str, tuple[int, str]], timings: dict) -> Manifest:
        manifest = Manifest(
            step=step,
            cursor=cursor,
            topology=topology,
            config_hash=config_hash,
            files=tuple(FileRecord(name, size, sha) for name, (size, sha) in sorted(files.items())),
            timings=timings,
        )
        fs, path = self.options.filesystem(self.url(step))
        write_manifest(fs, path, manifest)
        return manifest

    def prune(self, writing: int | None = None) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep`` and every partial one
        except the directory a save is ``writing`` into. Returns the steps deleted."""
        fs, _ = self._filesystem()
        dirs = self._step_dirs()
        committed, partial = [], []
        for step, path in dirs.items():
            has_manifest = fs.exists(f"{path}/{MANIFEST_NAME}")
            (committed if has_manifest else partial).append(step)
        doomed = sorted(sorted(committed)[: max(0, len(committed) - self.keep)] + [s for s in partial if s != writing])
        for step in doomed:
            fs.rm(dirs[step], recursive=True)
        return doomed

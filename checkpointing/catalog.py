"""The run's checkpoint catalog: where checkpoints live, which are committed, which to keep.

Layout under the run's storage URL::

    <run>/checkpoints/step-00000040/   DCP files (__<rank>_<n>.distcp, .metadata)
                                       manifest.json  (written last: the commit)

A directory without a manifest is partial (a save that failed or whose driver died) and is
never loaded. The driver marks each directory it saves into with its lease generation
(``lease-generation``), and deletes a partial directory once no save is writing into it,
unless a newer generation marked it: that one belongs to the driver that took the run over
(an older generation's partials are fair game, as their driver can no longer commit). Manifests carry a commit
sequence number: retention keeps the newest ``keep`` commits in commit order (a resume from
an older checkpoint makes its later commits the newest, whatever their step numbers), and
never the checkpoint just committed or the one the run resumed from. A checkpoint that
fails verification is moved aside to ``corrupt-step-NNNNNNNN[.K]`` (kept for inspection, never
loaded, never counted). Storage calls only, no Ray, no torch.
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
    check_signature,
    read_manifest,
    sign,
    verify,
    write_manifest,
)
from checkpointing.safe_loading import check_metadata
from checkpointing.storage import StorageOptions, join_url

log = logging.getLogger("elastic.checkpoint")

STEP_DIR = re.compile(r"^step-(\d{8})$")
GENERATION_MARK = "lease-generation"


class NoUsableCheckpoint(RuntimeError):
    """Checkpoints exist and every one fails verification: starting again from step 0 would
    silently discard the run."""


# A run's checkpoints, under its directory.
CHECKPOINTS_DIR = "checkpoints"


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
    def __init__(self, run_url: str, options: StorageOptions, every: int, keep: int, generation: int = 0,
                 signing_key: bytes | None = None):
        self.root_url = join_url(run_url, CHECKPOINTS_DIR)
        self.options = options
        self.every = every
        self.keep = keep
        self.generation = generation  # of the run lease this driver holds
        self.signing_key = signing_key  # set: only manifests signed with it are committed checkpoints

    def prepare(self, step: int) -> str:
        """The directory a save of ``step`` writes into, marked with this driver's generation."""
        url = self.url(step)
        fs, path = self.options.filesystem(url)
        fs.makedirs(path, exist_ok=True)
        fs.pipe_file(f"{path}/{GENERATION_MARK}", str(self.generation).encode())
        return url

    def _marked_generation(self, fs, path: str) -> int:
        try:
            return int(fs.cat_file(f"{path}/{GENERATION_MARK}"))
        except (FileNotFoundError, ValueError):
            return 0  # unmarked: written before leases, or by a save that never started

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

    def committed_steps(self) -> list[int]:
        """The steps whose checkpoint was committed (its manifest written), verified or not."""
        fs, _ = self._filesystem()
        return sorted(step for step, path in self._step_dirs().items() if fs.exists(f"{path}/{MANIFEST_NAME}"))

    def _read(self, fs, step: int, path: str) -> Manifest:
        manifest = read_manifest(fs, path)
        if manifest.step != step:
            raise CorruptCheckpoint(f"the manifest says step {manifest.step} inside {step_dir_name(step)}")
        if self.signing_key:
            check_signature(manifest, self.signing_key)
        return manifest

    def latest(self, on_skip: Callable[[int, str], None] = lambda step, reason: None,
               start_fresh: bool = False, at_most: int | None = None) -> Restorable | None:
        """The newest committed checkpoint (in commit order) whose files all match its manifest
        (of a step up to ``at_most``, if given).

        Committed checkpoints that fail verification are moved aside. When every one fails,
        ``NoUsableCheckpoint`` stops the run, unless ``start_fresh`` says to move them all
        aside and start from step 0."""
        fs, _ = self._filesystem()
        found, corrupt, partial = self._newest_verified(fs, at_most=at_most)
        if corrupt and found is None and not start_fresh:
            listed = "; ".join(f"step {step}: {reason}" for step, reason in sorted(corrupt))
            raise NoUsableCheckpoint(
                f"all {len(corrupt)} committed checkpoint(s) under {self.root_url} fail verification ({listed}); "
                "repair or restore them, or run with --start-fresh (checkpoint.start_fresh = true) to move them "
                "aside and train from step 0"
            )
        for step, reason in sorted(partial + corrupt, reverse=True):
            on_skip(step, reason)
        for step, reason in corrupt:
            log.warning("checkpoint at step %d is corrupt, moved aside: %s", step, reason)
            self.move_aside(step)
        return found

    def _newest_verified(self, fs, step: int | None = None,
                         at_most: int | None = None) -> tuple[Restorable | None, list, list]:
        """The newest committed checkpoint (of ``step``, or up to ``at_most``, if given) whose
        files match its manifest, and the (step, reason) of the corrupt ones and of those
        never committed."""
        candidates, corrupt, partial = [], [], []
        for dir_step, path in self._step_dirs().items():
            if step is not None and dir_step != step or at_most is not None and dir_step > at_most:
                continue
            if not fs.exists(f"{path}/{MANIFEST_NAME}"):
                partial.append((dir_step, "no manifest (the checkpoint was never committed)"))
                continue
            try:
                candidates.append((self._read(fs, dir_step, path), path))
            except CorruptCheckpoint as problem:
                corrupt.append((dir_step, str(problem)))
        candidates.sort(key=lambda item: (item[0].sequence, item[0].step), reverse=True)
        for manifest, path in candidates:
            try:
                verify(fs, path, manifest)
                check_metadata(fs, path)
            except CorruptCheckpoint as problem:
                corrupt.append((manifest.step, str(problem)))
                continue
            return Restorable(self.url(manifest.step), manifest), corrupt, partial
        return None, corrupt, partial

    def find(self, step: int | None = None) -> Restorable:
        """The newest committed checkpoint that passes verification, or ``step``'s, changing
        nothing in storage (``latest`` moves the corrupt ones aside); ``NoUsableCheckpoint``
        says why there is none."""
        fs, _ = self._filesystem()
        found, corrupt, partial = self._newest_verified(fs, step)
        if found is None:
            which = "the run" if step is None else f"step {step}"
            problems = "; ".join(f"step {s}: {reason}" for s, reason in sorted(corrupt + partial))
            steps = sorted(self._step_dirs())
            raise NoUsableCheckpoint(f"no usable checkpoint of {which} under {self.root_url}"
                                     + (f" ({problems})" if problems else f"; checkpoints there: {steps or 'none'}"))
        return found

    def move_aside(self, step: int) -> None:
        """To ``corrupt-step-N``, or ``corrupt-step-N.K`` when the same step was corrupt
        before (a step retrained and corrupted again): a move never lands inside an earlier one."""
        fs, _ = self._filesystem()
        source = self._step_dirs()[step]
        root = source.rsplit("/", 1)[0]
        target, again = f"{root}/corrupt-{step_dir_name(step)}", 1
        while fs.exists(target):
            target, again = f"{root}/corrupt-{step_dir_name(step)}.{again}", again + 1
        fs.mv(source, target, recursive=True)

    def _next_sequence(self) -> int:
        fs, _ = self._filesystem()
        sequences = [0]
        for step, path in self._step_dirs().items():
            try:
                sequences.append(self._read(fs, step, path).sequence)
            except CorruptCheckpoint:
                continue
        return max(sequences) + 1

    def commit(self, step: int, cursor: dict, topology: dict, config_hash: str,
               files: dict[str, tuple[int, str]], timings: dict, config: dict | None = None,
               rng: dict[str, dict[str, str]] | None = None, data: dict[str, str] | None = None,
               source: dict[str, str] | None = None, loss_scale: dict[str, float] | None = None) -> Manifest:
        manifest = Manifest(
            step=step,
            sequence=self._next_sequence(),
            cursor=cursor,
            topology=topology,
            config_hash=config_hash,
            config=config or {},
            data=data or {},
            source=source or {},
            loss_scale=loss_scale or {},
            lease_generation=self.generation,
            files=tuple(FileRecord(name=name, size=size, sha256=sha) for name, (size, sha) in sorted(files.items())),
            timings=timings,
            rng=rng or {},
        )
        if self.signing_key:
            manifest = sign(manifest, self.signing_key)
        fs, path = self.options.filesystem(self.url(step))
        write_manifest(fs, path, manifest)
        return manifest

    def prune(self, writing: int | None = None, protect: tuple[int | None, ...] = ()) -> list[int]:
        """Delete committed checkpoints beyond the newest ``keep`` in commit order, except the
        ``protect``ed steps (the one just committed, the one resumed from), and every partial
        one except the directory a save is ``writing`` into and those of a newer lease
        generation. Returns the steps deleted."""
        fs, _ = self._filesystem()
        dirs = self._step_dirs()
        committed, partial = [], []
        for step, path in dirs.items():
            if not fs.exists(f"{path}/{MANIFEST_NAME}"):
                if step != writing and self._marked_generation(fs, path) <= self.generation:
                    partial.append(step)
                continue
            try:
                committed.append((self._read(fs, step, path).sequence, step))
            except CorruptCheckpoint as problem:
                log.warning("checkpoint at step %d is corrupt, moved aside: %s", step, problem)
                self.move_aside(step)
        newest_first = [step for _, step in sorted(committed, reverse=True)]
        doomed = [step for step in newest_first[self.keep:] if step not in protect]
        doomed = sorted(doomed + partial)
        for step in doomed:
            fs.rm(dirs[step], recursive=True)
        return doomed

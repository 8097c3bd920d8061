"""What a resume must keep: the settings its checkpoint's state and data cursor depend on
(``check_resumable``), the data it reads (``resume_over_data``) and the weights it started
from (``check_same_source``). Each refusal names what changed and how to go on."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from checkpointing.catalog import Restorable
from checkpointing.pretrained import changed_files
from elastic.core.events import EventKind, EventLog, redact_credentials
from elastic.setup.config import ConfigError, TrainConfig


# The settings a checkpoint's state and data cursor depend on. Layout, steps, checkpoint,
# compute and metrics settings may change across a resume.
STATE_FIELDS = {"model", "data", "optimizer", "seed", "global_batch"}
# Recorded with the state (elastic export reads them back) but no part of its math: a resume
# may differ in them (a run started before the field existed recorded none).
NOT_IN_THE_MATH = {"model.max_position_embeddings"}


def config_record(config: TrainConfig) -> dict:
    """The settings the state depends on, as every manifest keeps them: a URL's secrets (a
    presigned data.path's signature) redacted, being no part of the settings."""
    record = config.model_dump(mode="json", include=STATE_FIELDS)
    # A decaying schedule's horizon as resolved: a run extended with more steps and no
    # explicit decay_steps would change its learning rates under the resume.
    schedule = config.lr_schedule
    record["optimizer"]["decay_steps"] = schedule.decay_steps if schedule.decay != "constant" else None
    return json.loads(redact_credentials(json.dumps(record)))


def config_hash(config: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(config_record(config), sort_keys=True).encode()).hexdigest()[:16]


def flatten(record: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_resumable(config: TrainConfig, run: str, checkpoint: Restorable) -> None:
    """Refuse a resume whose settings would change the math the checkpoint was trained with."""
    manifest = checkpoint.manifest
    if manifest.config:
        now = flatten(config_record(config))
        # A setting added since the checkpoint was written trained it at its default value.
        saved = {**flatten(config_record(TrainConfig())), **flatten(manifest.config)}
        keys = (saved.keys() | now.keys()) - NOT_IN_THE_MATH
        changed = sorted(key for key in keys if saved.get(key) != now.get(key))
        described = ", ".join(f"{key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in changed)
    else:  # written before manifests recorded the settings: only the hash can tell
        changed = [] if manifest.config_hash == config_hash(config) else ["(settings not recorded)"]
        described = "model, data, optimizer, seed or global_batch"
    if changed:
        raise ConfigError(
            f"run {run!r} resumes from step {checkpoint.step} ({checkpoint.url}), which was trained "
            f"with other settings: {described}; these change the model or the data order. Use the run's settings, "
            "or a new run name (--run-name) to start another run"
        )


def described_changes(saved: dict[str, str], now: dict[str, str], files: list[str], shown: int = 5) -> str:
    """Each changed file, what it was and what it is (``absent`` for none), the first
    ``shown`` of them."""
    return "; ".join(f"{file}: {saved.get(file, 'absent')} -> {now.get(file, 'absent')}" for file in files[:shown]) + (
        f"; and {len(files) - shown} more" if len(files) > shown else "")


def resume_over_data(config: TrainConfig, run: str, checkpoint: Restorable, identity: dict[str, str],
                     events: EventLog) -> Restorable:
    """The checkpoint to resume from, given the data as it is now. Data changed under the same
    path is refused, naming the files: the saved cursor indexes an order over other data, and
    would skip some samples and train others twice. With ``checkpoint.accept_changed_data``
    the model resumes and the data starts a new epoch."""
    saved = checkpoint.manifest.data  # empty: the data was generated, or the user's own
    changed = sorted(file for file in saved.keys() | identity.keys() if saved.get(file) != identity.get(file))
    if not saved or not changed:
        return checkpoint
    described = described_changes(saved, identity, changed)
    if not config.checkpoint.accept_changed_data:
        raise ConfigError(
            f"run {run!r} resumes from step {checkpoint.step}, but its data changed since: {described}; its data "
            "cursor would skip some samples and train others twice. Restore the data, or pass --accept-changed-data "
            "(checkpoint.accept_changed_data = true) to resume the model with a new epoch over the data"
        )
    cursor = {"epoch": checkpoint.manifest.cursor.get("epoch", 0) + 1, "position": 0}
    events.emit(EventKind.DATA_CHANGED, step=checkpoint.step, files=changed, cursor=cursor)
    return replace(checkpoint, manifest=checkpoint.manifest.model_copy(update={"cursor": cursor}))


def check_same_source(run: str, checkpoint: Restorable, identity: dict[str, str]) -> dict[str, str]:
    """The source identity a resumed run records: the one it started from. A resume never reads
    ``model.init_from`` again (it may be gone), but a source changed under the same name is
    refused: the run's record would name weights it did not start from."""
    saved = checkpoint.manifest.source
    changed = changed_files(saved, identity) if saved else []
    if changed:
        raise ConfigError(
            f"run {run!r} resumes from step {checkpoint.step}, but model.init_from changed since the run started "
            f"from it: {described_changes(saved, identity, changed)}; restore the source, or start a new run (--run-name) from it"
        )
    return saved or identity

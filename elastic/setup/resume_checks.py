"""What a resume must keep: the settings its checkpoint's state depends on
(``check_resumable``), the data it reads and the settings that say what that is
(``resume_over_data``), and the weights it started from (``check_same_source``). Each refusal
names what changed and how to go on. They read the checkpoint's manifest alone: the run
calls them before Ray starts."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from checkpointing.catalog import Restorable
from checkpointing.pretrained import changed_files
from elastic.core.events import EventKind, EventLog, redact_credentials
from elastic.setup.config import ConfigError, TrainConfig


# The settings a checkpoint's state and data cursor depend on. Layout, steps, checkpoint,
# compute and metrics settings may change across a resume. ``sync`` is recorded where it is not
# the default (every step's sum): DiLoCo's rounds hold an outer momentum, and its settings'
# math; a run that records none summed every step.
STATE_FIELDS = {"model", "data", "optimizer", "seed", "global_batch", "sync"}
# Recorded with the state (elastic export reads them back) but no part of its math: a resume
# may differ in them (a run started before the field existed recorded none).
NOT_IN_THE_MATH = {"model.max_position_embeddings"}
# The settings that say what the training data is: a resume that changes them resumes over
# changed data (``resume_over_data``), which checkpoint.accept_changed_data accepts.
DATA_FIELDS = {"data.path", "data.sources", "data.format", "data.token_dtype", "data.tokenizer", "data.text_column",
               "data.corpus_tokens"}


def config_record(config: TrainConfig) -> dict:
    """The settings the state depends on, as every manifest keeps them: a URL's secrets (a
    presigned data.path's signature) redacted, being no part of the settings."""
    record = config.model_dump(mode="json", include=STATE_FIELDS)
    if config.sync.outer_rounds is None:
        del record["sync"]
    # A decaying schedule's horizon as resolved: a run extended with more steps and no
    # explicit decay_steps would change its learning rates under the resume.
    schedule = config.lr_schedule
    record["optimizer"]["decay_steps"] = schedule.decay_steps if schedule.decay != "constant" else None
    return json.loads(redact_credentials(json.dumps(record)))


def config_hash(config: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(config_record(config), sort_keys=True).encode()).hexdigest()[:16]


def flatten(record: dict | list, prefix: str = "") -> dict:
    """One key a setting; a list (data.sources) item by item, so that a field added to its
    items since a record was written is one key absent there, not a whole list that differs."""
    flat = {}
    for key, value in record.items() if isinstance(record, dict) else enumerate(record):
        if isinstance(value, dict | list):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recorded_settings(config: TrainConfig, checkpoint: Restorable) -> tuple[dict, dict]:
    """The settings the state depends on, flattened: (as the checkpoint recorded them, as they
    are now). A setting added since the checkpoint was written trained it at its default value."""
    # every step's sum, which a record without ``sync`` was trained with
    defaults = {**flatten({"sync": TrainConfig().sync.model_dump(mode="json")}), **flatten(config_record(TrainConfig()))}
    return {**defaults, **flatten(checkpoint.manifest.config)}, {**defaults, **flatten(config_record(config))}


def is_data_setting(key: str) -> bool:
    return ".".join(key.split(".")[:2]) in DATA_FIELDS


def check_resumable(config: TrainConfig, run: str, checkpoint: Restorable) -> None:
    """Refuse a resume whose settings would change the math the checkpoint was trained with;
    what the data is, ``resume_over_data`` checks."""
    manifest = checkpoint.manifest
    if manifest.config:
        saved, now = recorded_settings(config, checkpoint)
        keys = (saved.keys() | now.keys()) - NOT_IN_THE_MATH
        changed = sorted(key for key in keys if not is_data_setting(key) and saved.get(key) != now.get(key))
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
    """The checkpoint to resume from, given the data as it is now: its files (``identity``)
    and the settings that say what it is (other sources, weights, tokenizer, columns). Changed
    data is refused, naming what changed: the saved cursor indexes an order over other data,
    and would skip some samples and train others twice. With ``checkpoint.accept_changed_data``
    the model resumes and the data starts over from its first epoch: the cursor counts epochs
    of the data as it is, as a mixture's sources' places in their own orders follow from it."""
    manifest = checkpoint.manifest
    saved, now = {}, {}
    if manifest.config:  # else check_resumable compared every setting, by the hash
        settings = recorded_settings(config, checkpoint)
        saved, now = ({key: value for key, value in record.items() if is_data_setting(key)} for record in settings)
    if manifest.data:  # empty: the data was generated, or the user's own (its settings say what it is)
        # a file's digest over the setting of the same name: the tokenizer is what it does, not its name
        saved, now = {**saved, **manifest.data}, {**now, **identity}
    changed = sorted(key for key in saved.keys() | now.keys() if saved.get(key) != now.get(key))
    if not changed:
        return checkpoint
    described = described_changes(saved, now, changed)
    if not config.checkpoint.accept_changed_data:
        raise ConfigError(
            f"run {run!r} resumes from step {checkpoint.step}, but its data changed since: {described}; its data "
            "cursor would skip some samples and train others twice. Restore the data, or pass --accept-changed-data "
            "(checkpoint.accept_changed_data = true) to resume the model and start the data over from its first "
            "epoch"
        )
    cursor = {"epoch": 0, "position": 0}
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

"""The checks a run's config passes before any actor starts that read the world: whether its
storage can be written and its data read. And the two ways a run gets its config, which run
them: ``build_config`` (from values) and ``load_config`` (from a file and overrides).

``elastic.setup.config`` checks a config's shape and reads nothing; these checks are kept out
of its validators so that a config can be parsed and compared (a resume, an export, the
docs' tables) without touching storage or data, and so that the data layer, which reads a
config, sits above it. ``ElasticTrainer`` runs ``preflight`` on the config it is given, so a
config built any other way is checked before a run too. A problem is one line, raised as
``ConfigError``: ``invalid config: <field>: <what is wrong>; <the fix>``.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

from checkpointing.manifest import CorruptCheckpoint
from checkpointing.storage import check_writable, in_ray_runtime_directory
from elastic.setup.config import TrainConfig, invalid_config, padded_vocab_size, parse_config
from elastic.setup.config_files import merge, read_config_file
from elastic.setup.errors import ConfigError

log = logging.getLogger("elastic")


def preflight(config: TrainConfig) -> TrainConfig:
    """``config``, its model fields read from ``model.init_from`` where it names one, once its
    storage is writable and its data readable; else ConfigError."""
    if config._preflighted_as is not None and config._preflighted_as == config.model_dump():
        return config
    if in_ray_runtime_directory(config.storage):  # the default ./runs of a driver under `ray job submit`
        raise ConfigError(invalid_config([
            f"storage: {config.storage} is in Ray's runtime directory, where Ray unpacked the job's files: Ray "
            "deletes it, and a job submitted again gets another, so the run could never resume; give --storage "
            "an absolute path outside it that every node reaches (or s3://...), and --run-name"]))
    if config.model.init_from:
        config = with_pretrained_fields(config)
    if config.data.tokenizer:  # after init_from, whose model may give model.vocab_size
        config = with_tokenizer_vocabulary(config)
    # Here, not at the top: the dataset brings torch, and a config refused for its shape never
    # gets here, so its refusal need not wait for torch.
    from elastic.setup.dataset import check_readable

    # Only a storage the config names: a config is also built for its defaults alone, in
    # whatever directory the process happens to run.
    if "storage" in config.model_fields_set:
        try:
            check_writable(config.storage)
        except ValueError as error:
            raise ConfigError(invalid_config([f"storage: {error}"])) from None
    try:
        # With the whole config: s3:// data is read with the run's S3 settings (checkpoint.s3_*).
        check_readable(config)  # names the field in its message
    except ValueError as error:
        raise ConfigError(invalid_config([str(error)])) from None
    check_metrics_address(config.metrics.host, config.metrics.port)
    config._preflighted_as = config.model_dump()
    return config


def check_metrics_address(host: str, port: int) -> None:
    """The metrics endpoint can listen where the config says: the host resolves and the port
    is free now (else it would fail after Ray and the actors had started)."""
    if not port and host == "127.0.0.1":
        return  # not served
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
            probe.bind(address)
    except OSError as error:
        raise ConfigError(invalid_config([f"metrics: cannot listen on {host}:{port} ({error.strerror or error}); "
                                          "free the port or give another (metrics.port; 0 takes any free one), "
                                          "and a host of this machine (metrics.host)"])) from None


def with_tokenizer_vocabulary(config: TrainConfig) -> TrainConfig:
    """``config``, its ``model.vocab_size`` the tokenizer's where the config leaves it unset
    (``len``: its added tokens too; padded, ``padded_vocab_size``). A tokenizer of more tokens
    than a ``model.vocab_size`` given is refused here, before the data is read: its ids past
    the embedding would stop the run at the first window that holds one."""
    from elastic.data.tokenizing import load_tokenizer

    name, model = config.data.tokenizer, config.model
    try:
        tokens = len(load_tokenizer(name, "data.tokenizer"))
    except ConfigError as error:
        raise ConfigError(invalid_config([str(error)])) from None
    padded = padded_vocab_size(tokens, config.scaling.tp)
    if "vocab_size" not in model.model_fields_set:
        return parse_config({**config.model_dump(exclude_unset=True),
                             "model": {**model.model_dump(exclude_unset=True), "vocab_size": padded}})
    if tokens <= model.vocab_size:
        return config
    if model.init_from:
        fix = "name the tokenizer model.init_from's model was trained with"
    else:
        fix = f"set model.vocab_size = {padded} (at least {tokens})" + (
            f" over model.preset {model.preset}'s" if model.preset else ", or leave it unset to take the tokenizer's")
    raise ConfigError(invalid_config([f"data.tokenizer {name!r}: has {tokens} tokens, more than model.vocab_size "
                                      f"{model.vocab_size}: its ids from {model.vocab_size} on have no embedding; "
                                      f"{fix}"]))


def with_pretrained_fields(config: TrainConfig) -> TrainConfig:
    """The model fields of what ``model.init_from`` names: a HuggingFace directory's
    ``config.json``, or the model a run's checkpoint was trained with (``RUN`` resolved to
    ``RUN@STEP``, its newest verified checkpoint). A field the config gives explicitly must
    agree."""
    from checkpointing.pretrained import is_huggingface

    source = config.model.init_from
    if is_huggingface(source):
        from checkpointing.huggingface import model_fields, read_config, unapplied_settings

        # Its weights are checked where the run is known to start from them, not to resume.
        try:
            contents = read_config(source)
            fields, unapplied = model_fields(contents), unapplied_settings(contents)
        except (OSError, ValueError, KeyError) as error:
            raise pretrained_refused(source, error) from None
        for warning in unapplied:  # here, where config.json is read: the run's config keeps no trace of them
            log.warning("%s", warning)
    else:
        fields, source = checkpoint_fields(config, source)
    given = config.model.model_dump(include=config.model.model_fields_set)
    differing = [f"{name} {given[name]!r} (the source's {fields[name]!r})" for name in sorted(given)
                 if name in fields and given[name] != fields[name]]
    if differing:
        raise ConfigError(invalid_config([f"model: {', '.join(differing)} differ from model.init_from's model; "
                                          "leave them out to take the source's"]))
    model = {**config.model.model_dump(exclude={"preset"}), **fields, "init_from": source}
    return parse_config({**config.model_dump(exclude_unset=True), "model": model})


def checkpoint_fields(config: TrainConfig, init_from: str) -> tuple[dict[str, Any], str]:
    """The model section a run's checkpoint was trained with, and ``RUN@STEP`` naming it."""
    from checkpointing.catalog import CheckpointCatalog
    from checkpointing.signing import signing_key_from_environment
    from checkpointing.pretrained import run_and_step

    run, step = run_and_step(init_from)
    catalog = CheckpointCatalog(run, config.checkpoint.storage_options(), every=1, keep=1,
                                signing_key=signing_key_from_environment())
    try:
        checkpoint = catalog.find(step)
    except Exception as error:  # no such checkpoint, or a URL the storage's client refuses (botocore's own types)
        raise pretrained_refused(init_from, error) from None
    recorded = (checkpoint.manifest.config or {}).get("model")
    if not recorded:
        raise pretrained_refused(init_from, ValueError("its checkpoint does not record the model it trained"))
    fields = {name: value for name, value in recorded.items() if name != "init_from"}
    return fields, f"{run}@{checkpoint.step}"


def check_pretrained_weights(config: TrainConfig) -> None:
    """For a run that starts from ``model.init_from``: every tensor the model needs is there,
    stored as floating point, in the shape the model's fields give it (a HuggingFace
    directory's headers, or a run's checkpoint's metadata): the weights' own error, refused in
    one line before any rank fails to load them."""
    import torch
    from safetensors import SafetensorError

    from checkpointing.pretrained import pretrained_source, source_shapes
    from elastic.setup.hooks import model_args
    from workers.model import Transformer

    model = config.model
    options = config.checkpoint.storage_options()
    source = pretrained_source(model, options)
    if source is None:
        return
    with torch.device("meta"):
        needed = {name: tensor.shape for name, tensor in Transformer(model_args(config)).state_dict().items()}
    try:
        stored = source_shapes(source, options)
        wrong = [f"{name} is {list(stored[name])} in the source, the model needs {list(shape)}"
                 for name, shape in needed.items() if name in stored and stored[name] != shape]
        missing = sorted(set(needed) - set(stored))
    except (OSError, ValueError, KeyError, SafetensorError, CorruptCheckpoint) as error:
        raise pretrained_refused(model.init_from, error) from None
    if missing:
        raise pretrained_refused(model.init_from, ValueError(
            f"the weights lack {len(missing)} of the model's tensors, such as {missing[0]!r}"))
    if wrong:
        fields = ", ".join(f"{name} {getattr(model, name)}" for name in ("vocab_size", "dim", "n_layers", "n_heads",
                                                                         "ffn_hidden"))
        raise pretrained_refused(model.init_from, ValueError(f"{wrong[0]} ({fields})"))


def pretrained_refused(source: str, error: Exception) -> ConfigError:
    what = f"no {error.args[0]!r} in config.json" if isinstance(error, KeyError) else str(error)
    return ConfigError(invalid_config([f"model.init_from: {source}: {what}; give a HuggingFace Llama, Mixtral, Qwen3 "
                                       "or Qwen3-MoE directory "
                                       "(config.json, and model.safetensors or its index and shards), or a run "
                                       "of this project (RUN or RUN@STEP)"]))


def build_config(values: dict[str, Any]) -> TrainConfig:
    """The config of ``values``, its shape checked, then its storage and data."""
    return preflight(parse_config(values))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config in the file at ``path`` (TOML or YAML; None: the defaults) under ``overrides``
    (dotted keys allowed), its shape checked, then its storage and data."""
    base = read_config_file(path) if path else {}
    return build_config(merge(base, overrides or {}))

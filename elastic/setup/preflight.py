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

from pathlib import Path
from typing import Any

from checkpointing.storage import check_writable
from elastic.setup.config import TrainConfig, invalid_config, merge, parse_config, read_config_file
from elastic.setup.errors import ConfigError


def preflight(config: TrainConfig) -> TrainConfig:
    """``config``, once its storage is writable and its data readable; else ConfigError."""
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
    return config


def build_config(values: dict[str, Any]) -> TrainConfig:
    """The config of ``values``, its shape checked, then its storage and data."""
    return preflight(parse_config(values))


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """The config in the file at ``path`` (TOML or YAML; None: the defaults) under ``overrides``
    (dotted keys allowed), its shape checked, then its storage and data."""
    base = read_config_file(path) if path else {}
    return build_config(merge(base, overrides or {}))

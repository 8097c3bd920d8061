"""A config file (TOML or YAML) read into plain values, and overrides merged into them, before
``parse_config`` checks their shape. Every refusal names the file and the fix."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import yaml

from checkpointing.storage import regular_file
from elastic.setup.errors import ConfigError


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.suffix not in {".toml", ".yaml", ".yml"}:
        raise ConfigError(f"--config: {path} must end in .toml, .yaml or .yml")
    try:
        text = Path(regular_file(str(path))).read_text(encoding="utf-8")  # UTF-8 by TOML's spec, whatever the locale
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path}: {error.strerror or error}; give an existing file") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"--config: {path} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8"
        ) from None
    try:
        values = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"--config: {path} does not parse: {error}") from None
    if values_expanded(values) > MAX_CONFIG_VALUES:
        raise ConfigError(f"--config: {path} expands to more than {MAX_CONFIG_VALUES:,} values (YAML aliases "
                          "repeat what they name); write the config without nested aliases")
    if not isinstance(values, dict):
        raise ConfigError(
            f"--config: {path} holds a {type(values).__name__} at its top level; "
            "write fields and sections as keys, e.g. 'steps: 60'"
        )
    return values


# A config is a few hundred values; YAML's aliases can make a few lines stand for billions
# (each anchor a list of copies of the one before), which anything walking them would expand.
MAX_CONFIG_VALUES = 100_000


def values_expanded(values: Any) -> int:
    """How many values ``values`` holds once every alias is expanded, counted without expanding
    them: each shared list or mapping is counted once and its count reused (capped, so that a
    count cannot grow without bound)."""
    counted: dict[int, int] = {}

    def count(value: Any) -> int:
        if not isinstance(value, (list, dict)):
            return 1
        if id(value) not in counted:
            counted[id(value)] = MAX_CONFIG_VALUES + 1  # a cycle (a recursive alias) counts as too many
            children = value.values() if isinstance(value, dict) else value
            counted[id(value)] = min(MAX_CONFIG_VALUES + 1, 1 + sum(count(child) for child in children))
        return counted[id(value)]

    return count(values)


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` (dotted keys allowed) into ``base``."""
    merged = {key: dict(value) if isinstance(value, dict) else value for key, value in base.items()}
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = merged
        for parent in parents:
            node = node.setdefault(parent, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{dotted}: {parent} is not a section")
        node[leaf] = value
    return merged

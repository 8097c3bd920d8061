"""Errors the user's input causes, shared by every layer that reads it (config, data, CLI)."""


class ConfigError(ValueError):
    """Bad configuration or input, reported before any actor starts."""

"""Errors the user's input causes, shared by every layer that reads it (config, data, CLI)."""

from elastic.core.events import redact_credentials


class ConfigError(ValueError):
    """Bad configuration or input, reported before any actor starts. Its message quotes the
    input, and is redacted as it is made: whoever prints, logs or keeps the error (the CLI, a
    caller of the Python API, the run's summary) never holds a URL's secrets."""

    def __init__(self, message: str):
        super().__init__(redact_credentials(str(message)))


def invalid_config(problems: list[str]) -> str:
    """The message for a config's problems, each ``<field>: <what is wrong>; <the fix>``."""
    # One problem, one line: the line a terminal or a job's log shows first.
    return "invalid config:" + ("\n  " if len(problems) > 1 else " ") + "\n  ".join(problems)

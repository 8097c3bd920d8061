"""Fault-tolerant, elastic FSDP2 + TP training on Ray.

The public names load on first use, so importing the pure core (``elastic.core``) does not
load Ray, torch or pydantic.
"""

from importlib import import_module

_EXPORTS = {
    "ConfigError": "elastic.setup.errors",
    "TrainConfig": "elastic.setup.config",
    "load_config": "elastic.setup.preflight",
    "ElasticTrainer": "elastic.trainer",
    "RunResult": "elastic.trainer",
    "StepResult": "elastic.driver.records",
    "EvalResult": "elastic.driver.records",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)

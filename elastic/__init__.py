"""Fault-tolerant, elastic FSDP2 + TP training on Ray."""

from elastic.config import ConfigError, TrainConfig, load_config
from elastic.trainer import ElasticTrainer, RunResult

__all__ = ["ConfigError", "ElasticTrainer", "RunResult", "TrainConfig", "load_config"]

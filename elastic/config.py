"""The job's one validated config tree, loadable from TOML or YAML and overridable by flags.

Every field is checked before any actor starts. A problem is reported as
``<field path>: <what is wrong>; <how to fix it>`` so the message names the fix.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from checkpointing.storage import StorageOptions, absolute_url
from elastic.core.straggler_detector import DEFAULT_MAD_GATE, DEFAULT_PATIENCE, DEFAULT_THRESHOLD, DEFAULT_WINDOW

PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]


class ConfigError(ValueError):
    """Bad configuration or input, reported before any actor starts."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ScalingConfig(Section):
    min_groups: PositiveInt = 1
    max_groups: PositiveInt = 2
    shard: PositiveInt = 2
    tp: PositiveInt = 2
    cpus_per_rank: PositiveFloat = 0.25
    # None: one GPU per rank when training on GPUs, none on CPU.
    gpus_per_rank: NonNegativeFloat | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @model_validator(mode="after")
    def _min_not_above_max(self) -> ScalingConfig:
        if self.min_groups > self.max_groups:
            raise ValueError(
                f"min_groups={self.min_groups} is larger than max_groups={self.max_groups}; "
                "set min_groups <= max_groups (e.g. --groups MIN:MAX)"
            )
        if self.device == "cuda" and self.gpus_per_rank == 0:
            raise ValueError("device='cuda' needs gpus_per_rank > 0; set gpus_per_rank = 1 or leave it unset")
        if self.device == "cpu" and self.gpus_per_rank:
            raise ValueError(f"device='cpu' with gpus_per_rank={self.gpus_per_rank:g}; set gpus_per_rank = 0 or device = 'cuda'")
        return self

    def on_cluster(self, cluster_gpus: float) -> ScalingConfig:
        """``device = auto`` trains on GPUs when the cluster has them; gpus_per_rank follows the device."""
        device, gpus = self.device, self.gpus_per_rank
        if device == "auto":
            wants_gpus = gpus > 0 if gpus is not None else cluster_gpus > 0
            device = "cuda" if wants_gpus else "cpu"
        if gpus is None:
            gpus = 1.0 if device == "cuda" else 0.0
        return self.model_copy(update={"device": device, "gpus_per_rank": gpus})

    @property
    def uses_gpu(self) -> bool:
        return self.device == "cuda" or (self.device == "auto" and bool(self.gpus_per_rank))

    @property
    def ranks_per_group(self) -> int:
        return self.shard * self.tp


class ModelConfig(Section):
    vocab_size: PositiveInt = 256
    dim: PositiveInt = 64
    n_layers: PositiveInt = 2
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt | None = None
    ffn_hidden: PositiveInt = 192
    tie_embeddings: bool = False

    @model_validator(mode="after")
    def _heads_fit(self) -> ModelConfig:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; pick a multiple")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}; pick a divisor"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


class DataConfig(Section):
    path: str | None = None
    seq_len: PositiveInt = 64
    corpus_tokens: PositiveInt = 400_000

    @field_validator("path")
    @classmethod
    def _path_readable(cls, path: str | None) -> str | None:
        if path is None:
            return None
        from elastic.dataset import resolve_text_files

        try:
            resolve_text_files(path)
        except OSError as error:
            raise ValueError(f"{error}; give a readable file, glob or fsspec URL") from None
        return absolute_url(path)


class OptimizerConfig(Section):
    lr: PositiveFloat = 3e-3
    weight_decay: NonNegativeFloat = 0.0
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8


class ComputeConfig(Section):
    """Speed settings, applied from outside the model (TorchTitan-style)."""

    # bf16: FSDP2 all-gathers and computes in bf16, keeps fp32 master weights and reduces
    # gradients in fp32. auto: bf16 on CUDA, fp32 on CPU.
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    # dtype of the cross-group gradient all-reduce
    replicate_precision: Literal["fp32", "bf16"] = "fp32"
    compile: bool = False
    activation_checkpointing: Literal["none", "full"] = "none"


class CheckpointConfig(Section):
    every: NonNegativeInt = 20
    keep: PositiveInt = 3
    grace_s: PositiveFloat = 30.0
    # Saves that fail in a row before the run stops: past this, storage is not coming back
    # soon, and every step trained is a step that a failure would lose.
    max_consecutive_failures: PositiveInt = 5
    # Where each rank writes its files: a process of its own (no GIL shared with training),
    # or a thread of the rank (no process to start: small models, CPU ranks). auto: process
    # on CUDA, thread on CPU.
    upload: Literal["auto", "process", "thread"] = "auto"
    # When the run has checkpoints and every one fails verification: stop (false), or move
    # them aside and train from step 0 (true).
    start_fresh: bool = False
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_max_attempts: PositiveInt = 4

    def upload_in_process(self, uses_gpu: bool) -> bool:
        return self.upload == "process" or (self.upload == "auto" and uses_gpu)

    def storage_options(self) -> StorageOptions:
        """Config fields win; otherwise boto reads AWS_ENDPOINT_URL, AWS_REGION and credentials."""
        return StorageOptions(endpoint_url=self.s3_endpoint_url, region=self.s3_region, max_attempts=self.s3_max_attempts)


class FaultToleranceConfig(Section):
    collective_timeout_s: PositiveFloat = 30.0
    deadline_factor: PositiveFloat = 5.0
    min_deadline_s: PositiveFloat = 10.0
    first_step_deadline_s: PositiveFloat = 120.0
    capacity_timeout_s: NonNegativeFloat = 60.0
    max_recoveries: NonNegativeInt = 100
    inject: str = ""

    @field_validator("inject")
    @classmethod
    def _faults_parse(cls, inject: str) -> str:
        from elastic.core.faults import parse_faults

        parse_faults(inject)
        return inject


class StragglerConfig(Section):
    enabled: bool = True
    mitigate: bool = True
    window: PositiveInt = DEFAULT_WINDOW
    threshold: PositiveFloat = DEFAULT_THRESHOLD
    mad_gate: PositiveFloat = DEFAULT_MAD_GATE
    patience: PositiveInt = DEFAULT_PATIENCE
    noise: Annotated[float, Field(ge=0, lt=1)] = 0.0
    regrow_cooldown_s: NonNegativeFloat = 600.0


class MetricsConfig(Section):
    host: str = "127.0.0.1"
    port: NonNegativeInt = 0


class TrainConfig(Section):
    run_name: str | None = None
    storage: str = Field(default="./runs", validate_default=True)
    steps: PositiveInt = 60
    global_batch: PositiveInt = 32
    micro_batch: PositiveInt = 4
    seed: int = 0
    scaling: ScalingConfig = ScalingConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    compute: ComputeConfig = ComputeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    stragglers: StragglerConfig = StragglerConfig()
    metrics: MetricsConfig = MetricsConfig()

    @field_validator("storage")
    @classmethod
    def _storage_absolute(cls, storage: str) -> str:
        return absolute_url(storage)

    @model_validator(mode="after")
    def _layout_fits_model(self) -> TrainConfig:
        tp, model = self.scaling.tp, self.model
        for field, size in [
            ("model.n_heads", model.n_heads),
            ("model.n_kv_heads", model.kv_heads),
            ("model.dim", model.dim),
            ("model.ffn_hidden", model.ffn_hidden),
            ("model.vocab_size", model.vocab_size),
        ]:
            if size % tp:
                divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
                raise ValueError(
                    f"scaling.tp={tp} does not divide {field}={size}; choose tp in {divisors} "
                    f"or change {field}"
                )
        if self.micro_batch > self.global_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} is larger than global_batch={self.global_batch}; "
                "lower micro_batch"
            )
        if self.run_name is not None and not self.run_name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"run_name={self.run_name!r} may hold only letters, digits, '-' and '_'")
        return self


def _field_path(location: tuple) -> str:
    return ".".join(str(part) for part in location) or "config"


def describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key; remove it or check its spelling against the config reference"
        elif item["type"] in {"greater_than", "greater_than_equal"}:
            message = f"{message}, got {item['input']!r}; use a positive value"
        lines.append(f"{_field_path(item['loc'])}: {message}")
    return "invalid config:\n  " + "\n  ".join(lines)


def build_config(values: dict[str, Any]) -> TrainConfig:
    try:
        return TrainConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(describe(error)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"--config: cannot read {path}: {error.strerror}; give an existing file") from None
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        if path.suffix in {".yaml", ".yml"}:
            return yaml.safe_load(text) or {}
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as error:
        raise ConfigError(f"--config: {path} does not parse: {error}") from None
    raise ConfigError(f"--config: {path} must end in .toml, .yaml or .yml")


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


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    base = read_config_file(path) if path else {}
    return build_config(merge(base, overrides or {}))


def on_cluster(config: TrainConfig, cluster_resources: dict[str, float]) -> TrainConfig:
    """The config with its device resolved against the cluster it runs on."""
    scaling = config.scaling.on_cluster(cluster_resources.get("GPU", 0.0))
    return config.model_copy(update={"scaling": scaling})


def check_capacity(config: TrainConfig, cluster_resources: dict[str, float]) -> None:
    """Fail before any actor starts if the minimum layout cannot be placed."""
    scaling = config.scaling
    needed_ranks = scaling.min_groups * scaling.ranks_per_group
    for resource, per_rank in [("CPU", scaling.cpus_per_rank), ("GPU", scaling.gpus_per_rank or 0.0)]:
        if per_rank == 0:
            continue
        available = cluster_resources.get(resource, 0.0)
        needed = needed_ranks * per_rank
        if needed > available + 1e-9:
            raise ConfigError(
                f"scaling: min_groups x shard x tp = {scaling.min_groups} x {scaling.shard} x "
                f"{scaling.tp} = {needed_ranks} ranks need {needed:g} {resource} at "
                f"{resource.lower()}s_per_rank={per_rank:g}, but the cluster has {available:g}; "
                f"lower the layout or {resource.lower()}s_per_rank, or add nodes"
            )

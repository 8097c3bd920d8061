"""The job's one validated config tree, loadable from TOML or YAML and overridable by flags.

Every field is checked before any actor starts. A problem is reported as
``<field path>: <what is wrong>; <how to fix it>`` so the message names the fix.
"""

from __future__ import annotations

import string
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

# Upper bounds: every size and time stays far inside what a worker's int, int32 tensor index,
# timedelta or sleep can hold. Floats are finite everywhere (Section.model_config).
DAY_S = 86_400.0
WEEK_S = 7 * DAY_S
MAX_TP = 64
MAX_STEPS = 1_000_000_000
_RUN_NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + "-_.")


class ConfigError(ValueError):
    """Bad configuration or input, reported before any actor starts."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class ScalingConfig(Section):
    min_groups: PositiveInt = Field(1, le=4096)
    max_groups: PositiveInt = Field(2, le=4096)
    shard: PositiveInt = Field(2, le=4096)
    tp: PositiveInt = Field(2, le=MAX_TP)
    cpus_per_rank: PositiveFloat = Field(0.25, le=1024)
    # None: one GPU per rank when training on GPUs, none on CPU.
    gpus_per_rank: NonNegativeFloat | None = Field(None, le=16)
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
    vocab_size: PositiveInt = Field(256, le=2**20)
    dim: PositiveInt = Field(64, le=2**16)
    n_layers: PositiveInt = Field(2, le=1024)
    n_heads: PositiveInt = Field(4, le=1024)
    n_kv_heads: PositiveInt | None = Field(None, le=1024)
    ffn_hidden: PositiveInt = Field(192, le=2**18)
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
    seq_len: PositiveInt = Field(64, le=2**20)
    # generated in memory: for more, give data.path
    corpus_tokens: PositiveInt = Field(400_000, le=1_000_000_000)

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
    every: NonNegativeInt = Field(20, le=MAX_STEPS)
    keep: PositiveInt = Field(3, le=1000)
    grace_s: PositiveFloat = Field(30.0, le=DAY_S)
    # Saves that fail in a row before the run stops: past this, storage is not coming back
    # soon, and every step trained is a step that a failure would lose.
    max_consecutive_failures: PositiveInt = Field(5, le=1000)
    # Where each rank writes its files: a process of its own (no GIL shared with training),
    # or a thread of the rank (no process to start: small models, CPU ranks). auto: process
    # on CUDA, thread on CPU.
    upload: Literal["auto", "process", "thread"] = "auto"
    # When the run has checkpoints and every one fails verification: stop (false), or move
    # them aside and train from step 0 (true).
    start_fresh: bool = False
    # One driver per run: a driver renews its lease every third of this; one that dies
    # leaves the run to the next driver this long after its last renewal.
    lease_ttl_s: float = Field(60.0, ge=3.0, le=DAY_S)
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_max_attempts: PositiveInt = Field(4, le=100)

    def upload_in_process(self, uses_gpu: bool) -> bool:
        return self.upload == "process" or (self.upload == "auto" and uses_gpu)

    def storage_options(self) -> StorageOptions:
        """Config fields win; otherwise boto reads AWS_ENDPOINT_URL, AWS_REGION and credentials."""
        return StorageOptions(endpoint_url=self.s3_endpoint_url, region=self.s3_region, max_attempts=self.s3_max_attempts)


class FaultToleranceConfig(Section):
    collective_timeout_s: PositiveFloat = Field(30.0, le=DAY_S)
    # A control call that moves the state (heal, checkpoint staging, restore) that takes
    # longer fails its ranks, which are then replaced like any failed rank.
    state_timeout_s: PositiveFloat = Field(600.0, le=DAY_S)
    deadline_factor: PositiveFloat = Field(5.0, le=1000)
    min_deadline_s: PositiveFloat = Field(10.0, le=DAY_S)
    first_step_deadline_s: PositiveFloat = Field(120.0, le=DAY_S)
    capacity_timeout_s: NonNegativeFloat = Field(60.0, le=WEEK_S)
    max_recoveries: NonNegativeInt = Field(100, le=1_000_000)
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
    window: PositiveInt = Field(DEFAULT_WINDOW, le=10_000)
    threshold: PositiveFloat = DEFAULT_THRESHOLD
    mad_gate: PositiveFloat = DEFAULT_MAD_GATE
    patience: PositiveInt = Field(DEFAULT_PATIENCE, le=10_000)
    noise: Annotated[float, Field(ge=0, lt=1)] = 0.0
    regrow_cooldown_s: NonNegativeFloat = Field(600.0, le=WEEK_S)


class MetricsConfig(Section):
    host: str = "127.0.0.1"
    port: NonNegativeInt = Field(0, le=65535)


class TrainConfig(Section):
    run_name: str | None = Field(None, max_length=128)
    storage: str = Field(default="./runs", validate_default=True)
    steps: PositiveInt = Field(60, le=MAX_STEPS)
    global_batch: PositiveInt = Field(32, le=2**20)
    micro_batch: PositiveInt = Field(4, le=2**20)
    # numpy seeds take no negative numbers; workers scale the seed into a 64-bit torch seed
    seed: NonNegativeInt = Field(0, lt=2**32)
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

    @field_validator("run_name")
    @classmethod
    def _run_name_is_a_plain_name(cls, run_name: str | None) -> str | None:
        # ASCII only: str.isalnum() accepts any script's letters and digits.
        if run_name is not None and (
            not run_name or run_name.startswith(".") or not set(run_name) <= _RUN_NAME_CHARACTERS
        ):
            raise ValueError(
                f"{run_name!r} may hold only ASCII letters, digits, '-', '_' and '.', and must not "
                "start with '.'; rename the run, e.g. 'llama-7b_run.2'"
            )
        return run_name

    @model_validator(mode="after")
    def _layout_fits_model(self) -> TrainConfig:
        tp, model = self.scaling.tp, self.model
        sizes = {
            "model.n_heads": model.n_heads,
            "model.n_kv_heads": model.kv_heads,
            "model.dim": model.dim,
            "model.ffn_hidden": model.ffn_hidden,
            "model.vocab_size": model.vocab_size,
        }
        for field, size in sizes.items():
            if size % tp:
                # tp values (at most MAX_TP of them) that divide every size, and the sizes
                # nearest this one that the chosen tp divides.
                fitting = [d for d in range(1, MAX_TP + 1) if all(s % d == 0 for s in sizes.values())]
                below, above = size - size % tp, size - size % tp + tp
                nearest = f"{below} or {above}" if below else f"{above}"
                raise ValueError(
                    f"scaling.tp={tp} does not divide {field}={size}; choose tp in {fitting} "
                    f"or change {field} to a multiple of {tp} (nearest: {nearest})"
                )
        if self.micro_batch > self.global_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} is larger than global_batch={self.global_batch}; "
                "lower micro_batch"
            )
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
        elif item["type"] in {"less_than", "less_than_equal"}:
            message = f"{message}, got {item['input']!r}; use a smaller value"
        elif item["type"] == "finite_number":
            message = f"{message}, got {item['input']!r}; inf and nan are not allowed, give a number"
        elif item["type"] == "string_too_long":
            message = f"{message}; use a shorter one"
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

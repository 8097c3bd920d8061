"""The job's one config tree (pydantic), read from TOML or YAML and overridable by flags.

This module owns the config's shape: every field's type and range, the choices, the fields
that must agree (the layout against the model, faults against the layout). Parsing reads
nothing but the values given. Whether the storage can be written and the data read is
checked by ``elastic.setup.preflight``, which also holds ``build_config`` and ``load_config``,
the ways a run gets its config. A problem is reported as
``<field path>: <what is wrong>; <how to fix it>`` so the message names the fix.
"""

from __future__ import annotations

import difflib
import math
import reprlib
import string
from typing import Annotated, Any, Literal, get_args, get_type_hints

from pydantic import (BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, field_validator,
                      model_validator)

from checkpointing.storage import StorageOptions, absolute_url, refuse_credentials
from elastic.core.faults import OUTER_STEP, check_targets, parse_faults
from elastic.core.loss_scale import LossScale
from elastic.core.lr_schedule import LRSchedule
from elastic.core.model_shape import SHAPE_FIELDS, ModelShape, ShapeRules
from elastic.core.compute_replay import MIN_GROUPS
from elastic.core.outer_rounds import OuterRounds, whole_rounds
from elastic.core.straggler_detector import DEFAULT_MAD_GATE, DEFAULT_PATIENCE, DEFAULT_THRESHOLD, DEFAULT_WINDOW
from elastic.core.straggler_policy import DEFAULT_MIN_SAVING_S
from elastic.core.topology import SINGLE_STAGE_SCHEDULES, Topology
from elastic.data.formats import FORMATS
from elastic.setup.errors import ConfigError, invalid_config
from elastic.setup.presets import PRESETS

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
# model.vocab_size, where this project chooses it, is a multiple of this: every tp that is a
# power of two up to MAX_TP divides it, and GPU kernels take its tiles whole.
VOCAB_MULTIPLE = 64


def padded_vocab_size(tokens: int, tp: int = 1) -> int:
    """The least ``model.vocab_size`` that holds ``tokens`` ids, a multiple of
    ``VOCAB_MULTIPLE`` and of ``tp`` (``scaling.tp`` splits the vocabulary)."""
    multiple = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-tokens // multiple) * multiple


def _takes_bool(annotation) -> bool:
    return annotation is bool or any(_takes_bool(argument) for argument in get_args(annotation))


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value, info):
        # pydantic takes true for 1 in an int field: `--set steps=true` would train one step.
        if isinstance(value, bool) and not _takes_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"{str(value).lower()} is a boolean, not what this field takes; give a value of its type")
        return value




class ScalingConfig(Section):
    min_groups: PositiveInt = Field(1, le=4096)
    max_groups: PositiveInt = Field(2, le=4096)
    shard: PositiveInt = Field(2, le=4096)
    tp: PositiveInt = Field(2, le=MAX_TP)
    # Rank processes started ahead, each in a placement of its own size: a group that loses
    # a rank takes one instead of starting a process (elastic.core.spares).
    spares: NonNegativeInt = Field(0, le=4096)
    cpus_per_rank: PositiveFloat = Field(0.25, le=1024)
    # None: one GPU per rank when training on GPUs, none on CPU.
    gpus_per_rank: NonNegativeFloat | None = Field(None, le=16)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # What carries the collectives on GPU tensors. NCCL refuses two ranks on one GPU; gloo
    # lets several ranks share one (gpus_per_rank < 1), slowly: for checks on a one-GPU machine.
    gpu_collectives: Literal["nccl", "gloo"] = "nccl"
    # Pipeline stages: a group is pp x shard x cp x tp ranks, each holding pp_stages_per_rank
    # stages of the model (1 for GPipe and 1F1B, None: 2 for the interleaved schedules).
    pp: PositiveInt = Field(1, le=1024)
    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble"] = "1F1B"
    pp_stages_per_rank: PositiveInt | None = Field(None, le=64)
    # The residual stream, norms and dropout sharded on the sequence between TP regions.
    # None: on when tp > 1 divides data.seq_len and the model has no dropout (each TP rank
    # would draw the masks of its own share of the sequence, which a single process draws
    # differently).
    sequence_parallel: bool | None = None
    # Expert parallelism: a mixture of experts' experts split over each block of this many
    # consecutive shard ranks, tokens dispatched to them and back by all-to-all; FSDP2
    # shards each rank's experts over the shard / ep blocks (none where ep = shard: each
    # rank holds its own whole). 1: FSDP2 shards the experts like any parameter.
    ep: PositiveInt = Field(1, le=4096)
    # When FSDP2 frees a block's gathered parameters: after its forward (always: ZeRO-3, the
    # least memory, gathered again for backward), or only after its backward (never: ZeRO-2,
    # one all-gather a block a step, the whole parameters held through the forward). default:
    # always, but never in a pipeline stage, whose micro-batches would gather each block
    # again and again (TorchTitan's policy). The math is the same either way.
    reshard_after_forward: Literal["default", "always", "never"] = "default"
    # Context parallelism: each sequence split over this many ranks of the group, each holding
    # two chunks of it (one early, one late: the same attention work on every rank), attention
    # over the keys and values gathered from all of them; FSDP2 shards over shard x cp. For
    # sequences whose activations do not fit one rank (workers.context_parallel).
    cp: PositiveInt = Field(1, le=1024)

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3 (True) or ZeRO-2 (False), ``default`` resolved by the pipeline."""
        return self.reshard_after_forward == "always" or (self.reshard_after_forward == "default" and self.pp == 1)

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
        if self.pp_schedule in SINGLE_STAGE_SCHEDULES and self.stages_per_rank != 1:
            raise ValueError(f"pp_schedule={self.pp_schedule!r} runs one stage per rank, not pp_stages_per_rank="
                             f"{self.stages_per_rank}; set pp_stages_per_rank = 1 or pp_schedule = 'Interleaved1F1B'")
        if self.pp > 1 and self.pp_schedule == "InterleavedZeroBubble" and (self.shard > 1 or self.tp > 1):
            # Its separate weight-gradient pass: measured off by 1e-2 from one process at shard 2
            # or tp 2 (tests/test_pipeline.py), exact with neither.
            raise ValueError(f"pp_schedule='InterleavedZeroBubble' computes wrong weight gradients with FSDP2 or TP "
                             f"inside a stage (shard={self.shard}, tp={self.tp}); use 'Interleaved1F1B', or "
                             "shard = tp = 1")
        if self.gpu_collectives == "nccl" and self.gpus_per_rank and self.gpus_per_rank < 1:
            raise ValueError(f"gpus_per_rank={self.gpus_per_rank:g} puts several ranks on one GPU, which NCCL refuses; "
                             "set gpus_per_rank = 1, or gpu_collectives = 'gloo' (slow: for checks on one GPU)")
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

    def per_rank_resources(self) -> list[tuple[str, float]]:
        """The Ray resources a rank asks for, by name, that it asks for at all."""
        return [(name, amount) for name, amount in [("CPU", self.cpus_per_rank), ("GPU", self.gpus_per_rank or 0.0)]
                if amount]

    @property
    def uses_gpu(self) -> bool:
        return self.device == "cuda" or (self.device == "auto" and bool(self.gpus_per_rank))

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 1 if self.pp_schedule in SINGLE_STAGE_SCHEDULES else 2

    @property
    def topology(self) -> Topology:
        """The layout these settings give (``elastic.core.topology``, the one owner of its
        formulas: the ranks of a group, the ranks FSDP2 shards over, the mesh)."""
        return Topology(self.shard, self.tp, self.max_groups, self.pp, self.ep, self.cp)


class RopeScaling(Section):
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3`` in a HuggingFace config; see
    ``elastic.core.model_shape.RopeScaling``)."""

    factor: Annotated[float, Field(ge=1)]
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_len: PositiveInt = 8192

    @model_validator(mode="after")
    def _bands_ordered(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"high_freq_factor={self.high_freq_factor} must be above "
                             f"low_freq_factor={self.low_freq_factor}")
        return self


def _shape_section() -> type[Section]:
    """The ``model`` section's fields of the model's shape: ``elastic.core.model_shape.ModelShape``'s,
    each with its default and validated within its bounds (``rope_scaling`` as the section above)."""
    hints = get_type_hints(ModelShape)
    return create_model("ModelShapeFields", __base__=Section, **{
        name: (RopeScaling | None if name == "rope_scaling" else hints[name], Field(spec.default, **spec.metadata))
        for name, spec in SHAPE_FIELDS.items()})


# The model's shape (elastic.core.model_shape.ModelShape: the fields, their defaults, bounds and
# derived rules are the owner's), where its weights start from and how it was named.
class ModelConfig(_shape_section(), ShapeRules):
    # The sequence length the model is made for (HuggingFace's max_position_embeddings), from
    # model.init_from's config.json; elastic export writes it back (data.seq_len where longer).
    # The model computes RoPE for data.seq_len whatever it says.
    max_position_embeddings: PositiveInt | None = Field(None, le=2**24)
    # The weights a new run starts from: a HuggingFace Llama, Mixtral, Qwen3 or Qwen3-MoE
    # directory (config.json and safetensors) or another run (RUN or RUN@STEP, weights only);
    # it gives the shape's fields (elastic.setup.preflight). A resume starts from the run's own
    # checkpoints, never from it.
    init_from: str | None = None
    # A named shape from elastic.setup.presets under the fields given here. Left out of dumps: the
    # fields it filled are recorded, so a resume compares the shape however it was spelled.
    preset: str | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _preset_under_given_fields(cls, data: Any) -> Any:
        preset = data.get("preset") if isinstance(data, dict) else None
        # An unknown name or a non-string is left to field validation, which reports it under
        # model.preset.
        if not isinstance(preset, str) or preset not in PRESETS:
            return data
        return {**PRESETS[preset], **data}

    @field_validator("init_from")
    @classmethod
    def _init_from_without_credentials(cls, init_from: str | None) -> str | None:
        return None if init_from is None else refuse_credentials(init_from)

    @field_validator("preset")
    @classmethod
    def _preset_known(cls, preset: str | None) -> str | None:
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        return preset

    @model_validator(mode="after")
    def _heads_fit(self) -> ModelConfig:
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; pick a multiple, "
                             "or give head_dim")
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd; RoPE rotates pairs of a head's dimensions: "
                             "give an even head_dim")
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}; pick a divisor"
            )
        if self.experts and self.experts_per_token > self.experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} is more than experts={self.experts}; "
                             "route each token to at most as many experts as there are")
        if self.experts and self.dense_layers >= self.n_layers:
            raise ValueError(f"dense_layers={self.dense_layers} leaves none of the {self.n_layers} layers to the "
                             f"experts; lower it below n_layers, or set experts = 0 for a dense model")
        return self

    @property
    def shape(self) -> ModelShape:
        return ModelShape.of(self.model_dump(include=set(SHAPE_FIELDS)))


# auto, or a format of elastic.data.formats (each entry says what it reads)
DataFormat = Literal[("auto", *FORMATS)]


class DataSource(Section):
    """One source of a mixture: its data and its share of every batch."""

    path: str
    # its share of the samples, against the other sources' weights (they need not sum to 1)
    weight: PositiveFloat = 1.0
    # None: data.format
    format: DataFormat | None = None
    # None: data.text_column
    text_column: str | None = Field(None, min_length=1)

    @field_validator("path")
    @classmethod
    def _path_absolute(cls, path: str) -> str:
        return absolute_url(refuse_credentials(path))

    @property
    def name(self) -> str:
        """How the run names it (data identity, summary): its path, and the column it reads when
        it gives its own, which tells two sources of one file apart."""
        return self.path if self.text_column is None else f"{self.path} (column {self.text_column})"


class DataConfig(Section):
    path: str | None = None
    # Several sources mixed by weight, instead of data.path: [[data.sources]] tables of path
    # and weight. Every sample of each is trained once before any of it repeats.
    sources: list[DataSource] = Field(default_factory=list, max_length=256)
    # How the files are read: a format of elastic.data.formats, whose table says what each
    # reads (token ids as they lie, or documents in data.text_column, tokenized by
    # data.tokenizer and packed), or auto: by the path's suffix (a URL's query string aside),
    # else by what the storage holds there (a Megatron pair, a .bin, a save_to_disk
    # directory), else by the suffixes of the files it matches (a directory, a glob: all
    # alike), text when they name none.
    # Applies to validation_path too.
    format: DataFormat = "auto"
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    # A HuggingFace tokenizer (a directory, or a Hub id) for a format of documents; never
    # runs a tokenizer's own code. None: UTF-8 bytes are the tokens.
    tokenizer: str | None = None
    # the column (Parquet, Arrow) or field (JSONL) that holds each document: text, or token ids
    text_column: str = Field("text", min_length=1)
    # The most a document may hold, in bytes: a JSONL line (decompressed), a Parquet or Arrow
    # text (a token id counts 8), a conversation's text; and, in characters, any value its chat
    # template makes rendering it, the rendering too. Larger is refused in one line naming the
    # file and the row, before it is read whole where the format allows, and before it is
    # tokenized: a tokenizer holds some 150 times a text's bytes while it encodes it, and aborts
    # the process when that fails.
    max_document_bytes: PositiveInt = Field(64 * 2**20, le=2**28)
    # Seconds a chat template may take to render a conversation (each of its renderings: the
    # whole, and the turns up to each assistant's); longer is refused, naming the file and row.
    chat_template_timeout_s: PositiveFloat = Field(10.0, le=3600)
    # Packed documents do not attend to each other, and positions restart with each one (and
    # at each window's start), as if each document ran alone: parquet, jsonl, arrow and chat,
    # the reference model, scaling.pp = 1.
    document_masking: bool = False
    # Held out for evaluation, never trained on: data of its own, or the training data's last
    # fraction. None and 0: the generated default corpus still has one, file data has none.
    validation_path: str | None = None
    validation_fraction: float = Field(0.0, ge=0, le=0.5)
    seq_len: PositiveInt = Field(64, le=2**20)
    # generated in memory: for more, give data.path
    corpus_tokens: PositiveInt = Field(400_000, le=1_000_000_000)

    @field_validator("path", "validation_path")
    @classmethod
    def _path_absolute(cls, path: str | None) -> str | None:
        return None if path is None else absolute_url(refuse_credentials(path))

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_without_credentials(cls, tokenizer: str | None) -> str | None:
        return None if tokenizer is None else refuse_credentials(tokenizer)  # a Hub id stays as it is

    @model_validator(mode="after")
    def _data_fits(self) -> DataConfig:
        trained = [source.path.rstrip("/") for source in self.training_sources()]
        problems = [  # in order: the first that holds is refused
            (self.validation_fraction and self.validation_path,
             f"validation_fraction={self.validation_fraction:g} and validation_path={self.validation_path!r} both "
             "choose the validation data; set only one of them"),
            (self.path and self.sources, "path and sources both name the training data; give one source as path, "
                                         "or several as sources"),
            (self.sources and self.validation_fraction,
             "validation_fraction splits one source, not a mixture (its samples move from epoch to epoch); give the "
             "held-out data as validation_path"),
            ("chat" in (self.format, *(source.format for source in self.sources)) and not self.tokenizer,
             "format chat renders conversations with a tokenizer's chat template; set tokenizer"),
            (self.validation_path and self.validation_path.rstrip("/") in trained,
             f"validation_path={self.validation_path!r} is the training data too, so its loss says nothing of data "
             "the model has not seen; give held-out data"
             f"{'' if self.sources else ', or unset it and hold out the tail of path with validation_fraction'}"),
        ]
        problem = next((text for broken, text in problems if broken), None)
        if problem:
            raise ValueError(problem)
        return self

    def training_sources(self) -> list[DataSource]:
        """The training data as sources: data.path is a source of weight 1."""
        return list(self.sources) or ([DataSource(path=self.path)] if self.path else [])

    @model_validator(mode="after")
    def _sources_distinct(self) -> DataConfig:
        read: dict[tuple, int] = {}  # what a source reads, and the first source that reads it
        for i, source in enumerate(self.sources):
            what = (source.path, source.format or self.format, source.text_column or self.text_column)
            first = read.setdefault(what, i)
            if first != i:
                raise ValueError(f"sources[{first}] and sources[{i}] both read {source.path}: each of its samples "
                                 "would train twice a pass; list it once, with the two weights added "
                                 f"({self.sources[first].weight + source.weight:g})")
        return self


class OptimizerConfig(Section):
    # the peak learning rate: the schedule scales it step by step
    lr: PositiveFloat = 3e-3
    weight_decay: NonNegativeFloat = 0.0
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8
    warmup_steps: NonNegativeInt = Field(0, le=MAX_STEPS)
    # after the warmup: keep the peak, or decay to min_lr_ratio x lr at decay_steps
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    # None: the run's steps. Set it when a run may be extended: the schedule must not move
    # under a resume.
    decay_steps: PositiveInt | None = Field(None, le=MAX_STEPS)
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.1
    # clip gradients to this global norm (over every shard, TP rank and replica group); None: no clipping
    clip_grad_norm: PositiveFloat | None = None
    # A step whose loss or gradient norm is not finite is discarded and tried again; this many
    # in a row end the run as diverged.
    max_nonfinite_steps: PositiveInt = Field(3, le=1000)


class EvalConfig(Section):
    # evaluate the held-out set every N committed steps and at the end (0: never)
    every: NonNegativeInt = Field(0, le=MAX_STEPS)
    # held-out samples per evaluation: the first ones of the validation set, in order
    samples: PositiveInt = Field(64, le=2**20)


class ComputeConfig(Section):
    """Speed settings, applied from outside the model (TorchTitan-style)."""

    # bf16: FSDP2 all-gathers and computes in bf16, keeps fp32 master weights and reduces
    # gradients in fp32. fp16: the same in fp16, for GPUs without bf16, with a dynamic loss
    # scale (elastic.core.loss_scale): a step whose gradients overflow is discarded by every
    # group and the scale halved, without counting as a fault or toward divergence. auto:
    # bf16 on CUDA, fp32 on CPU.
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    # fp16's loss scale at the run's start, and the committed steps in a row after which it doubles
    initial_loss_scale: PositiveFloat = Field(2.0**16, ge=1, le=2.0**64)
    loss_scale_growth_interval: PositiveInt = Field(2000, le=10**6)
    # dtype of the cross-group gradient all-reduce
    replicate_precision: Literal["fp32", "bf16"] = "fp32"
    compile: bool = False
    # full: every block recomputed in backward; selective: as selective_checkpointing says
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    # op: save attention's and every other matmul's outputs, recompute the rest of each
    # block (TorchTitan's per-op policy); N: recompute every Nth block whole
    selective_checkpointing: Literal["op"] | PositiveInt = "op"
    # torchao's float8 training of the linear layers (the float8 extra; GPUs of compute
    # capability 8.9+: H100, H200, L40S, ...), applied before TP and FSDP2 as TorchTitan does;
    # fastest with compile, which fuses the scaling and casts.
    float8: bool = False
    # FSDP2's CPUOffloadPolicy: parameters, gradients and the optimizer state kept in host
    # memory (pinned on a GPU), each block's parameters copied to the device for its forward
    # and backward, the optimizer step on the host. For models larger than the devices, at
    # the cost of the copies and a host-speed optimizer. Needs FSDP2: a group of more than
    # one rank.
    offload: bool = False

    @property
    def loss_scale(self) -> LossScale | None:
        """fp16's scale at a run's start; None for every other precision."""
        if self.precision != "fp16":
            return None
        return LossScale(self.initial_loss_scale, growth_interval=self.loss_scale_growth_interval)


class CheckpointConfig(Section):
    every: NonNegativeInt = Field(20, le=MAX_STEPS)
    # The in-memory tier: every N committed steps each rank copies its state into host
    # memory and to a buddy rank's; a shard position that loses every live copy comes back
    # from there, losing at most 2 N steps and reading nothing from storage (0: off). Every
    # step cost 47 % of bench/overhead.py's 35 ms CPU steps (2 cores, saturated by the
    # ranks); every 10, 2 % of the median step, 5-15 % of the mean.
    memory_every: NonNegativeInt = Field(10, le=MAX_STEPS)
    keep: PositiveInt = Field(3, le=1000)
    grace_s: PositiveFloat = Field(30.0, le=DAY_S)
    # Saves that fail in a row before the run stops: past this, storage is not coming back
    # soon, and every step trained is a step that a failure would lose.
    max_consecutive_failures: PositiveInt = Field(5, le=1000)
    # An upload still running this long after it started has stalled (a hung mount, a
    # storage endpoint that stopped answering): the save fails and counts as above, instead
    # of blocking every later save while training goes on with nothing new to fall back to.
    upload_timeout_s: PositiveFloat = Field(1800.0, le=DAY_S)
    # Where each rank writes its files: a process of its own (no GIL shared with training),
    # or a thread of the rank (no process to start: small models, CPU ranks). auto: process
    # on CUDA, thread on CPU.
    upload: Literal["auto", "process", "thread"] = "auto"
    # When the run has checkpoints and every one fails verification: stop (false), or move
    # them aside and train from step 0 (true).
    start_fresh: bool = False
    # A resume whose data changed (checkpoint manifests record each file's size and
    # fingerprint, and the data settings: sources, weights, tokenizer, columns): stop, naming
    # what changed (false), or resume the model and start the data over from its first epoch
    # (true).
    accept_changed_data: bool = False
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


class IntegrityConfig(Section):
    # Every N steps, the replica groups compare fingerprints of their committed state (one
    # integer per tensor) before the step is applied; a mismatch discards the step and heals
    # the odd groups (0: never). Runs of one group have no replica to compare with.
    every: NonNegativeInt = Field(10, le=MAX_STEPS)
    # Every N steps a spot check: each replica group also computes the next group's share of
    # the step, and a share not reproduced bit for bit names the rank that computed it wrong,
    # among three groups or more, or the pair it is one of, with two (elastic.core.compute_replay;
    # 0: never). It needs every step's sum and a model without dropout; a run of replicas
    # without them checks nothing, and says so as it starts.
    replay_every: NonNegativeInt = Field(100, le=MAX_STEPS)


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
    # checked by TrainConfig: a fault's rank or group is numbered over the whole layout
    inject: str = ""


class StragglerConfig(Section):
    enabled: bool = True
    mitigate: bool = True
    window: PositiveInt = Field(DEFAULT_WINDOW, le=10_000)
    threshold: PositiveFloat = DEFAULT_THRESHOLD
    mad_gate: PositiveFloat = DEFAULT_MAD_GATE
    patience: PositiveInt = Field(DEFAULT_PATIENCE, le=10_000)
    noise: Annotated[float, Field(ge=0, lt=1)] = 0.0
    regrow_cooldown_s: NonNegativeFloat = Field(600.0, le=WEEK_S)
    # A replacement or a group's eviction must save at least this much of each step: a step of
    # a few milliseconds is mostly noise, and a heal costs seconds.
    min_saving_s: NonNegativeFloat = Field(DEFAULT_MIN_SAVING_S, le=DAY_S)


class SyncConfig(Section):
    """How the replica groups' work is merged (``elastic.core.outer_rounds``): every step's
    gradients summed across groups (``every-step``), or DiLoCo's outer rounds: each group a
    learner for ``outer_every`` inner steps, then the learners' pseudo-gradients summed and
    applied by the outer optimizer (Nesterov SGD, the paper's lr 0.7 and momentum 0.9)."""

    mode: Literal["every-step", "diloco"] = "every-step"
    outer_every: PositiveInt = Field(50, le=MAX_STEPS)
    outer_lr: PositiveFloat = 0.7
    outer_momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    # the pseudo-gradients across groups: fp32 or bf16 values, or fp8 or int4 codes with a scale
    # every 64 values (workers.quantized_sum)
    precision: Literal["fp32", "bf16", "fp8", "int4"] = "fp32"
    # a learner lost inside a round: redo the round from its start (every committed step as a
    # clean run's), or drop it and commit over the learners that finished
    lost_learner: Literal["redo", "drop"] = "redo"
    # streaming DiLoCo: the model's blocks cut into this many fragments, each synced once a round
    # in turn; every ``fragments`` rounds all at once, where the learners are alike
    fragments: PositiveInt = Field(1, le=4096)
    # a fragment's outer step merged this many inner steps after its turn, its exchange crossing
    # behind their compute; and a learner's share of its own weights of the fragment as it merges
    sync_delay: NonNegativeInt = Field(0, le=MAX_STEPS)
    fragment_alpha: Annotated[float, Field(ge=0, lt=1)] = 0.0
    # a round commits once this many learners finished and grace_s has passed (0: every learner)
    quorum: NonNegativeInt = Field(0, le=4096)
    grace_s: NonNegativeFloat = Field(0.0, le=DAY_S)

    @property
    def outer_rounds(self) -> OuterRounds | None:
        if self.mode == "every-step":
            return None
        return OuterRounds(self.outer_every, self.outer_lr, self.outer_momentum, self.precision,
                           drops=self.lost_learner == "drop", fragments=self.fragments, delay=self.sync_delay,
                           alpha=self.fragment_alpha)


class MetricsConfig(Section):
    host: str = "127.0.0.1"
    port: NonNegativeInt = Field(0, le=65535)
    # elastic train keeps serving the final values this long after the run ends, so that
    # Prometheus scrapes them (a dashboard being set up sees the whole run); Ctrl-C ends it.
    linger_s: NonNegativeFloat = Field(0.0, le=DAY_S)


# The intervals that act on the run's state, which under DiLoCo is whole only between rounds.
ROUND_INTERVALS = {"checkpoint": ("every", "memory_every"), "integrity": ("every",), "eval": ("every",)}


class TrainConfig(Section):
    # The fields as preflight passed them: a config checked once (build_config, then the
    # trainer) is not checked again, since the checks read storage and hash checkpoints.
    _preflighted_as: dict | None = PrivateAttr(None)
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
    eval: EvalConfig = EvalConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    fault_tolerance: FaultToleranceConfig = FaultToleranceConfig()
    integrity: IntegrityConfig = IntegrityConfig()
    stragglers: StragglerConfig = StragglerConfig()
    metrics: MetricsConfig = MetricsConfig()
    sync: SyncConfig = SyncConfig()

    @field_validator("storage")
    @classmethod
    def _storage_absolute(cls, storage: str) -> str:
        return absolute_url(refuse_credentials(storage))

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
            # the shared experts' one SwiGLU, split like a dense feed-forward
            **({"model.expert_hidden x shared_experts": model.shared_width} if model.experts and model.shared_experts
               else {}),
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
        if self.scaling.topology.expert_parallel:
            self._check_expert_parallel()
        obstacles = self._sequence_parallel_obstacles() if self.scaling.sequence_parallel and tp > 1 else []
        if obstacles:
            raise ValueError(obstacles[0])
        schedule = self.lr_schedule
        if schedule.decay != "constant" and schedule.warmup_steps >= schedule.decay_steps:
            raise ValueError(
                f"optimizer.warmup_steps={schedule.warmup_steps} leaves no steps to decay over "
                f"(decay ends at step {schedule.decay_steps}); lower warmup_steps or raise optimizer.decay_steps"
            )
        if self.micro_batch > self.global_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} is larger than global_batch={self.global_batch}; "
                "lower micro_batch"
            )
        if self.scaling.pp > 1:
            self._check_pipeline()
        if self.compute.offload:
            self._check_offload()
        if self.scaling.cp > 1:
            self._check_context_parallel()
        return self

    def _check_context_parallel(self) -> None:
        scaling, model, seq_len = self.scaling, self.model, self.data.seq_len
        cp = scaling.cp
        problems = [  # in order: the first that holds is refused
            (seq_len % (2 * cp), f"data.seq_len={seq_len}: each rank holds two equal chunks of a sequence; give a "
                                 f"seq_len divisible by 2 x cp = {2 * cp}"),
            (model.dropout, f"model.dropout={model.dropout:g}: the cp ranks of a position share a random stream, "
                            "so their chunks would draw the same masks; set model.dropout = 0"),
            (model.experts, f"model.experts={model.experts}: a mixture's balance counts each sequence's tokens "
                            "whole, which no cp rank holds; set scaling.cp = 1 or model.experts = 0"),
        ]
        problem = next((text for broken, text in problems if broken), None)
        if problem:
            raise ValueError(f"scaling.cp={cp} with {problem}")

    def _check_expert_parallel(self) -> None:
        scaling, model = self.scaling, self.model
        ep = scaling.ep
        problems = [  # in order: the first that holds is refused
            # with model.init_from, experts left out are the source's: preflight gives every field, checked again
            (not model.experts and (not model.init_from or "experts" in model.model_fields_set),
             "model.experts = 0: a dense model has no experts to split; set scaling.ep = 1"
             f"{', or start from a mixture of experts (model.init_from)' if model.init_from else ''}"),
            (scaling.shard % ep, f"scaling.shard={scaling.shard}: the shard ranks split into blocks of ep ranks, "
                                 f"each holding every expert once; give an ep that divides {scaling.shard}"),
            (model.experts % ep, f"model.experts={model.experts} does not split evenly over {ep} ranks; set "
                                 f"model.experts to a multiple of {ep}, or scaling.ep to one that divides "
                                 f"{model.experts} and {scaling.shard}"),
        ]
        problem = next((text for broken, text in problems if broken), None)
        if problem:
            raise ValueError(f"scaling.ep={ep} with {problem}")

    def _check_offload(self) -> None:
        scaling = self.scaling
        if scaling.topology.fsdp_ranks == 1:
            raise ValueError("compute.offload needs FSDP2, which a group of one rank (shard = tp = 1) does not use; "
                             "raise scaling.shard or unset compute.offload")
        if scaling.topology.expert_parallel:
            raise ValueError(f"compute.offload with scaling.ep={scaling.ep}: the split experts are not FSDP2's to "
                             "offload; set scaling.ep = 1 or unset compute.offload")

    def _check_pipeline(self) -> None:
        scaling, model = self.scaling, self.model
        stages = scaling.pp * scaling.stages_per_rank
        if model.n_layers < stages:
            raise ValueError(f"scaling.pp={scaling.pp} x {scaling.stages_per_rank} stages per rank needs at least "
                             f"{stages} layers, model.n_layers is {model.n_layers}; lower scaling.pp or "
                             "pp_stages_per_rank")
        if model.tie_embeddings:
            raise ValueError("scaling.pp > 1 with model.tie_embeddings: the embedding and the output head live on "
                             "different stages; set model.tie_embeddings = false or scaling.pp = 1")
        if self.data.document_masking:
            raise ValueError("scaling.pp > 1 with data.document_masking: the stages do not carry the documents' "
                             "positions to each other; set scaling.pp = 1 or data.document_masking = false")
        # The fewest micro-batches a rank gets with groups of equal weight: the most groups, the
        # smallest group's share. (A straggler's reweighing may give fewer: the ranks pad them.)
        rows = -(-(self.global_batch // scaling.max_groups) // scaling.shard)
        micro_batches = -(-rows // self.micro_batch)
        if micro_batches < scaling.pp:
            fix = f"lower micro_batch to {rows // scaling.pp} or raise" if rows >= scaling.pp else "raise"
            raise ValueError(
                f"scaling.pp={scaling.pp} stages need at least {scaling.pp} micro-batches per step, and a rank gets "
                f"{micro_batches} (global_batch={self.global_batch} over {scaling.max_groups} groups x shard "
                f"{scaling.shard}, micro_batch={self.micro_batch}); {fix} global_batch")

    @model_validator(mode="before")
    @classmethod
    def _intervals_in_whole_rounds(cls, values: Any) -> Any:
        """Under DiLoCo the state is the run's (every learner's the same) only between rounds (with
        fragments, every ``fragments`` rounds): the checkpoint, integrity and evaluation intervals
        left at their defaults become whole such periods, and the memory tier's one period (a lost
        learner's work is redone, or joined, from its start); one given that is not whole
        periods is refused (``_check_sync``)."""
        if not isinstance(values, dict):
            return values
        sync = values.get("sync")
        sync = sync.model_dump() if isinstance(sync, SyncConfig) else sync
        if not isinstance(sync, dict) or sync.get("mode") != "diloco":
            return values
        every = sync.get("outer_every", SyncConfig.model_fields["outer_every"].default)
        fragments = sync.get("fragments", SyncConfig.model_fields["fragments"].default)
        if any(not isinstance(value, int) or isinstance(value, bool) or value < 1 for value in (every, fragments)):
            return values  # refused by the field's own check
        every *= fragments  # where the learners are alike (``OuterRounds.aligned_every``)
        values = dict(values)
        for section, names in ROUND_INTERVALS.items():
            given = values.get(section)
            model = cls.model_fields[section].annotation
            if isinstance(given, BaseModel):
                fields = {name: getattr(given, name) for name in given.model_fields_set}
            elif isinstance(given, dict):
                fields = dict(given)
            elif given is None:
                fields = {}
            else:
                continue
            for name in names:
                if name not in fields:
                    default = model.model_fields[name].default
                    fields[name] = every if (section, name) == ("checkpoint", "memory_every") and default else (
                        whole_rounds(default, every))
            values[section] = fields if not isinstance(given, BaseModel) else given.model_copy(update=fields)
        return values

    @model_validator(mode="after")
    def _check_sync(self) -> TrainConfig:
        rounds = self.sync.outer_rounds
        if rounds is None:
            return self
        sync, every = self.sync, rounds.aligned_every
        misaligned = [f"{section}.{name}={value}" for section, names in ROUND_INTERVALS.items() for name in names
                      if (value := getattr(getattr(self, section), name)) % every]
        period, between = ((f"sync.outer_every={every}", "between rounds") if sync.fragments == 1 else
                           (f"sync.outer_every x sync.fragments = {every}", "where every fragment syncs"))
        whole = f"rounds of {period}" if sync.fragments == 1 else f"{period} steps"
        problems = [  # in order: the first that holds is refused
            (rounds.every < sync.fragments, f"sync.outer_every={rounds.every} gives sync.fragments={sync.fragments} "
                                            "a turn each in a round only if it is at least as many; raise it"),
            (sync.fragments > self.model.n_layers + 2,
             f"sync.fragments={sync.fragments} cuts the model's {self.model.n_layers} blocks, its embeddings and its "
             f"output, {self.model.n_layers + 2} parts; lower sync.fragments"),
            (sync.fragments > 1 and sync.lost_learner == "drop",
             "sync.fragments > 1 and sync.lost_learner=drop: a dropped learner's samples are in the fragments "
             "synced since the learners were alike; set sync.lost_learner = \"redo\" or sync.fragments = 1"),
            (sync.sync_delay and self.scaling.uses_gpu,
             f"sync.sync_delay={sync.sync_delay} on GPUs: a delayed exchange's CUDA stream is not kept apart from the "
             "inner steps' yet, so it would not cross behind their compute; set sync.sync_delay = 0"),
            (sync.sync_delay and sync.fragments == 1,
             f"sync.sync_delay={sync.sync_delay} and sync.fragments=1: a round's only outer step is where the learners "
             "align, which is never delayed; set sync.fragments to 2 or more"),
            (sync.fragment_alpha and sync.fragments == 1,
             f"sync.fragment_alpha={sync.fragment_alpha} and sync.fragments=1: every outer step is where the learners "
             "align, which takes the global weights whole; set sync.fragments to 2 or more"),
            (sync.sync_delay >= rounds.every // sync.fragments,
             f"sync.sync_delay={sync.sync_delay}: a fragment's outer step must merge before the next fragment's turn, "
             f"at least {rounds.every // sync.fragments} steps later; lower it below that"),
            (sync.quorum or sync.grace_s, "sync.quorum and sync.grace_s: a round that does not wait for every "
                                          "learner is not built yet; set both to 0"),
            (self.compute.precision == "fp16", "compute.precision=fp16: the learners' loss scales would part ways; "
                                               "use bf16 or fp32"),
            (self.steps % every, f"steps={self.steps} is not a whole number of {whole}; "
                                 f"train {whole_rounds(self.steps, every)} steps or change outer_every"),
            (misaligned, f"{', '.join(misaligned)}: the learners hold the run's state only {between}; make "
                         f"each a multiple of {period}"),
        ]
        problem = next((text for broken, text in problems if broken), None)
        if problem:
            raise ValueError(f"sync.mode=diloco with {problem}")
        return self

    @model_validator(mode="after")
    def _faults_within_layout(self) -> TrainConfig:
        scaling = self.scaling
        faults = parse_faults(self.fault_tolerance.inject)
        check_targets(faults, scaling.max_groups, scaling.topology.ranks_per_group)
        if self.sync.outer_rounds is None and any(fault.during for fault in faults):
            raise ValueError(f"fault_tolerance.inject: during={OUTER_STEP} kills a rank inside DiLoCo's outer step; "
                             "set sync.mode = diloco or leave it out")
        return self

    def _sequence_parallel_obstacles(self) -> list[str]:
        """Why sequence parallelism would not compute what one process does, each as the
        refusal of an explicit ``scaling.sequence_parallel = true``."""
        tp, cp, dropout, seq_len = self.scaling.tp, self.scaling.cp, self.model.dropout, self.data.seq_len
        obstacles = []
        if dropout:
            obstacles.append(
                f"scaling.sequence_parallel with model.dropout={dropout:g}: each TP rank would draw "
                "dropout masks for its own share of the sequence; set model.dropout = 0 or "
                "scaling.sequence_parallel = false"
            )
        if seq_len // cp % tp:
            # under context parallelism, a rank's share of each sequence is what TP splits
            share = f"data.seq_len={seq_len}" if cp == 1 else f"a cp rank's share of data.seq_len={seq_len} ({seq_len // cp})"
            obstacles.append(
                f"scaling.sequence_parallel needs {share} divisible by scaling.tp={tp}; "
                f"change seq_len to a multiple of {self.scaling.topology.sequence_shards} or set "
                "scaling.sequence_parallel = false"
            )
        return obstacles

    @property
    def sequence_parallel(self) -> bool:
        """Whether the reference model's TP plan shards the sequence between TP regions."""
        scaling = self.scaling
        if scaling.tp == 1:
            return False
        if scaling.sequence_parallel is None:
            return not self._sequence_parallel_obstacles()
        return scaling.sequence_parallel

    @property
    def lr_schedule(self) -> LRSchedule:
        optimizer = self.optimizer
        return LRSchedule(
            peak_lr=optimizer.lr,
            warmup_steps=optimizer.warmup_steps,
            decay=optimizer.schedule,
            decay_steps=optimizer.decay_steps or self.steps,
            min_ratio=optimizer.min_lr_ratio,
        )


def replay_off(config: TrainConfig) -> str | None:
    """A start-up warning for spot checks asked of replicas that cannot hold them, which then
    check nothing (``replay_every``): None for a run of one group, which has no replica."""
    every, groups = config.integrity.replay_every, config.scaling.max_groups
    problems = [  # in order: the first that holds is said
        (config.sync.outer_rounds is not None, "sync.mode=diloco: the learners hold different weights inside a round"),
        (config.model.dropout, f"model.dropout={config.model.dropout:g}: a replay draws other random numbers than "
                               "the work it replays"),
    ]
    problem = next((text for broken, text in problems if broken), None)
    if not every or groups < MIN_GROUPS or problem is None:
        return None
    return f"integrity.replay_every={every}: no spot checks, since {problem}"


def unbalanced_experts(config: TrainConfig) -> str | None:
    """A start-up warning for a mixture trained with nothing that balances its experts: left
    alone, token-choice routing collapses onto a few of them."""
    model = config.model
    if not model.experts or model.expert_bias_rate or model.aux_loss_weight:
        return None
    return (f"model.experts={model.experts} with neither a routing bias nor a balance loss: routing tends to collapse "
            "onto a few experts; set model.expert_bias_rate (DeepSeek-V3: 0.001) or model.aux_loss_weight")


def _field_path(location: tuple) -> str:
    return ".".join(str(part) for part in location)


# A message shows the value it refuses cut short: the input may be anything a file holds.
def shown(value: Any) -> str:
    short = reprlib.Repr()  # its limits as attributes: Python 3.11's takes no arguments
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother, short.maxlong = 2, 4, 4, 60, 60, 60
    text = short.repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key" + (f"; did you mean {meant}?" if (meant := intended_key(item["loc"])) else
                                       "; remove it or check its spelling against the config reference")
        elif item["type"] in {"greater_than", "greater_than_equal"}:
            message = f"{message}, got {shown(item['input'])}; use a positive value"
        elif item["type"] in {"less_than", "less_than_equal"}:
            message = f"{message}, got {shown(item['input'])}; use a smaller value"
        elif item["type"] == "finite_number":
            message = f"{message}, got {shown(item['input'])}; inf and nan are not allowed, give a number"
        elif item["type"] == "string_too_long":
            message = f"{message}; use a shorter one"
        elif item["type"] in {"int_type", "int_parsing", "float_type", "float_parsing", "int_from_float"}:
            message = f"{message}, got {shown(item['input'])}; give a number"
        elif item["type"] in {"bool_type", "bool_parsing"}:
            message = f"{message}, got {shown(item['input'])}; give true or false"
        # A check over several sections names its fields itself.
        lines.append(f"{_field_path(item['loc'])}: {message}" if item["loc"] else message)
    return invalid_config(lines)


def intended_key(location: tuple) -> str | None:
    """The key an unknown one most likely meant: a near spelling in its own section, else the
    same name in another section (``shard`` at the top is ``scaling.shard``)."""
    *parents, name = map(str, location)
    section: Any = TrainConfig
    for part in parents:
        field = section.model_fields.get(part) if isinstance(section, type) and issubclass(section, BaseModel) else None
        section = field.annotation if field else None
    if not (isinstance(section, type) and issubclass(section, BaseModel)):
        return None
    close = difflib.get_close_matches(name, list(section.model_fields), n=1, cutoff=0.6)
    if close:
        return _field_path((*parents, close[0]))
    if not parents:
        for key, field in TrainConfig.model_fields.items():
            nested = field.annotation
            if isinstance(nested, type) and issubclass(nested, BaseModel) and name in nested.model_fields:
                return f"{key}.{name}"
    return None


def parse_config(values: dict[str, Any]) -> TrainConfig:
    """The config of ``values``, its shape checked; storage and data are not touched
    (``elastic.setup.preflight.build_config`` checks them too)."""
    try:
        return TrainConfig.model_validate(values)
    except ValidationError as error:
        raise ConfigError(describe(error)) from None

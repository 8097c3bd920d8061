"""HuggingFace Llama, Mixtral, Qwen3 and Qwen3-MoE checkpoints, out and in: the one table of
names and layouts between the reference model (``workers.model.Transformer``) and
``LlamaForCausalLM``, ``MixtralForCausalLM`` (experts), ``Qwen3ForCausalLM`` (query-key norms)
or ``Qwen3MoeForCausalLM`` (both), used by ``elastic export --format huggingface`` and by
``model.init_from``.

- Names: ``tok_embeddings`` is ``model.embed_tokens``, ``layers.N.attention.wq`` is
  ``model.layers.N.self_attn.q_proj``, and so on; with tied embeddings Llama has no
  ``lm_head`` and the output projection is the embedding. Mixtral's router is
  ``block_sparse_moe.gate`` (Qwen3-MoE's ``mlp.gate``), and each expert's weights are
  tensors of their own (``block_sparse_moe.experts.E.w1``, ``mlp.experts.E.gate_proj``): the
  reference model's stacked expert weights are theirs stacked (``expert_names``).
- Layout: the reference model rotates adjacent pairs of each head's dimensions, Llama the
  two halves, so the query and key projections' rows are permuted, as Meta's own Llama
  conversion does, and so are the weights of Qwen3's query-key norms, which scale each of a
  head's dimensions before the rotation (``rotary_heads``).
- The config: ``config.json``'s fields as the ``model`` section's (``model_fields``), and back.

``PretrainedReader`` is a DCP storage reader over a HuggingFace directory that presents it in
the reference model's names and layout: ``dcp.load`` then gives each rank only the slices
its shards hold (FSDP2 and tensor-parallel pieces alike), read lazily from the safetensors
files, so no process reads the whole model (``checkpointing.pretrained`` loads with it).
Nothing in the directory runs code: JSON and safetensors only.
"""

from __future__ import annotations

import json
import math
import os
import reprlib
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem, StorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata

from checkpointing.storage import regular_file
from elastic.core.model_shape import ModelShape

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class HuggingFaceLayout:
    """What the name table depends on, of the model's shape (``layout_of`` takes it from
    ``elastic.core.model_shape.ModelShape``): its layers, heads and tying, its query-key norms
    and its experts, which make it one of four HuggingFace families (``model_type``)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    tie_embeddings: bool
    experts: int
    dense_layers: int  # the first layers', feed-forwards without experts
    qk_norm: bool

    @property
    def model_type(self) -> str:
        """Qwen3's attention has the query-key norms; Mixtral's and Qwen3-MoE's layers experts."""
        if self.qk_norm:
            return "qwen3_moe" if self.experts else "qwen3"
        return "mixtral" if self.experts else "llama"

    def has_experts(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.dense_layers


# Per family: the router's name in a layer of experts, and each of an expert's weights (the
# reference model's w1, w2, w3) by the family's name.
ROUTER_NAMES = {"mixtral": "block_sparse_moe.gate", "qwen3_moe": "mlp.gate"}
EXPERT_WEIGHT_NAMES = {"mixtral": ("block_sparse_moe.experts", {"w1": "w1", "w2": "w2", "w3": "w3"}),
                       "qwen3_moe": ("mlp.experts", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}


def huggingface_names(layout: HuggingFaceLayout) -> dict[str, str]:
    """The reference model's parameter names -> the family's (tied: the output is the
    embedding); the stacked experts are ``expert_names``'."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "model.embed_tokens.weight" if layout.tie_embeddings else "lm_head.weight"}
    for layer in range(layout.n_layers):
        ours, theirs = f"layers.{layer}.", f"model.layers.{layer}."
        names |= {
            f"{ours}attention.wq.weight": f"{theirs}self_attn.q_proj.weight",
            f"{ours}attention.wk.weight": f"{theirs}self_attn.k_proj.weight",
            f"{ours}attention.wv.weight": f"{theirs}self_attn.v_proj.weight",
            f"{ours}attention.wo.weight": f"{theirs}self_attn.o_proj.weight",
            f"{ours}attention_norm.weight": f"{theirs}input_layernorm.weight",
            f"{ours}ffn_norm.weight": f"{theirs}post_attention_layernorm.weight",
        }
        if layout.qk_norm:
            names |= {f"{ours}attention.q_norm.weight": f"{theirs}self_attn.q_norm.weight",
                      f"{ours}attention.k_norm.weight": f"{theirs}self_attn.k_norm.weight"}
        if layout.has_experts(layer):
            names[f"{ours}feed_forward.router.weight"] = f"{theirs}{ROUTER_NAMES[layout.model_type]}.weight"
        else:
            names |= {
                f"{ours}feed_forward.w1.weight": f"{theirs}mlp.gate_proj.weight",
                f"{ours}feed_forward.w2.weight": f"{theirs}mlp.down_proj.weight",
                f"{ours}feed_forward.w3.weight": f"{theirs}mlp.up_proj.weight",
            }
    return names


def expert_names(layout: HuggingFaceLayout) -> dict[str, tuple[str, ...]]:
    """The reference model's stacked expert weights -> the family's tensor of each expert."""
    if not layout.experts:
        return {}
    prefix, weight_names = EXPERT_WEIGHT_NAMES[layout.model_type]
    return {f"layers.{layer}.feed_forward.experts.{ours}": tuple(
                f"model.layers.{layer}.{prefix}.{expert}.{theirs}.weight" for expert in range(layout.experts))
            for layer in range(layout.n_layers) if layout.has_experts(layer)
            for ours, theirs in weight_names.items()}


def rotary_heads(name: str, layout: HuggingFaceLayout) -> int | None:
    """The heads of a tensor whose rows are heads' dimensions in rotary order, else None: the
    query and key projections', and the query-key norms' weights (one head's dimensions).
    The families this table holds have no query or key biases (``attention_bias``)."""
    if name.endswith("attention.wq.weight"):
        return layout.n_heads
    if name.endswith("attention.wk.weight"):
        return layout.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection (or a norm's weight), from adjacent-pair rotary order
    to halves order."""
    rows, rest = weight.shape[0], weight.shape[1:]
    return weight.view(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def halves_rows(rows: range, total_rows: int, heads: int) -> torch.Tensor:
    """For rows of a projection in adjacent-pair order, the rows of Llama's halves order that
    hold them: row ``i`` of a head is pair ``i // 2``'s ``i % 2``-th element."""
    head_dim = total_rows // heads
    index = torch.arange(rows.start, rows.stop)
    within = index % head_dim
    return index - within + (within % 2) * (head_dim // 2) + within // 2


def huggingface_state(state: dict[str, torch.Tensor], layout: HuggingFaceLayout) -> dict[str, torch.Tensor]:
    """The reference model's whole state under its HuggingFace family's names and layout."""
    out = {}
    for ours, theirs in huggingface_names(layout).items():
        if ours == "output.weight" and layout.tie_embeddings:
            continue
        heads = rotary_heads(ours, layout)
        out[theirs] = to_halves(state[ours], heads) if heads else state[ours]
    for ours, per_expert in expert_names(layout).items():
        out |= dict(zip(per_expert, state[ours].unbind(0)))
    return out


def layout_of(shape: ModelShape) -> HuggingFaceLayout:
    """The name table of a model of ``shape`` (a ``model`` section's, or ``ModelArgs``)."""
    return HuggingFaceLayout(shape.n_layers, shape.n_heads, shape.kv_heads, shape.tie_embeddings, shape.experts,
                             shape.dense_layers, shape.qk_norm)


def family_obstacle(shape: ModelShape) -> str | None:
    """Why no HuggingFace family computes what the reference model of ``shape`` does, or
    None: experts are Mixtral's (no query-key norms: every layer, all normalised) or
    Qwen3-MoE's, and neither has shared experts, sigmoid scores or a routing bias."""
    if not shape.experts:
        return None
    differing = [name for name, theirs in (("shared_experts", 0), ("router_scores", "softmax"),
                                           ("expert_bias_rate", 0.0)) if getattr(shape, name) != theirs]
    if not shape.qk_norm:  # Mixtral's
        differing += [name for name, theirs in (("dense_layers", 0), ("normalize_top_k", True))
                      if getattr(shape, name) != theirs]
    if not differing:
        return None
    return (f"experts are written as Mixtral's (every layer, no query-key norms) or Qwen3-MoE's (with them), "
            f"neither of which has this run's {', '.join(f'model.{name}' for name in differing)}")


def config_json(shape: ModelShape, max_seq_len: int, max_position_embeddings: int | None = None) -> dict:
    """``config.json`` of a model of ``shape`` (a ``model`` section's, or ``ModelArgs``), trained
    on sequences of ``max_seq_len``, made for ``max_position_embeddings`` (the ``model``
    section's, where the run started from a source that says); its family is
    ``layout_of(shape).model_type`` (``family_obstacle`` says first whether one holds it)."""
    scaling = shape.rope_scaling
    heads, kv_heads = shape.n_heads, shape.kv_heads
    model_type = layout_of(shape).model_type
    experts, expert_hidden = shape.experts, shape.expert_width
    family = {
        "llama": {"intermediate_size": shape.ffn_hidden, "mlp_bias": False},
        "mixtral": {"num_local_experts": experts, "num_experts_per_tok": shape.experts_per_token,
                    "intermediate_size": expert_hidden, "output_router_logits": False,
                    "router_jitter_noise": 0.0, "sliding_window": None},
        "qwen3": {"intermediate_size": shape.ffn_hidden, "use_sliding_window": False, "sliding_window": None},
        "qwen3_moe": {"num_experts": experts, "num_experts_per_tok": shape.experts_per_token,
                      "intermediate_size": shape.ffn_hidden, "moe_intermediate_size": expert_hidden,
                      "decoder_sparse_step": 1, "mlp_only_layers": list(range(shape.dense_layers)),
                      "norm_topk_prob": shape.normalize_top_k, "output_router_logits": False,
                      "use_sliding_window": False, "sliding_window": None},
    }[model_type]
    return {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        **family,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": shape.head_width,
        "hidden_act": "silu",
        # The length the model is made for, which HuggingFace bounds generation with: the
        # source's when the run started from one (its config.json's), or the length the run
        # trained on where that is longer.
        "max_position_embeddings": max(max_seq_len, max_position_embeddings or max_seq_len),
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_len},
        "tie_word_embeddings": shape.tie_embeddings,
        "attention_bias": False,
    }


def model_fields(config: dict) -> dict[str, Any]:
    """The ``model`` section's fields of a HuggingFace Llama, Mixtral, Qwen3 or Qwen3-MoE
    ``config.json`` (``elastic.core.model_shape.ModelShape``'s, those it gives, and
    ``max_position_embeddings``); ValueError names what the reference model cannot compute, or a field
    that is not what the family's is."""
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_NAME} holds a {type(config).__name__}, not a JSON object")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        positive_int(config, name, required=True)
    for name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        positive_int(config, name, required=False)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(f"model_type is {reprlib.repr(model_type)}: only {', '.join(map(repr, ARCHITECTURES))} "
                         "checkpoints load into the reference model")
    qwen3 = model_type.startswith("qwen3")
    experts = experts_of(config, model_type)
    # Qwen3's configs carry a sliding_window that only use_sliding_window turns on.
    sliding = ("use_sliding_window", False) if qwen3 else ("sliding_window", None)
    unsupported = [f"{key}={reprlib.repr(config.get(key))}" for key, ours in
                   (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), sliding)
                   if config.get(key, ours) != ours]
    rope_key, rope = rope_section(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"{rope_key}.rope_type={reprlib.repr(rope_type)}")
    if model_type == "qwen3_moe" and config.get("decoder_sparse_step", 1) != 1:
        unsupported.append(f"decoder_sparse_step={reprlib.repr(config['decoder_sparse_step'])} (experts in every "
                           "layer after the first mlp_only_layers)")
    dense_layers = (config.get("mlp_only_layers") or []) if model_type == "qwen3_moe" else []
    if not isinstance(dense_layers, list) or not all(type(layer) is int for layer in dense_layers):
        raise ValueError(f"mlp_only_layers is {reprlib.repr(dense_layers)} in {CONFIG_NAME}; it must be a list of "
                         "layer numbers")
    if dense_layers != list(range(len(dense_layers))):
        unsupported.append(f"mlp_only_layers={reprlib.repr(dense_layers)} (the reference model's dense layers are "
                           "the first)")
    if unsupported:
        raise ValueError(f"the reference model does not compute {CONFIG_NAME}'s {', '.join(unsupported)}")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    # transformers 5 keeps the base inside rope_parameters; earlier versions beside it.
    theta_in, theta_key = (rope, f"{rope_key}.rope_theta") if "rope_theta" in rope else (config, "rope_theta")
    return {
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads", heads),
        "head_dim": None if head_dim * heads == config["hidden_size"] else head_dim,
        "qk_norm": qwen3,
        "ffn_hidden": config["intermediate_size"],
        **experts,
        **({"dense_layers": len(dense_layers)} if dense_layers else {}),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "tie_embeddings": flag(config, "tie_word_embeddings", False),
        "norm_eps": number(config, "rms_norm_eps", 1e-6, positive=True),
        "rope_theta": number(theta_in, "rope_theta", 10000.0, positive=True, shown_as=theta_key),
        "rope_scaling": None if rope_type != "llama3" else {
            **{name: number(rope, name, None, positive=True, shown_as=f"{rope_key}.{name}")
               for name in ("factor", "low_freq_factor", "high_freq_factor")},
            "original_max_len": positive_int(rope, "original_max_position_embeddings", required=True,
                                             shown_as=f"{rope_key}.original_max_position_embeddings")},
    }


def rope_section(config: dict) -> tuple[str, dict]:
    """The key and contents of ``config.json``'s RoPE settings: transformers 5 writes
    ``rope_parameters``, earlier versions ``rope_scaling`` (null or absent: none)."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(key) or {}
    if not isinstance(rope, dict):
        raise ValueError(f"{key} is {reprlib.repr(rope)} in {CONFIG_NAME}; it must be a JSON object or null")
    return key, rope


# Settings that HuggingFace's models apply in training alone, which the reference model has no
# counterpart of: the weights compute the same without them, so a run from them is told, not
# refused. Per setting: the families that read it, and what a run does instead.
TRAINING_ONLY = {
    "attention_dropout": (tuple(ARCHITECTURES), "this trainer trains without dropout on the attention weights "
                                                "(model.dropout drops the embeddings and residual branches)"),
    "router_jitter_noise": (("mixtral",), "this trainer routes tokens without jitter"),
}


def unapplied_settings(config: dict) -> list[str]:
    """A warning line for each training-time setting of ``config.json`` (``model_fields``
    read it first) that a run from it does not apply; ValueError for one that is not a
    number."""
    lines = []
    for name, (families, instead) in TRAINING_ONLY.items():
        value = number(config, name, 0.0, positive=False, nullable=True) if config["model_type"] in families else 0
        if value:
            lines.append(f"{CONFIG_NAME}'s {name}={value:g} is not applied: {instead}")
    return lines


def experts_of(config: dict, model_type: str) -> dict[str, Any]:
    """The ``model`` section's expert fields of a family's ``config.json``: Mixtral's every
    layer softmax-routed experts as wide as ``intermediate_size``, normalised; Qwen3-MoE's
    ``moe_intermediate_size`` wide, normalised as ``norm_topk_prob`` says. A dense family's:
    none."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {"experts": 0}
    # transformers 5 writes num_local_experts for Qwen3-MoE too; the published configs num_experts
    count = "num_experts" if model_type == "qwen3_moe" and "num_experts" in config else "num_local_experts"
    positive_int(config, count, required=True)
    positive_int(config, "num_experts_per_tok", required=True)
    fields = {"experts": config[count], "experts_per_token": config["num_experts_per_tok"], "router_scores": "softmax"}
    if model_type == "qwen3_moe":
        positive_int(config, "moe_intermediate_size", required=True)
        fields |= {"expert_hidden": config["moe_intermediate_size"],
                   "normalize_top_k": flag(config, "norm_topk_prob", False)}
    else:
        # Mixtral's intermediate_size is its experts' width, and it has no dense feed-forward.
        fields |= {"expert_hidden": config["intermediate_size"]}
    return fields


def positive_int(config: dict, name: str, required: bool, shown_as: str | None = None) -> int | None:
    """``config[name]``, a positive integer (absent or null: None, where not ``required``);
    ``shown_as``: its name in messages, where it lies deeper than the top of config.json."""
    value = config.get(name)
    if value is None and not required:
        return None
    if value is None:
        raise KeyError(shown_as or name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{shown_as or name} is {reprlib.repr(value)} in {CONFIG_NAME}; it must be a positive integer")
    return value


def number(config: dict, name: str, default: float | None, *, positive: bool, nullable: bool = False,
           shown_as: str | None = None) -> float:
    """``config[name]`` as a float: a finite number above zero (``positive``) or not below it;
    ``default`` where it is absent (None: it is required), or null too where ``nullable``."""
    value = config.get(name)
    if value is None and (nullable or name not in config):
        if default is None:
            raise KeyError(shown_as or name)
        value = default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (positive and value == 0)):
        raise ValueError(f"{shown_as or name} is {reprlib.repr(value)} in {CONFIG_NAME}; it must be a "
                         f"{'positive number' if positive else 'number, zero or more'}")
    return float(value)


def flag(config: dict, name: str, default: bool) -> bool:
    value = config.get(name, default)
    if not isinstance(value, bool):
        raise ValueError(f"{name} is {reprlib.repr(value)} in {CONFIG_NAME}; it must be true or false")
    return value


def read_config(directory: str) -> dict:
    return read_json(os.path.join(directory, CONFIG_NAME))


def read_json(path: str) -> Any:
    """A JSON file of a model directory; ValueError naming it when it is not JSON, or nests
    deeper than Python's parser recurses (it would raise RecursionError)."""
    with open(regular_file(path), encoding="utf-8") as file:
        try:
            return json.load(file)
        except RecursionError:
            raise ValueError(f"{os.path.basename(path)} nests its arrays or objects too deeply to read: "
                             "not a HuggingFace file") from None
        except ValueError as error:  # not JSON, or not UTF-8
            raise ValueError(f"{os.path.basename(path)} is not JSON: {error}") from None


# safetensors dtypes that hold a weight as the model computes it; anything else (integers,
# booleans, float8 without its scales) would be cast into nonsense without a word.
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}


def weight_files(directory: str) -> dict[str, str]:
    """Each tensor's safetensors file in ``directory``: from the index of a sharded checkpoint,
    else the one ``model.safetensors``. ValueError for an index that is not a map of names to
    files, or that names a file outside the directory or one that is not a regular file (a
    symlink out of it, a device, a FIFO): nothing outside the model directory is read."""
    index = os.path.join(directory, INDEX_NAME)
    if not os.path.exists(index):
        path = os.path.join(directory, WEIGHTS_NAME)
        return dict.fromkeys(safetensors_header(path), path)
    contents = read_json(index)
    weight_map = contents.get("weight_map") if isinstance(contents, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(value, str) for value in weight_map.values()):
        raise ValueError(f"{INDEX_NAME} has no weight_map of tensor names to file names")
    inside = os.path.realpath(directory) + os.sep
    for file in set(weight_map.values()):
        path = os.path.realpath(os.path.join(directory, file))
        if not path.startswith(inside):
            raise ValueError(f"{INDEX_NAME} names {file!r}, outside the model directory: refused, not read")
        if not os.path.isfile(path):
            raise ValueError(f"{INDEX_NAME} names {file!r}, which is not a file in the model directory")
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}


def safetensors_header(path: str) -> dict[str, tuple[torch.Size, str]]:
    """Each tensor's shape and safetensors dtype in the file at ``path`` (its header alone)."""
    from safetensors import safe_open

    with safe_open(regular_file(path), framework="pt") as weights:
        return {name: (torch.Size(weights.get_slice(name).get_shape()), weights.get_slice(name).get_dtype())
                for name in weights.keys()}


def stored_shapes(directory: str, layout: HuggingFaceLayout,
                  files: dict[str, str] | None = None) -> dict[str, torch.Size]:
    """The shape of each of the reference model's tensors in ``directory`` (by its own name):
    ValueError when a tensor is missing or not stored as floating point. ``files``: its
    ``weight_files``, where the caller has them."""
    names, stacked = huggingface_names(layout), expert_names(layout)
    wanted = {*names.values(), *(theirs for per_expert in stacked.values() for theirs in per_expert)}
    files = weight_files(directory) if files is None else files
    missing = sorted(wanted - files.keys())
    if missing:
        raise ValueError(f"the weights lack {len(missing)} of the model's tensors, such as {missing[0]!r}")
    headers = {}
    for path in {files[theirs] for theirs in wanted}:  # each file's header read once
        headers |= safetensors_header(path)
    for theirs in sorted(wanted):
        if theirs not in headers:
            raise ValueError(f"{os.path.basename(files[theirs])} lacks {theirs!r}, which the index places there")
        if headers[theirs][1] not in FLOAT_DTYPES:
            raise ValueError(f"{theirs!r} is stored as {headers[theirs][1]}, not a floating-point type "
                             f"({', '.join(sorted(FLOAT_DTYPES))})")
    shapes = {ours: headers[theirs][0] for ours, theirs in names.items()}
    for ours, per_expert in stacked.items():
        expert_shapes = {headers[theirs][0] for theirs in per_expert}
        if len(expert_shapes) > 1:
            raise ValueError(f"the experts of {per_expert[0].rsplit('.experts.', 1)[0]} differ in shape: "
                             f"{sorted(map(list, expert_shapes))}")
        shapes[ours] = torch.Size([len(per_expert), *expert_shapes.pop()])
    return shapes


class PretrainedReader(StorageReader):
    """A HuggingFace directory as a DCP checkpoint of the reference model's state: its
    names and rotary layout, each requested slice read from the safetensors files alone."""

    def __init__(self, directory: str, layout: HuggingFaceLayout):
        super().__init__()
        self.directory, self.layout = directory, layout
        self.names = huggingface_names(layout)
        self.stacked = expert_names(layout)  # a stacked expert weight: its experts' stored tensors
        self.files: dict[str, str] = {}
        self.bytes_read = 0

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.files = weight_files(self.directory)
        shapes = stored_shapes(self.directory, self.layout, self.files)
        tensors = {ours: TensorStorageMetadata(TensorProperties(dtype=torch.float32), shape,
                                               [ChunkStorageMetadata(torch.Size([0] * len(shape)), shape)])
                   for ours, shape in shapes.items()}
        return Metadata(state_dict_metadata=tensors)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import safe_open

        with ExitStack() as open_files:
            opened: dict[str, Any] = {}

            def stored(theirs: str):
                path = self.files[theirs]
                if path not in opened:  # each file opened once
                    opened[path] = open_files.enter_context(safe_open(path, framework="pt"))
                return opened[path].get_slice(theirs)

            for item in plan.items:
                piece = self._piece(stored, item)
                target = planner.resolve_tensor(item).detach()
                target.copy_(piece)
                planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _piece(self, stored_slice, item: ReadItem) -> torch.Tensor:
        """The requested box of a tensor in the reference model's layout; of a stacked expert
        weight, the box's experts' boxes, stacked."""
        ours = item.storage_index.fqn
        boxes = [slice(offset, offset + length) for offset, length in zip(item.storage_offsets, item.lengths)]
        if ours in self.stacked:
            return torch.stack([self._read(stored_slice, theirs, tuple(boxes[1:]))
                                for theirs in self.stacked[ours][boxes[0]]])
        theirs = self.names[ours]
        heads = rotary_heads(ours, self.layout)
        if heads is None:
            return self._read(stored_slice, theirs, tuple(boxes))
        rows = halves_rows(range(boxes[0].start, boxes[0].stop), stored_slice(theirs).get_shape()[0], heads)
        first, last = int(rows.min()), int(rows.max()) + 1  # the whole heads the rows lie in
        return self._read(stored_slice, theirs, (slice(first, last), *boxes[1:]))[rows - first]

    def _read(self, stored_slice, theirs: str, box: tuple[slice, ...]) -> torch.Tensor:
        """A box of the stored tensor ``theirs``: ValueError where it holds a NaN or an
        infinity, which training would spread to every weight (checked here, as each rank reads
        its slices: no process reads the whole model)."""
        piece = stored_slice(theirs)[box]
        self.bytes_read += piece.nbytes
        if not torch.isfinite(piece).all():
            raise ValueError(f"{theirs!r} in {os.path.basename(self.files[theirs])} holds NaN or infinite values; "
                             "download the checkpoint again, or start from another")
        return piece

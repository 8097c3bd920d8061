"""HuggingFace Llama and Mixtral checkpoints, out and in: the one table of names and layouts
between the reference model (``workers.model.Transformer``) and ``LlamaForCausalLM`` or, with
experts, ``MixtralForCausalLM``, used by ``elastic export --format huggingface`` and by
``model.init_from``.

- Names: ``tok_embeddings`` is ``model.embed_tokens``, ``layers.N.attention.wq`` is
  ``model.layers.N.self_attn.q_proj``, and so on; with tied embeddings Llama has no
  ``lm_head`` and the output projection is the embedding. Mixtral's router is
  ``block_sparse_moe.gate``, and each expert's weights are tensors of their own
  (``block_sparse_moe.experts.E.w1``): the reference model's stacked expert weights are
  theirs stacked (``expert_names``).
- Layout: the reference model rotates adjacent pairs of each head's dimensions, Llama the
  two halves, so the query and key projections' rows are permuted, as Meta's own Llama
  conversion does.
- The config: ``config.json``'s fields as the ``model`` section's (``model_fields``), and back.

``PretrainedReader`` is a DCP storage reader over a HuggingFace directory that presents it in
the reference model's names and layout: ``dcp.load`` then gives each rank only the slices
its shards hold (FSDP2 and tensor-parallel pieces alike), read lazily from the safetensors
files, so no process reads the whole model (``checkpointing.pretrained`` loads with it).
Nothing in the directory runs code: JSON and safetensors only.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import LoadPlan, LoadPlanner, ReadItem, StorageReader
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class LlamaLayout:
    """What the name table depends on: the reference model's layers, heads and tying, and its
    experts: a model with experts in every layer is Mixtral's (``MixtralForCausalLM``)."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    tie_embeddings: bool
    experts: int = 0


def llama_names(layout: LlamaLayout) -> dict[str, str]:
    """The reference model's parameter names -> Llama's (tied: the output is the embedding)."""
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
        if layout.experts:
            names[f"{ours}feed_forward.router.weight"] = f"{theirs}block_sparse_moe.gate.weight"
        else:
            names |= {
                f"{ours}feed_forward.w1.weight": f"{theirs}mlp.gate_proj.weight",
                f"{ours}feed_forward.w2.weight": f"{theirs}mlp.down_proj.weight",
                f"{ours}feed_forward.w3.weight": f"{theirs}mlp.up_proj.weight",
            }
    return names


def expert_names(layout: LlamaLayout) -> dict[str, tuple[str, ...]]:
    """The reference model's stacked expert weights -> Mixtral's tensor of each expert."""
    return {f"layers.{layer}.feed_forward.experts.{weight}": tuple(
                f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{weight}.weight"
                for expert in range(layout.experts))
            for layer in range(layout.n_layers if layout.experts else 0) for weight in ("w1", "w2", "w3")}


def rotary_heads(name: str, layout: LlamaLayout) -> int | None:
    """The heads of a projection whose rows are in rotary order (query, key), else None."""
    if name.endswith("attention.wq.weight"):
        return layout.n_heads
    if name.endswith("attention.wk.weight"):
        return layout.n_kv_heads
    return None


def to_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection, from adjacent-pair rotary order to halves order."""
    rows, columns = weight.shape
    return weight.view(heads, rows // heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def halves_rows(rows: range, total_rows: int, heads: int) -> torch.Tensor:
    """For rows of a projection in adjacent-pair order, the rows of Llama's halves order that
    hold them: row ``i`` of a head is pair ``i // 2``'s ``i % 2``-th element."""
    head_dim = total_rows // heads
    index = torch.arange(rows.start, rows.stop)
    within = index % head_dim
    return index - within + (within % 2) * (head_dim // 2) + within // 2


def huggingface_state(state: dict[str, torch.Tensor], layout: LlamaLayout) -> dict[str, torch.Tensor]:
    """The reference model's whole state under Llama's (or Mixtral's) names and layout."""
    out = {}
    for ours, theirs in llama_names(layout).items():
        if ours == "output.weight" and layout.tie_embeddings:
            continue
        heads = rotary_heads(ours, layout)
        out[theirs] = to_halves(state[ours], heads) if heads else state[ours]
    for ours, per_expert in expert_names(layout).items():
        out |= dict(zip(per_expert, state[ours].unbind(0)))
    return out


def config_json(fields: dict[str, Any], max_seq_len: int) -> dict:
    """``config.json`` of a model whose ``model`` section (or ``ModelArgs``) has ``fields``,
    trained on sequences of ``max_seq_len``."""
    scaling = fields.get("rope_scaling")
    heads, kv_heads = fields["n_heads"], fields.get("n_kv_heads") or fields["n_heads"]
    experts = fields.get("experts") or 0
    mixtral = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
               "num_experts_per_tok": fields.get("experts_per_token"), "output_router_logits": False,
               "router_jitter_noise": 0.0, "sliding_window": None}
    return {
        **(mixtral if experts else {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}),
        "vocab_size": fields["vocab_size"],
        "hidden_size": fields["dim"],
        # an expert's width, in a mixture of experts
        "intermediate_size": (fields.get("expert_hidden") or fields["ffn_hidden"]) if experts else fields["ffn_hidden"],
        "num_hidden_layers": fields["n_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": fields["dim"] // heads,
        "hidden_act": "silu",
        # The length the model is made for, which HuggingFace bounds generation with: the
        # source's when the run started from one (its config.json's), or the length the run
        # trained on where that is longer.
        "max_position_embeddings": max(max_seq_len, fields.get("max_position_embeddings") or max_seq_len),
        "rms_norm_eps": fields["norm_eps"],
        "rope_theta": fields["rope_theta"],
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling["factor"], "low_freq_factor": scaling["low_freq_factor"],
            "high_freq_factor": scaling["high_freq_factor"],
            "original_max_position_embeddings": scaling["original_max_len"]},
        "tie_word_embeddings": fields["tie_embeddings"],
        "attention_bias": False,
        "mlp_bias": False,
    }


def model_fields(config: dict) -> dict[str, Any]:
    """The ``model`` section's fields of a HuggingFace Llama ``config.json``; ValueError names
    what the reference model cannot compute, or a field that is not what Llama's is."""
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG_NAME} holds a {type(config).__name__}, not a JSON object")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        positive_int(config, name, required=True)
    for name in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        positive_int(config, name, required=False)
    model_type = config.get("model_type")
    if model_type not in ("llama", "mixtral"):
        raise ValueError(f"model_type is {model_type!r}: only Llama-family checkpoints (model_type 'llama', or "
                         "'mixtral' with experts) load into the reference model")
    mixtral = model_type == "mixtral"
    if mixtral:
        positive_int(config, "num_local_experts", required=True)
        positive_int(config, "num_experts_per_tok", required=True)
    unsupported = [f"{key}={config.get(key)!r}" for key, ours in
                   (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False), ("sliding_window", None))
                   if config.get(key, ours) != ours]
    heads = config["num_attention_heads"]
    if (config.get("head_dim") or config["hidden_size"] // heads) * heads != config["hidden_size"]:
        unsupported.append(f"head_dim={config['head_dim']!r} (not hidden_size / num_attention_heads)")
    # transformers 5 writes rope_parameters (the base inside it); earlier versions rope_theta
    # and rope_scaling.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        unsupported.append(f"rope_type={rope_type!r}")
    if unsupported:
        raise ValueError(f"the reference model does not compute {', '.join(unsupported)}")
    return {
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "n_layers": config["num_hidden_layers"],
        "n_heads": heads,
        "n_kv_heads": config.get("num_key_value_heads", heads),
        "ffn_hidden": config["intermediate_size"],
        # Mixtral's: every layer's feed-forward a softmax-routed mixture of experts that wide
        "experts": config["num_local_experts"] if mixtral else 0,
        **({"experts_per_token": config["num_experts_per_tok"], "router_scores": "softmax"} if mixtral else {}),
        "max_position_embeddings": config.get("max_position_embeddings"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "rope_theta": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "rope_scaling": None if rope_type != "llama3" else {
            "factor": float(rope["factor"]), "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_len": int(rope["original_max_position_embeddings"])},
    }


def positive_int(config: dict, name: str, required: bool) -> None:
    value = config.get(name)
    if value is None and not required:
        return
    if value is None:
        raise KeyError(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} is {value!r} in {CONFIG_NAME}; it must be a positive integer")


def read_config(directory: str) -> dict:
    with open(os.path.join(directory, CONFIG_NAME)) as file:
        return json.load(file)


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
    with open(index) as file:
        contents = json.load(file)
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

    with safe_open(path, framework="pt") as weights:
        return {name: (torch.Size(weights.get_slice(name).get_shape()), weights.get_slice(name).get_dtype())
                for name in weights.keys()}


def stored_shapes(directory: str, layout: LlamaLayout, files: dict[str, str] | None = None) -> dict[str, torch.Size]:
    """The shape of each of the reference model's tensors in ``directory`` (by its own name):
    ValueError when a tensor is missing or not stored as floating point. ``files``: its
    ``weight_files``, where the caller has them."""
    names, stacked = llama_names(layout), expert_names(layout)
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
    """A HuggingFace Llama directory as a DCP checkpoint of the reference model's state: its
    names and rotary layout, each requested slice read from the safetensors files alone."""

    def __init__(self, directory: str, layout: LlamaLayout):
        super().__init__()
        self.directory, self.layout = directory, layout
        self.names = llama_names(layout)
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
            pieces = [stored_slice(theirs)[tuple(boxes[1:])] for theirs in self.stacked[ours][boxes[0]]]
            self.bytes_read += sum(piece.nbytes for piece in pieces)
            return torch.stack(pieces)
        stored = stored_slice(self.names[ours])
        heads = rotary_heads(ours, self.layout)
        if heads is None:
            piece = stored[tuple(boxes)]
            self.bytes_read += piece.nbytes
            return piece
        rows = halves_rows(range(boxes[0].start, boxes[0].stop), stored.get_shape()[0], heads)
        first, last = int(rows.min()), int(rows.max()) + 1  # the whole heads the rows lie in
        block = stored[(slice(first, last), *boxes[1:])]
        self.bytes_read += block.nbytes
        return block[rows - first]

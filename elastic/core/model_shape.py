"""The model's shape: the one record of the reference model's fields (its widths, layers, heads,
vocabulary, experts and the settings the model is built with), their defaults, their bounds and
the rules derived from them.

Everyone else reads the fields from here instead of listing them again:

- the config's ``model`` section (``elastic.setup.config.ModelConfig``) is built from
  ``ModelShape``'s fields, each validated within the bounds its ``bounded`` default gives,
  and gives its ``shape``;
- the reference model's ``workers.model.ModelArgs`` is a ``ModelShape`` and the sequence length
  it computes RoPE for (``elastic.setup.hooks.model_args`` makes one of the config);
- HuggingFace's ``config.json`` (``checkpointing.huggingface``) is read into these fields and
  written from a ``ModelShape``;
- the experts (``workers.experts``) and the memory estimate (``elastic.setup.memory_estimate``)
  read a shape and its rules (``ShapeRules``).

``tests/test_layout_owner.py`` fails a class elsewhere that restates the fields.

Pure: no pydantic, no torch (``tests/test_imports.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal


def bounded(default: Any, **bounds: float) -> Any:
    """A field's default, and the bounds the config validates it within (``gt``, ``ge``, ``lt``,
    ``le``: pydantic's ``Field`` takes them as they are)."""
    return field(default=default, metadata=bounds)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3`` in a HuggingFace config), which
    stretches a model trained at ``original_max_len`` positions to longer contexts:
    wavelengths longer than ``original_max_len / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``original_max_len / high_freq_factor`` kept, and those
    between blended smoothly (``workers.model.scaled_frequencies``)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


class ShapeRules:
    """The rules derived from the shape's fields, for whatever holds them: a ``ModelShape``, and
    the config's ``model`` section (a pydantic model, which would take annotations here for
    fields of its own: so none)."""

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_width(self) -> int:
        """Each attention head's width: ``head_dim``, else ``dim / n_heads``."""
        return self.head_dim or self.dim // self.n_heads

    @property
    def expert_width(self) -> int:
        """Each expert's SwiGLU's width: ``expert_hidden``, else ``ffn_hidden``."""
        return self.expert_hidden or self.ffn_hidden

    @property
    def shared_width(self) -> int:
        """The shared experts' one SwiGLU's width (``workers.experts.MoE``)."""
        return self.expert_width * self.shared_experts

    def has_experts(self, layer: int) -> bool:
        return self.experts > 0 and layer >= self.dense_layers



@dataclass(frozen=True)
class ModelShape(ShapeRules):
    vocab_size: int = bounded(256, gt=0, le=2**20)
    dim: int = bounded(64, gt=0, le=2**16)
    n_layers: int = bounded(2, gt=0, le=1024)
    n_heads: int = bounded(4, gt=0, le=1024)
    n_kv_heads: int | None = bounded(None, gt=0, le=1024)  # unset: n_heads (``kv_heads``)
    # each attention head's width (unset: dim / n_heads, ``head_width``; Qwen3's is its own)
    head_dim: int | None = bounded(None, gt=0, le=4096)
    qk_norm: bool = False  # Qwen3's RMSNorm over each head's query and key, before RoPE
    ffn_hidden: int = bounded(192, gt=0, le=2**18)
    tie_embeddings: bool = False
    norm_eps: float = bounded(1e-5, gt=0)  # RMSNorm's epsilon
    rope_theta: float = bounded(10000.0, gt=0)  # RoPE's base: Llama 3's is 500000
    rope_scaling: RopeScaling | None = None  # Llama 3.1/3.2's frequency scaling; None: none
    # Mixture of experts (workers.experts.MoE) in place of the feed-forward of every layer from
    # dense_layers on; 0 experts: a dense model. expert_hidden: each expert's width (unset:
    # ffn_hidden, ``expert_width``); router_scores: softmax (Qwen3-MoE, Mixtral) or sigmoid
    # (DeepSeek-V3).
    experts: int = bounded(0, ge=0, le=4096)
    experts_per_token: int = bounded(2, gt=0, le=64)
    expert_hidden: int | None = bounded(None, gt=0, le=2**18)
    shared_experts: int = bounded(0, ge=0, le=64)
    dense_layers: int = bounded(0, ge=0, le=1024)
    router_scores: Literal["softmax", "sigmoid"] = "softmax"
    # the chosen experts' weights scaled to sum to one (Qwen3-MoE's norm_topk_prob; Mixtral's
    # and DeepSeek-V3's always are)
    normalize_top_k: bool = True
    # DeepSeek-V3's auxiliary-loss-free balancing: each expert's routing bias moves by this
    # much a step against its load, from the tokens every rank and group routed (0: off;
    # DeepSeek-V3 used 0.001)
    expert_bias_rate: float = bounded(0.0, ge=0, le=1.0)
    # DeepSeek-V3's sequence-wise balance loss, this much of it added to the gradient (the
    # recorded loss leaves it out; 0: none; DeepSeek-V3 used 0.0001)
    aux_loss_weight: float = bounded(0.0, ge=0, le=1.0)
    # on the embeddings and each block's residual branches; draws from the rank's generators,
    # which steps, heals and checkpoints carry (workers.rng)
    dropout: float = bounded(0.0, ge=0, lt=1)

    def __post_init__(self):
        if isinstance(self.rope_scaling, Mapping):  # as a dump or model_args.json holds it
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> ModelShape:
        """The shape of a mapping that holds its fields among others (a ``model`` section's
        dump, ``ModelArgs``' ``asdict``); a field it leaves out takes its default."""
        return cls(**{name: values[name] for name in SHAPE_FIELDS if name in values})

    def fields(self) -> dict[str, Any]:
        """The fields by name, as they are (``rope_scaling`` a ``RopeScaling``)."""
        return {name: getattr(self, name) for name in SHAPE_FIELDS}


SHAPE_FIELDS = {spec.name: spec for spec in fields(ModelShape)}

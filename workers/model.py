"""A Llama-style decoder in plain single-device PyTorch.

Parallelism is applied from outside by ``workers.parallelize``; nothing here knows about
meshes. Attention infers its local head count from the projected width, so the same code
runs whole or with q/k/v sharded column-wise across tensor-parallel ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (``rope_type: llama3`` in a HuggingFace config), which
    stretches a model trained at ``original_max_len`` positions to longer contexts:
    wavelengths longer than ``original_max_len / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``original_max_len / high_freq_factor`` kept, and those
    between blended smoothly."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_len: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_hidden: int = 192
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # as model_args.json holds it
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def rope_frequencies(head_dim: int, seq_len: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """(cos, sin) of each position's angles, shape (seq_len, head_dim // 2, 2).

    Real arithmetic rather than complex numbers: torch.compile generates no code for
    complex operators and would fall back to eager kernels for every rotation.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaled_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def scaled_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """``inv_freq`` under Llama 3.1's scaling (see ``RopeScaling``), as Meta's reference code
    computes it."""
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = scaling.original_max_len / scaling.low_freq_factor
    short_wavelength = scaling.original_max_len / scaling.high_freq_factor
    smooth = (scaling.original_max_len / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(wavelength < short_wavelength, inv_freq,
                       torch.where(wavelength > long_wavelength, inv_freq / scaling.factor, blended))


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) pairs by the position's angle."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs.unbind(-1)
    cos, sin = freqs[: x.shape[1]].view(1, x.shape[1], 1, -1, 2).unbind(-1)
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.head_dim = args.head_dim
        self.kv_repeats = args.n_heads // args.n_kv_heads
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        k = k.repeat_interleave(self.kv_repeats, dim=2)
        v = v.repeat_interleave(self.kv_repeats, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def dropout(p: float) -> nn.Module:
    # No module at all when off: no random draws, nothing for compile to trace.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.dropout = dropout(args.dropout)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), freqs))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.dropout = dropout(args.dropout)
        # A dict keyed by layer number: a pipeline stage keeps only its own layers
        # (``workers.pipeline``), under the names they have in the whole model.
        self.layers = nn.ModuleDict({str(layer): TransformerBlock(args) for layer in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs", self.rope(), persistent=False)
        self.reset_parameters()

    def rope(self) -> torch.Tensor:
        args = self.args
        return rope_frequencies(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)

    def init_buffers(self) -> None:
        """Compute the RoPE table again: a model built on the meta device and then allocated
        (``to_empty``) holds no values, and no checkpoint holds this table."""
        self.freqs.copy_(self.rope())

    def reset_parameters(self) -> None:
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            else:
                nn.init.normal_(param, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of ``tokens``. A pipeline stage without the embedding takes the previous
        stage's hidden states instead, and one without the output head returns its own."""
        h = self.dropout(self.tok_embeddings(tokens)) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return self.output(self.norm(h)) if self.output is not None else h

"""A Llama-style decoder in plain single-device PyTorch, dense or with a mixture of experts
in place of its feed-forward layers (``MoE``, ``workers.experts``).

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

from elastic.core.model_shape import ModelShape, RopeScaling
from workers.context_parallel import ContextShare, context_attention
from workers.experts import FeedForward, MoE


@dataclass(frozen=True)
class ModelArgs(ModelShape):
    """What the reference model is built from: the model's shape (``elastic.core.model_shape``,
    the one owner of its fields and defaults) and the sequence length RoPE is computed for.
    Unset widths are resolved here: ``n_kv_heads`` to ``n_heads``, ``head_dim`` to
    ``dim // n_heads`` (``model_args.json`` holds them resolved), ``expert_hidden`` to 0
    (``ffn_hidden``'s)."""

    max_seq_len: int = 64

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "n_kv_heads", self.kv_heads)
        object.__setattr__(self, "head_dim", self.head_width)
        object.__setattr__(self, "expert_hidden", self.expert_hidden or 0)

    @classmethod
    def of_shape(cls, shape: ModelShape, max_seq_len: int) -> ModelArgs:
        return cls(**shape.fields(), max_seq_len=max_seq_len)


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
    """Rotate (batch, seq, heads, head_dim) pairs by the position's angle: ``freqs`` is the
    table by position, or each token's own angles (batch or 1, seq, ...) where positions
    restart with each document or a rank holds chunks of the sequence."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs.unbind(-1)
    per_token = freqs.dim() == 4
    cos, sin = (freqs if per_token else freqs[: x.shape[1]]).view(
        freqs.shape[0] if per_token else 1, x.shape[1], 1, -1, 2).unbind(-1)
    rotated = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return rotated.flatten(-2).type_as(x)


def document_mask(positions: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """(batch, 1, queries, seq): whether each of the tokens at ``queries`` (indices into the
    sequence) may see each token of the sequence: an earlier one of its own document.
    ``positions`` (batch, seq): each token's place in its document, so a token's index less
    its position is where its document starts (negative for one begun before the row)."""
    keys = torch.arange(positions.shape[1], device=positions.device)
    starts = keys - positions
    same_document = starts[:, queries, None] == starts[:, None, :]
    return (same_document & (keys[None, None, :] <= queries[None, :, None]))[:, None]


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
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.context: ContextShare | None = None  # set by context parallelism: this rank's chunks

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``documents``: where packed documents may not attend to each other, the mask of
        (batch, 1, seq, keys) that lets a token see only the earlier tokens of its document."""
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        if self.context is not None:  # the whole sequence's keys and values, from every rank's chunks
            k, v = self.context.gather(k), self.context.gather(v)
        k = k.repeat_interleave(self.kv_repeats, dim=2)
        v = v.repeat_interleave(self.kv_repeats, dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.context is not None:
            out = context_attention(q, k, v, self.context, documents)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=documents, is_causal=documents is None)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def dropout(p: float) -> nn.Module:
    # No module at all when off: no random draws, nothing for compile to trace.
    return nn.Dropout(p) if p > 0 else nn.Identity()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = MoE(args, layer) if args.has_experts(layer) else FeedForward(args.dim, args.ffn_hidden)
        self.dropout = dropout(args.dropout)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), freqs, documents))
        return x + self.dropout(self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.dropout = dropout(args.dropout)
        # A dict keyed by layer number: a pipeline stage keeps only its own layers
        # (``workers.pipeline``), under the names they have in the whole model.
        self.layers = nn.ModuleDict({str(layer): TransformerBlock(args, layer) for layer in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs", self.rope(), persistent=False)
        self.context: ContextShare | None = None  # set by context parallelism: this rank's chunks
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
            elif name.endswith("expert_bias"):
                nn.init.zeros_(param)
            else:
                nn.init.normal_(param, std=0.02)

    def _rotations_and_mask(self, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The RoPE angles of the tokens (the table, or each token's own) and, for packed
        documents, the mask of what each token may see."""
        context = self.context
        if context is None:
            if positions is None:
                return self.freqs, None
            return self.freqs[positions], document_mask(positions, torch.arange(positions.shape[1],
                                                                                device=positions.device))
        queries = context.indices(self.freqs.device)  # where this rank's tokens sit in the sequence
        if positions is None:
            return self.freqs[queries][None], None
        return self.freqs[positions], document_mask(context.gather_constant(positions), queries)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of ``tokens``. A pipeline stage without the embedding takes the previous
        stage's hidden states instead, and one without the output head returns its own.

        ``positions`` (batch, seq): each token's position in its document, 0 where one begins,
        for packed documents that must not see each other: each token then attends only to
        the earlier tokens of its document, rotated by its own position, as if its document
        ran alone.

        Under context parallelism (``context``) the tokens, hidden states and positions are
        this rank's chunks of each sequence (``workers.context_parallel``), rotated by where
        they sit in it."""
        h = self.dropout(self.tok_embeddings(tokens)) if self.tok_embeddings is not None else tokens
        context = self.context
        if context is not None and self.tok_embeddings is not None and tokens.shape[1] != context.chunk_len * 2:
            raise ValueError(f"context parallelism gives each of {context.size} ranks {context.chunk_len * 2} of a "
                             f"sequence's data.seq_len={context.seq_len} tokens; this rank got {tokens.shape[1]}")
        freqs, documents = self._rotations_and_mask(positions)
        for layer in self.layers.values():
            h = layer(h, freqs, documents)
        return self.output(self.norm(h)) if self.output is not None else h

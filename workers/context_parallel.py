"""Context parallelism: each sequence split over the ``cp`` ranks of a group's ``cp`` dimension.

The sequence is cut into ``2 cp`` equal chunks and rank ``r`` holds chunk ``r`` and chunk
``2 cp - 1 - r`` (Llama 3's load balance: under a causal mask an early chunk's queries see
few keys and a late chunk's many, so every rank computes as many query-key pairs).
Attention all-gathers every rank's keys and values (its backward reduce-scatters their
gradients to their owners: functional collectives, on gloo and NCCL alike) and computes the
rank's own queries against them, each chunk against the keys up to its own end, causal
aligned to the lower right (torch's causal bias, which the fused kernels apply without a mask
in memory, or a mask of booleans where compile or per-op recomputation cannot trace it); with
packed documents, under the documents' mask. Everything else in a block acts on each token alone and runs on the
rank's chunks; the loss sums the rank's own targets, so each token is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import _functional_collectives as functional
from torch.nn.attention.bias import causal_lower_right

# torch 2.13 renamed the differentiable all-gather; the GPU machine's torch 2.11 may know the old name only
_all_gather_autograd = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd


@dataclass(frozen=True)
class ContextShare:
    """Rank ``rank`` of ``size``'s chunks of sequences of ``seq_len`` tokens; ``group``: the
    process group of the ``size`` ranks, for attention's gathers (none needed to split a batch)."""

    size: int
    rank: int
    seq_len: int
    group: Any = None
    # Whether attention passes torch's lower-right causal bias, which the fused kernels apply
    # with no mask in memory, rather than a mask of booleans: compile and per-op recomputation
    # cannot trace the bias (a tensor subclass) and take the mask.
    causal_bias: bool = True

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.size - 1 - self.rank

    @property
    def chunk_len(self) -> int:
        return self.seq_len // (2 * self.size)

    def indices(self, device: torch.device | None = None) -> torch.Tensor:
        """Where this rank's tokens sit in the whole sequence, in the order it holds them."""
        length = self.chunk_len
        return torch.cat([torch.arange(chunk * length, (chunk + 1) * length, device=device) for chunk in self.chunks])

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks of a whole sequence's ``tensor``."""
        if tensor.shape[dim] != self.seq_len:
            raise ValueError(f"context parallelism splits sequences of data.seq_len={self.seq_len} tokens; "
                             f"a batch holds {tensor.shape[dim]}")
        pieces = tensor.chunk(2 * self.size, dim)
        return torch.cat([pieces[chunk] for chunk in self.chunks], dim)

    def _in_sequence_order(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        # gathered by rank: rank r's chunks r and 2 size - 1 - r, one after the other
        pieces = gathered.chunk(2 * self.size, dim)
        ordered = [None] * (2 * self.size)
        for rank in range(self.size):
            ordered[rank], ordered[2 * self.size - 1 - rank] = pieces[2 * rank], pieces[2 * rank + 1]
        return torch.cat(ordered, dim)

    def gather(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The whole sequence's ``tensor``, in order, from every rank's chunks of it; backward
        hands each rank the gradient of its own chunks, summed over the ranks."""
        gathered = _all_gather_autograd(tensor.contiguous(), gather_dim=dim, group=self.group)
        return self._in_sequence_order(gathered, dim)

    def gather_constant(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """``gather`` of a tensor with no gradient (positions)."""
        return self._in_sequence_order(
            functional.all_gather_tensor(tensor.contiguous(), gather_dim=dim, group=self.group), dim)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, share: ContextShare,
                      documents: torch.Tensor | None) -> torch.Tensor:
    """Attention of the rank's queries ``q`` (batch, heads, local, head_dim) over the whole
    sequence's keys and values ``k``, ``v`` (batch, heads, seq, head_dim, in order).
    ``documents``: the (batch, 1, local, seq) mask of packed documents, else causal."""
    if documents is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=documents)
    length = share.chunk_len
    outputs = []
    for queries, chunk in zip(q.split(length, dim=2), share.chunks):
        end = (chunk + 1) * length
        if share.causal_bias:
            mask = causal_lower_right(length, end)
        else:
            keys = torch.arange(end, device=q.device)
            mask = keys[None, :] <= keys[end - length:, None]
        outputs.append(F.scaled_dot_product_attention(queries, k[:, :, :end], v[:, :, :end], attn_mask=mask))
    return torch.cat(outputs, dim=2)


"""The pseudo-gradients' sum across groups in 8 or 4 bits a value (``sync.precision`` fp8 or
int4), as streaming DiLoCo sends its outer gradients.

A rank's values (its parameters' shards in order, flat) are coded in blocks of ``BLOCK``, each
block with its own fp32 scale (its largest magnitude over the code's): int4 rounds to the
nearest of -7..7, two codes a byte; fp8 is e4m3. The sum is a ring all-reduce's two halves,
both in codes: each rank sends every other the blocks that rank owns (an all-to-all), the owner
decodes and sums them in fp32 in the group's rank order and codes its sum, and every rank
gathers the owners' coded sums. So every rank decodes the same bytes: the learners take the same
global weights bit for bit, and a redone round the clean round's. On the wire a rank sends
2(G - 1)/G of its codes, as a ring all-reduce sends of its values.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from workers.gradient_sum import SumTimes, local_gradient, local_gradient_numel, unflatten_into

BLOCK = 64
SCALE_BYTES = 4  # fp32


class BlockCode(NamedTuple):
    """How a block of values scaled into [-largest, largest] becomes bytes, and back."""

    bytes_per_block: int
    largest: float
    encode: Callable[[torch.Tensor], torch.Tensor]  # [blocks, BLOCK] float -> [blocks, bytes_per_block] uint8
    decode: Callable[[torch.Tensor], torch.Tensor]  # and back, as float32


def _encode_int4(scaled: torch.Tensor) -> torch.Tensor:
    codes = (torch.round(scaled) + 8).to(torch.uint8)  # 1..15
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _decode_int4(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).float() - 8


def _encode_fp8(scaled: torch.Tensor) -> torch.Tensor:
    return scaled.to(torch.float8_e4m3fn).view(torch.uint8)


def _decode_fp8(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float()


CODES = {"int4": BlockCode(BLOCK // 2, 7.0, _encode_int4, _decode_int4),
         "fp8": BlockCode(BLOCK, float(torch.finfo(torch.float8_e4m3fn).max), _encode_fp8, _decode_fp8)}


def encode(values: torch.Tensor, code: BlockCode) -> torch.Tensor:
    """``values`` (a whole number of blocks) as ``[blocks, bytes_per_block + SCALE_BYTES]``
    bytes: each block's codes, then its scale."""
    blocks = values.float().view(-1, BLOCK)
    largest = blocks.abs().amax(dim=1, keepdim=True)
    scale = torch.where(largest > 0, largest / code.largest, torch.ones_like(largest))
    scaled = (blocks / scale).clamp_(-code.largest, code.largest)
    return torch.cat((code.encode(scaled), scale.view(torch.uint8)), dim=1)


def decode(coded: torch.Tensor, code: BlockCode) -> torch.Tensor:
    scale = coded[:, code.bytes_per_block:].contiguous().view(torch.float32)
    return (code.decode(coded[:, :code.bytes_per_block].contiguous()) * scale).reshape(-1)


class QuantizedSum:
    """The sum of ``params``' gradients over the replicate group, in ``precision``'s codes
    (``CODES``); the interface of ``workers.gradient_sum.GradientSum`` with ``overlap=False``,
    its ``values`` too."""

    def __init__(self, params: list[nn.Parameter], precision: str,
                 values: Callable[[nn.Parameter], torch.Tensor] = local_gradient):
        self.params = params
        self.values = values
        self.code = CODES[precision]
        self.numel = sum(local_gradient_numel(param) for param in params)
        self._group = None

    def _blocks(self, ranks: int) -> int:
        """Blocks of the padded flat values: a whole number for each of the ``ranks`` owners."""
        return math.ceil(self.numel / (ranks * BLOCK)) * ranks

    def handed_bytes(self, ranks: int) -> int:
        """What one sum hands a group of ``ranks``: every block's codes, then its own blocks' sum."""
        blocks = self._blocks(ranks)
        return (blocks + blocks // ranks) * (self.code.bytes_per_block + SCALE_BYTES)

    def start(self, replicate_group) -> None:
        self._group = replicate_group

    def finish(self, wait: Callable) -> SumTimes:
        """Sum, each collective awaited by ``wait(work)`` (which raises past the step's deadline
        or at the driver's abort), and write the sums into the gradients."""
        group, self._group = self._group, None
        if group is None:
            raise RuntimeError("QuantizedSum.finish without start")
        started = time.perf_counter()
        ranks = group.size()
        gradients = [self.values(param) for param in self.params]
        flat = torch.zeros(self._blocks(ranks) * BLOCK, device=gradients[0].device)
        flat[:self.numel] = torch.cat([gradient.reshape(-1).float() for gradient in gradients])
        sent = encode(flat, self.code)
        received = torch.empty_like(sent)
        wait(group.alltoall_base(received, sent, [], [], dist.AllToAllOptions()))
        owned = torch.zeros(flat.numel() // ranks, device=flat.device)
        for contribution in received.view(ranks, -1, sent.shape[1]):  # in the group's rank order
            owned += decode(contribution, self.code)
        mine = encode(owned, self.code)
        gathered = [torch.empty_like(mine) for _ in range(ranks)]
        wait(group.allgather([gathered], [mine]))
        unflatten_into(gradients, torch.cat([decode(chunk, self.code) for chunk in gathered]))
        elapsed = time.perf_counter() - started
        return SumTimes(elapsed, elapsed)

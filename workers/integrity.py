"""The rank's side of the integrity check (``elastic.core.integrity``): fingerprints of the
committed state it holds, computed on the device and gathered across the replica groups as
a step begins, so the gather overlaps the step's compute. And the fault that tests it: one
flipped bit, as a bad memory cell would leave it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elastic.core.integrity import IntegrityMismatch, compare

# Integers of each element size: a tensor's bits are read as these, whatever its dtype.
INTEGER_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """The committed state a replica holds, by name: each parameter's local shard, then its
    optimizer state, in the model's order (the same in every group)."""
    named = []
    for name, param in model.named_parameters():
        named.append((name, _local(param)))
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if torch.is_tensor(value):
                named.append((f"{name}.{key}", _local(value)))
    return named


def bit_sum(tensor: torch.Tensor) -> int:
    """The tensor's bits summed as integers, modulo 2**32 (``_bit_sum``), on the host."""
    return int(_bit_sum(tensor).item()) % 2**32


def _bit_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits summed as integers: its 32-bit words, or where its bytes do not make
    whole aligned words, its elements. On CUDA the words are summed in int32, which wraps at
    2**32 and reads each byte once (a sum into int64 first copies the tensor widened, 5x the
    memory traffic); elsewhere into int64. Both are exact modulo 2**32, in any order."""
    flat = tensor.detach().reshape(-1)
    words = flat.numel() * flat.element_size() % 4 == 0 and flat.storage_offset() * flat.element_size() % 4 == 0
    if words and flat.is_cuda:
        return torch.sum(flat.view(torch.int32), dtype=torch.int32)
    return torch.sum(flat.view(torch.int32 if words else INTEGER_VIEWS[flat.element_size()]), dtype=torch.int64)


def fingerprints(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Per tensor, the sum of its bits read as integers, modulo 2**32, in int64 on ``device``.
    Modular integer sums are exact, so they do not depend on the order the device adds in,
    and a flipped bit (a change of 2**k, k < 32) always changes its tensor's sum."""
    sums = [_bit_sum(tensor) for tensor in tensors]
    result = torch.empty(len(sums), dtype=torch.int64, device=device)
    # Gathered by device and dtype, so the few host tensors (AdamW's step counts) cross to the
    # device in one copy, not one blocking copy each.
    for where, dtype in {(total.device, total.dtype) for total in sums}:
        indices = [index for index, total in enumerate(sums) if (total.device, total.dtype) == (where, dtype)]
        together = torch.stack([sums[index] for index in indices]).to(device=device, dtype=torch.int64)
        result[torch.tensor(indices, device=device)] = together
    return result & 0xFFFFFFFF


@dataclass
class PendingCheck:
    """One position's fingerprints, being gathered across the groups."""

    step: int
    names: list[str]
    gathered: list[torch.Tensor]  # one row per group: the group, then its fingerprints
    work: object  # the all-gather in flight

    def verdict(self, position: tuple[int, ...]) -> IntegrityMismatch | None:
        rows = [row.cpu().tolist() for row in self.gathered]
        return compare(self.step, position, {row[0]: row[1:] for row in rows}, self.names)


def start_check(step: int, group: int, model: nn.Module, optimizer: torch.optim.Optimizer, replicate_group,
                device: torch.device) -> PendingCheck:
    """Fingerprint the committed state and start gathering it over ``replicate_group``."""
    names, tensors = zip(*state_tensors(model, optimizer))
    row = torch.cat([torch.tensor([group], dtype=torch.int64, device=device), fingerprints(list(tensors), device)])
    gathered = [torch.empty_like(row) for _ in range(replicate_group.size())]
    return PendingCheck(step, list(names), gathered, replicate_group.allgather([gathered], [row]))


def flip_bit(model: nn.Module) -> None:
    """Flip the highest mantissa bit of the first element this rank holds of the last
    floating-point parameter (a model's last one, its final norm or output projection, acts
    on every token, where an embedding row may never be read): a value off by up to half of
    itself, no error anywhere."""
    for param in reversed(list(model.parameters())):
        local = _local(param).detach()
        if local.numel() and local.is_floating_point():
            bit = round(-math.log2(torch.finfo(local.dtype).eps)) - 1
            local.view(-1)[:1].view(INTEGER_VIEWS[local.element_size()]).bitwise_xor_(1 << bit)
            return

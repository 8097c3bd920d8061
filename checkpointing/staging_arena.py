"""Host memory a rank stages its checkpoint into: one shared arena, reused by every save.

Each tensor of the rank's state has a fixed slot, allocated once and refilled by each save
of the same layout: allocating, faulting in (and on CUDA pinning) fresh pages every time
would cost more than the copy itself. The arena is a memfd, so an upload process maps the
very same pages instead of receiving a copy; unlike /dev/shm it is not capped by the small
tmpfs that containers often mount there. On CUDA the arena is page-locked
(``cudaHostRegister``), so the device-to-host copies run asynchronously on a side stream and
the save waits once, for all of them.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
import weakref
from dataclasses import dataclass

import torch

# Slot starts suit every dtype and vectorised copies.
ALIGNMENT = 64

_arena_ids = itertools.count()


@dataclass(frozen=True)
class TensorRef:
    """A staged tensor's place in the arena: all another process needs to see it."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def view(self, memory) -> torch.Tensor:
        """The tensor over ``memory`` (the arena as mapped in this process), without a copy."""
        numel = math.prod(self.shape)
        if numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        # frombuffer gives the tensor a storage of exactly its own bytes: torch.save (DCP's
        # file format) writes a tensor's whole storage, and would otherwise write the arena.
        return torch.frombuffer(memory, dtype=self.dtype, count=numel, offset=self.offset).view(self.shape)


def layout(tensors: dict[str, torch.Tensor]) -> tuple:
    return tuple((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items())


class StagingArena:
    """Slots for one layout of a rank's tensors (``{name: tensor}``), in shared host memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.id = next(_arena_ids)
        self.layout = layout(tensors)
        refs, end = {}, 0
        for name, dtype, shape in self.layout:
            refs[name] = TensorRef(end, dtype, shape)
            end += _round_up(math.prod(shape) * dtype.itemsize)
        self.nbytes = max(end, mmap.PAGESIZE)
        self.device = next((t.device for t in tensors.values() if t.is_cuda), None)
        self.fd, memory = _shared_memory(self.nbytes)
        self.base = torch.frombuffer(memory, dtype=torch.uint8).data_ptr()
        pinned = self.device is not None
        try:
            if pinned:
                _pin(self.base, self.nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        # Holds the mapping until it is unpinned: unmapping page-locked memory is undefined.
        self._release = weakref.finalize(self, _release, memory, self.fd, self.base if pinned else None)
        self.buffers = {name: ref.view(memory) for name, ref in refs.items()}
        self.stream = torch.cuda.Stream(self.device) if pinned else None

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        return layout(tensors) == self.layout

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into their slots; returns the slots, valid until the next stage."""
        with torch.no_grad():
            if self.stream is None:
                for name, tensor in tensors.items():
                    self.buffers[name].copy_(tensor)
                return self.buffers
            # The copies must see the state the training stream leaves behind.
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(self.stream):
                    for name, tensor in tensors.items():
                        self.buffers[name].copy_(tensor, non_blocking=True)
            finally:
                # The one wait: every copy has landed, or (after a failure) none still runs
                # into memory that is about to be released.
                self.stream.synchronize()
        return self.buffers

    def ref(self, tensor: torch.Tensor) -> TensorRef:
        """Where a slot (or a contiguous view of one) lies in the arena."""
        if tensor.numel() == 0:
            return TensorRef(0, tensor.dtype, tuple(tensor.shape))
        offset = tensor.data_ptr() - self.base
        if not (tensor.is_contiguous() and 0 <= offset and offset + tensor.nbytes <= self.nbytes):
            raise ValueError("not a contiguous tensor of this staging arena")
        return TensorRef(offset, tensor.dtype, tuple(tensor.shape))

    def release(self) -> None:
        """Unpin and close now; the pages go once no view of them is left."""
        self._release()


def _round_up(nbytes: int) -> int:
    return (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _shared_memory(nbytes: int) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("rank-checkpoint-staging", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def _pin(pointer: int, nbytes: int) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0))
    if error:
        raise RuntimeError(f"cudaHostRegister of {nbytes} staging bytes failed: cudaError {error}")


def _release(memory: mmap.mmap, fd: int, pinned_base: int | None) -> None:
    if pinned_base is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned_base)
    os.close(fd)

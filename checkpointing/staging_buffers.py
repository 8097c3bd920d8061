"""Host memory a rank stages its checkpoint into, kept from one save to the next.

Each tensor of the rank's state has a fixed buffer, allocated once and refilled by each save
of the same layout: allocating, faulting in (and on CUDA pinning) fresh pages every time
would cost more than the copy itself. On CUDA the buffers are page-locked, so the
device-to-host copies run asynchronously on a side stream and the save waits once, for all
of them, instead of once per tensor.
"""

from __future__ import annotations

import torch


def layout(tensors: dict[str, torch.Tensor]) -> tuple:
    return tuple((name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items())


class StagingBuffers:
    """Buffers for one layout of a rank's tensors (``{name: tensor}``), in host memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.layout = layout(tensors)
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        pinned = device is not None
        self.buffers = {
            name: torch.empty(shape, dtype=dtype, pin_memory=pinned) for name, dtype, shape in self.layout
        }
        self.device = device
        self.stream = torch.cuda.Stream(device) if pinned else None

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers.values())

    def fits(self, tensors: dict[str, torch.Tensor]) -> bool:
        return layout(tensors) == self.layout

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into their buffers; returns the buffers, valid until the next stage."""
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
                # into memory that is about to be dropped.
                self.stream.synchronize()
        return self.buffers

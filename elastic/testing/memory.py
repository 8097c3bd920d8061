"""What memory a process holds: its resident memory, read from /proc/self/status, and the
bytes autograd keeps for backward."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> str:
    """Reset the peak (VmHWM) so it measures what follows alone; returns the field to read
    (VmRSS where the kernel does not allow the reset)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return "VmHWM"
    except OSError:
        return "VmRSS"



def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """Where a tensor's (local) data lives and its bytes: a storage once however many ops save it."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    try:
        storage = local.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except RuntimeError:  # a wrapper with no storage of its own (a collective's pending output)
        return id(local), local.numel() * local.element_size()


def held_storages(model: torch.nn.Module) -> frozenset[int]:
    """The storages of a model's parameters and buffers, which a forward saves without holding more."""
    return frozenset(storage_key(tensor)[0] for tensor in [*model.parameters(), *model.buffers()])


class SavedBytes:
    """Bytes autograd saves for backward while inside (what a forward holds until backward),
    each storage counted once, those in ``held`` (the parameters') not at all, and with
    ``floating_only`` the integer ones (token ids, indices) not either."""

    def __init__(self, held: frozenset[int] = frozenset(), floating_only: bool = False):
        self.held = held
        self.floating_only = floating_only
        self._storages: dict[int, int] = {}
        # What each key was read from, alive until the count is done: a key taken from an
        # object's id (a collective's pending output) is reused once that object is freed,
        # and a later tensor would then not be counted.
        self._keyed: list[torch.Tensor] = []

    @property
    def total(self) -> int:
        return sum(self._storages.values())

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.floating_only and not tensor.is_floating_point():
            return tensor
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        self._keyed.append(local)
        key, size = storage_key(local)
        if key not in self.held:
            self._storages[key] = size
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

"""The rank's side of the in-memory tier (``elastic.core.memory_tier``): copies of its
committed state in host memory, and the copies it keeps for the ranks it is buddy to.

A snapshot stalls training only while the state is copied into a staging arena (the
checkpoints' kind of host memory: slots allocated once and refilled, pinned on CUDA); a
thread then sends it to the buddy, whose ``hold_copy`` runs on a thread of its own, so the
transfer overlaps training on both sides. A snapshot waits until the buddy has the last
one (only a transfer slower than the snapshots' interval makes it wait), and a rank keeps
its own copies of the newest two snapshots, as its buddy does of what it received: every
rank can always return to the one before the newest (``elastic.core.memory_tier``).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import ray
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from checkpointing.staging_arena import StagingArena
from workers.integrity import INTEGER_VIEWS
from elastic.core.data_plan import DataCursor
from elastic.core.memory_tier import Holdings
from elastic.core.protocol import describe_error

log = logging.getLogger("elastic.memory_tier")


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def parameter_bytes(model: nn.Module) -> int:
    """The bytes of the rank's parameters (its shards of them)."""
    return sum(_local(param).nbytes for param in model.parameters())


def committed_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """The committed state's local tensors by name (what is staged), and the optimizer's
    state dict they come from."""
    tensors = {f"model.{index}": _local(param).detach() for index, param in enumerate(model.parameters())}
    optim = optimizer.state_dict()
    for index, entry in optim["state"].items():
        tensors.update({f"optimizer.{index}.{key}": _local(value).detach()
                        for key, value in entry.items() if torch.is_tensor(value)})
    return tensors, optim


def exported(staged: dict[str, torch.Tensor], optim: dict, generators: dict) -> dict:
    """The staged tensors as ``RankWorker.export_state`` gives a state (views, not copies)."""
    models = sorted((key for key in staged if key.startswith("model.")), key=lambda key: int(key.split(".")[1]))
    return {
        "model": [staged[key] for key in models],
        "optimizer": {
            "state": {index: {key: staged[f"optimizer.{index}.{key}"] if torch.is_tensor(value) else value
                              for key, value in entry.items()}
                      for index, entry in optim["state"].items()},
            "param_groups": optim["param_groups"],
        },
        "rng": generators,
    }


@dataclass(frozen=True)
class WireTensor:
    """A tensor as a numpy array of its bits: Ray sends numpy arrays out of band (one copy
    into the object store, read in place), where it pickles a tensor's bytes (about 15x the
    CPU for a few MiB, measured here)."""

    bits: np.ndarray
    dtype: torch.dtype
    shape: tuple[int, ...]


def to_wire(state: dict) -> dict:
    """``state`` with every CPU tensor as a ``WireTensor`` over the same memory (no copy)."""
    return tree_map(lambda value: WireTensor(value.reshape(-1).view(INTEGER_VIEWS[value.element_size()]).numpy(),
                                             value.dtype, tuple(value.shape))
                    if torch.is_tensor(value) else value, state)


def from_wire(state: dict) -> dict:
    """``state`` with its tensors back, each a writable copy (what arrived is read-only)."""
    return tree_map(lambda value: torch.from_numpy(value.bits.copy()).view(value.dtype).reshape(value.shape)
                    if isinstance(value, WireTensor) else value, state)


def copied(state: dict) -> dict:
    """A state whose tensors are its own: loading the arena's views would alias them."""
    return tree_map(lambda value: value.clone() if torch.is_tensor(value) else value, state)


def state_bytes(state: dict) -> int:
    total = 0

    def count(value):
        nonlocal total
        if torch.is_tensor(value):
            total += value.numel() * value.element_size()
        elif isinstance(value, WireTensor):
            total += value.bits.nbytes
        return value

    tree_map(count, state)
    return total


@dataclass
class Snapshot:
    step: int
    cursor: DataCursor
    state: dict  # views of ``arena``
    arena: StagingArena


class MemoryTier:
    def __init__(self, rank: int, send_timeout_s: float):
        self.rank = rank
        # A buddy that does not take a copy in this long is given up on: the next snapshot
        # must not wait on it forever (it would hang the step it follows).
        self.send_timeout_s = send_timeout_s
        self.lock = threading.Lock()
        self.own: dict[int, Snapshot] = {}  # the newest two copies of this rank's state, by step
        self.held: dict[int, dict[int, tuple[DataCursor, dict]]] = {}  # owner -> step -> its newest two copies
        self.buddy = None  # the buddy's actor handle
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-tier")
        self.sending: Future | None = None

    def set_buddy(self, handle) -> None:
        with self.lock:
            self.buddy = handle

    def snapshot(self, step: int, cursor: DataCursor, model: nn.Module, optimizer: torch.optim.Optimizer,
                 generators: dict) -> float:
        """Copy the committed state at ``step`` into host memory, and send it to the buddy in
        the background once the buddy has the last one. Returns the seconds spent waiting for
        that (a transfer slower than the snapshots' interval). A rank with no buddy is a run's
        only rank: no copy of its could ever be restored into another, so it takes none."""
        with self.lock:
            buddy = self.buddy
        if buddy is None:
            return 0.0
        started = time.perf_counter()
        if self.sending is not None:
            self.sending.result()
        waited = time.perf_counter() - started
        tensors, optim = committed_tensors(model, optimizer)
        with self.lock:
            oldest = min(self.own) if len(self.own) == 2 else None
            arena = self.own.pop(oldest).arena if oldest is not None else None
        if arena is None or not arena.fits(tensors):
            if arena is not None:
                arena.release()
            arena = StagingArena(tensors)
        snapshot = Snapshot(step, cursor, exported(arena.stage(tensors), optim, generators), arena)
        with self.lock:
            self.own[step] = snapshot
        self.sending = self.sender.submit(self._send, buddy, snapshot)
        return waited

    def _send(self, handle, snapshot: Snapshot) -> None:
        try:
            ray.get(handle.hold_copy.remote(self.rank, snapshot.step, snapshot.cursor, to_wire(snapshot.state)),
                    timeout=self.send_timeout_s)
        except Exception as error:  # the buddy is gone or stuck: the driver names another at the next rebuild
            log.warning("rank %d: the copy of step %d did not reach its buddy: %s", self.rank, snapshot.step,
                        describe_error(error, 300))

    def hold(self, owner: int, step: int, cursor: DataCursor, state: dict) -> None:
        with self.lock:
            copies = self.held.setdefault(owner, {})
            copies[step] = (cursor, state)
            for older in sorted(copies)[:-2]:
                del copies[older]

    def held_state(self, owner: int, step: int) -> dict:
        with self.lock:
            copies = self.held.get(owner, {})
            if step not in copies:
                raise KeyError(f"rank {self.rank} holds rank {owner}'s state at steps {sorted(copies)}, not {step}")
            return copies[step][1]

    def own_state(self, step: int) -> dict:
        """A copy of this rank's own state at ``step``; every copy from after it is dropped:
        the run goes on from ``step``."""
        with self.lock:
            if step not in self.own:
                raise KeyError(f"rank {self.rank} holds its own state at steps {sorted(self.own)}, not {step}")
            for newer in [s for s in self.own if s > step]:
                self.own.pop(newer).arena.release()
            for copies in self.held.values():
                for newer in [s for s in copies if s > step]:
                    del copies[newer]
            return copied(self.own[step].state)

    def holdings(self) -> Holdings:
        with self.lock:
            return Holdings(
                own={step: snapshot.cursor for step, snapshot in self.own.items()},
                held={owner: {step: cursor for step, (cursor, _) in copies.items()}
                      for owner, copies in self.held.items()},
                nbytes=sum(snapshot.arena.nbytes for snapshot in self.own.values())
                + sum(state_bytes(state) for copies in self.held.values() for _, state in copies.values()),
            )

"""The rank's side of the in-memory tier (``elastic.core.memory_tier``): copies of its
committed state in host memory, and the copies it keeps for the ranks it is buddy to.

A snapshot stalls training only while the state is copied into a staging arena (the
checkpoints' kind of host memory: slots allocated once and refilled, pinned on CUDA); a
thread then sends it to the buddy, whose ``hold_copy`` runs on a thread of its own, so the
transfer overlaps training on both sides. A rank keeps one copy of its own state, the
newest; its buddy keeps the one before until the newest arrives, so every rank's state at
the buddy's step is somewhere even while a copy is on its way. A snapshot due while the last
one is still on its way is skipped: a slow link costs the tier's freshness, never a step's
time.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import ray
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from checkpointing.staging_arena import StagingArena
from elastic.core.data_plan import DataCursor
from elastic.core.memory_tier import Holdings
from elastic.core.protocol import describe_error

log = logging.getLogger("elastic.memory_tier")


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


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


def copied(state: dict) -> dict:
    """A state whose tensors are its own: loading the arena's views would alias them."""
    return tree_map(lambda value: value.clone() if torch.is_tensor(value) else value, state)


def state_bytes(state: dict) -> int:
    total = 0

    def count(value):
        nonlocal total
        if torch.is_tensor(value):
            total += value.numel() * value.element_size()
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
    def __init__(self, rank: int):
        self.rank = rank
        self.lock = threading.Lock()
        self.own: Snapshot | None = None  # the newest copy of this rank's state
        self.held: dict[int, tuple[int, DataCursor, dict]] = {}  # owner -> its newest copy here
        self.buddy = None  # (rank, actor handle)
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-tier")
        self.sending: Future | None = None

    def set_buddy(self, rank: int | None, handle) -> None:
        with self.lock:
            self.buddy = None if rank is None else (rank, handle)

    def snapshot(self, step: int, cursor: DataCursor, model: nn.Module, optimizer: torch.optim.Optimizer,
                 generators: dict) -> bool:
        """Copy the committed state at ``step`` into host memory and send it to the buddy in
        the background. Returns False (skipped) while the last one is still on its way: its
        arena is being read."""
        if self.sending is not None and not self.sending.done():
            return False
        tensors, optim = committed_tensors(model, optimizer)
        with self.lock:
            arena = self.own.arena if self.own is not None else None
            self.own = None
        if arena is None or not arena.fits(tensors):
            if arena is not None:
                arena.release()
            arena = StagingArena(tensors)
        snapshot = Snapshot(step, cursor, exported(arena.stage(tensors), optim, generators), arena)
        with self.lock:
            self.own = snapshot
            buddy = self.buddy
        if buddy is not None:
            self.sending = self.sender.submit(self._send, buddy[1], snapshot)
        return True

    def _send(self, handle, snapshot: Snapshot) -> None:
        try:
            ray.get(handle.hold_copy.remote(self.rank, snapshot.step, snapshot.cursor, snapshot.state))
        except Exception as error:  # the buddy is gone: the driver names another at the next rebuild
            log.warning("rank %d: the copy of step %d did not reach its buddy: %s", self.rank, snapshot.step,
                        describe_error(error, 300))

    def hold(self, owner: int, step: int, cursor: DataCursor, state: dict) -> None:
        with self.lock:
            self.held[owner] = (step, cursor, state)

    def held_state(self, owner: int, step: int) -> dict:
        with self.lock:
            held_step, _, state = self.held[owner]
        if held_step != step:
            raise KeyError(f"rank {self.rank} holds rank {owner}'s state at step {held_step}, not {step}")
        return state

    def own_state(self, step: int) -> dict:
        """A copy of this rank's own state at ``step``; copies held for others from after it
        are dropped: the run goes on from ``step``."""
        with self.lock:
            if self.own is None or self.own.step != step:
                raise KeyError(f"rank {self.rank} holds no copy of its own state at step {step}")
            self.held = {owner: held for owner, held in self.held.items() if held[0] <= step}
            return copied(self.own.state)

    def holdings(self) -> Holdings:
        with self.lock:
            return Holdings(
                own={} if self.own is None else {self.own.step: self.own.cursor},
                held={owner: (step, cursor) for owner, (step, cursor, _) in self.held.items()},
                nbytes=(0 if self.own is None else self.own.arena.nbytes)
                + sum(state_bytes(state) for _, _, state in self.held.values()),
            )

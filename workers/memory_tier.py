"""The rank's side of the in-memory tier (``elastic.core.memory_tier``): copies of its
committed state in host memory, and the copies it keeps for the ranks it is buddy to.

A snapshot stalls training only while the state is copied into a staging arena (the
checkpoints' kind of host memory: slots allocated once and refilled, pinned on CUDA); a
thread then sends it to the buddy, whose ``hold_copy`` runs on a thread of its own, so the
transfer overlaps training on both sides. Two arenas alternate: one holds the newest step
the buddy confirmed, the other the step on its way. A snapshot due while the last one is
still on its way is skipped: a slow link costs the tier's freshness, never a step's time.
"""

from __future__ import annotations

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
        self.own: dict[int, Snapshot] = {}  # at most two: the newest the buddy confirmed, and one on its way
        self.held: dict[int, tuple[int, DataCursor, dict]] = {}  # owner -> its newest copy here
        self.buddy = None  # (rank, actor handle)
        self.confirmed = -1  # the newest own step the buddy holds
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-tier")
        self.sending: Future | None = None
        self.spare: StagingArena | None = None  # an arena no snapshot holds

    def set_buddy(self, rank: int | None, handle) -> None:
        with self.lock:
            self.buddy = None if rank is None else (rank, handle)
            self.confirmed = -1  # the new buddy holds nothing of this rank's yet

    def snapshot(self, step: int, cursor: DataCursor, model: nn.Module, optimizer: torch.optim.Optimizer,
                 generators: dict) -> bool:
        """Copy the committed state at ``step`` into host memory and send it to the buddy in
        the background. Returns False (skipped) while the last one is still on its way."""
        if self.sending is not None and not self.sending.done():
            return False
        tensors, optim = committed_tensors(model, optimizer)
        with self.lock:
            keep = max((s for s in self.own if s <= self.confirmed), default=None)
            free = [snapshot.arena for s, snapshot in self.own.items() if s != keep]
            self.own = {s: snapshot for s, snapshot in self.own.items() if s == keep}
        arena = next((a for a in [*free, self.spare] if a is not None and a.fits(tensors)), None)
        for unused in [*free, self.spare]:
            if unused is not None and unused is not arena:
                unused.release()
        self.spare = None
        if arena is None:
            arena = StagingArena(tensors)
        snapshot = Snapshot(step, cursor, exported(arena.stage(tensors), optim, generators), arena)
        with self.lock:
            self.own[step] = snapshot
            buddy = self.buddy
        if buddy is None:
            self._confirmed(step)
        else:
            self.sending = self.sender.submit(self._send, buddy, snapshot)
        return True

    def _send(self, buddy, snapshot: Snapshot) -> None:
        _, handle = buddy
        try:
            ray.get(handle.hold_copy.remote(self.rank, snapshot.step, snapshot.cursor, snapshot.state))
        except Exception:  # the buddy is gone: the driver assigns another at the next rebuild
            return
        with self.lock:
            if self.buddy is buddy:
                self._confirmed(snapshot.step)

    def _confirmed(self, step: int) -> None:
        self.confirmed = max(self.confirmed, step)

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
        """A copy of this rank's own state at ``step``, and every copy newer than it dropped:
        the run goes on from ``step``."""
        with self.lock:
            state = copied(self.own[step].state)
            for newer in [s for s in self.own if s > step]:
                self.spare = self.own.pop(newer).arena
            self.held = {owner: held for owner, held in self.held.items() if held[0] <= step}
            self.confirmed = min(self.confirmed, step)
        return state

    def holdings(self) -> Holdings:
        with self.lock:
            return Holdings(
                own={step: snapshot.cursor for step, snapshot in self.own.items()},
                held={owner: (step, cursor) for owner, (step, cursor, _) in self.held.items()},
                nbytes=sum(snapshot.arena.nbytes for snapshot in self.own.values())
                + sum(state_bytes(state) for _, _, state in self.held.values()),
            )

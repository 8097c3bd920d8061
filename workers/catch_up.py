"""A joining rank's catch-up (``elastic.core.protocol.CatchUp``): the run's state arrives in the
background while the live groups go on stepping, and the rank keeps what it needs to reach
them exactly.

The rank takes no samples while it catches up, but it is in the replicate group from the
segment's first step: it sums zeros with the other groups, so every committed step's summed
gradients reach it as they reach every replica. It keeps each one (``KeptUpdate``: the summed
gradients as the step's apply found them, the step's rates and the tokens its experts were
routed) instead of applying it to the state it does not hold yet. Once the state of the
segment's first step has landed, it loads it and applies the kept updates in order, with the
same operations every replica applied them with, so its state is theirs bit for bit.

The copy itself is ``workers.state_transfer``'s, over the segment's replicate group, which holds
both ends already (``World.copy_pair``): the source sends a host copy of its committed state
taken as the segment began, so its own steps go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from elastic.core.protocol import CatchUp, HealReceipt
from workers.failures import HealFailed
from workers.state_transfer import receive_state, send_state
from workers.world import World

# The updates a joining rank keeps at most before it stops to wait for the state: each is a
# copy of its gradient shards.
MAX_KEPT_UPDATES = 64


@dataclass(frozen=True)
class KeptUpdate:
    """A committed step's update, as every replica applied it."""

    gradients: list[torch.Tensor]  # the local shards of the summed gradients, before scaling
    lr_scale: float
    grad_scale: float
    routed: tuple[float, ...]  # the tokens routed to each expert, over every rank of every group


class CatchingUp:
    """A joining rank's state on its way (``arriving``) and the committed updates kept since."""

    def __init__(self, arriving: Future, source: int):
        self.arriving = arriving
        self.source = source
        self.kept: list[KeptUpdate] = []

    def arrived(self) -> bool:
        """The state has landed whole (a copy that failed has not)."""
        return self.arriving.done() and self.arriving.exception() is None

    def check(self) -> None:
        """Raise what the copy raised, if it failed: the rank cannot catch up."""
        if self.arriving.done() and self.arriving.exception() is not None:
            self.state()

    def keep(self, update: KeptUpdate) -> None:
        self.kept.append(update)

    def must_wait(self) -> bool:
        """Whether the rank stops keeping updates and waits for the state before its next
        step: it keeps a copy of its gradients per step, so only so many."""
        return len(self.kept) >= MAX_KEPT_UPDATES

    def state(self, timeout: float | None = None) -> tuple[dict, int, float]:
        """The state of the segment's first step, as it landed, its bytes and the copy's
        seconds; ``HealFailed`` when the copy raised, or has not landed after ``timeout``."""
        try:
            return self.arriving.result(timeout)
        except Exception as error:
            raise HealFailed(f"the state from rank {self.source} did not arrive: {type(error).__name__}: {error}") \
                from error

    def receipt(self, nbytes: int, seconds: float) -> HealReceipt:
        return HealReceipt(self.source, nbytes, seconds, len(self.kept))


def begin_copies(pool: ThreadPoolExecutor, catch_up: CatchUp, name: str, rank: int, world: World, groups: tuple[int, ...],
                 committed_state: Callable[[], dict], nbytes: Callable[[dict], int]) -> CatchingUp | None:
    """A segment's copies on ``pool``'s threads, named ``name``, over the replicate group of the
    segment's ``groups``: a source sends a host copy of its committed state
    (``committed_state``, taken now) to its joining ranks; a joining rank receives its own, and
    gets its catch-up (None for any other rank)."""
    targets = catch_up.targets_of(rank)
    if targets:
        state = committed_state()
        pool.submit(lambda: send_state([world.copy_pair(name, rank, target, groups) for target in targets], state))
    if rank not in catch_up.sources:
        return None
    source = catch_up.sources[rank]

    def receive() -> tuple[dict, int, float]:
        started = time.perf_counter()
        state = receive_state(world.copy_pair(name, source, rank, groups))
        return state, nbytes(state), time.perf_counter() - started

    return CatchingUp(pool.submit(receive), source)

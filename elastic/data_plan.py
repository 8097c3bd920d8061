"""The data plan: which sample indices each rank consumes at a step. Pure and deterministic.

The driver owns the global order: a seeded permutation per epoch, consumed one global
batch per step. The batch is cut into contiguous shares across live groups in proportion
to their weights (equal unless the straggler policy rebalances), each share across the
group's shard positions, and each position's part into micro-batches. Every shard position
of a group gets the same number of micro-batches because FSDP collectives run in lockstep;
an empty slot is a padding sample that carries no loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from workers.train_step import PADDING_INDEX

MicroBatches = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class DataCursor:
    """Where the global order stands; valid at any world size."""

    epoch: int = 0
    position: int = 0


@dataclass(frozen=True)
class GroupPlan:
    group: int
    indices: np.ndarray

    @property
    def samples(self) -> int:
        return len(self.indices)

    def micro_batches(self, shard_index: int, shard: int, micro_batch: int) -> MicroBatches:
        """The micro-batches of one shard position; cut at dispatch, one rank at a time."""
        share, size = self.indices, len(self.indices)
        part = share[shard_index * size // shard : (shard_index + 1) * size // shard].tolist()
        widest = -(-size // shard)
        n_micro = max(1, -(-widest // micro_batch))
        chunks = [tuple(part[i * micro_batch : (i + 1) * micro_batch]) for i in range(n_micro)]
        return tuple(chunk or (PADDING_INDEX,) for chunk in chunks)


@dataclass(frozen=True)
class StepPlan:
    step: int
    cursor: DataCursor
    next_cursor: DataCursor
    global_samples: int
    groups: dict[int, GroupPlan]


@lru_cache(maxsize=4)
def epoch_order(dataset_len: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(dataset_len)
    order.flags.writeable = False
    return order


def take_global_batch(
    cursor: DataCursor, dataset_len: int, batch: int, seed: int
) -> tuple[np.ndarray, DataCursor]:
    """The next ``batch`` indices; an epoch's tail shorter than a batch is skipped."""
    if batch > dataset_len:
        raise ValueError(f"global_batch={batch} exceeds the dataset's {dataset_len} samples")
    if cursor.position + batch > dataset_len:
        cursor = DataCursor(cursor.epoch + 1, 0)
    order = epoch_order(dataset_len, seed, cursor.epoch)
    indices = order[cursor.position : cursor.position + batch]
    return indices, DataCursor(cursor.epoch, cursor.position + batch)


def apportion(total: int, weights: dict[int, float]) -> dict[int, int]:
    """Largest-remainder split of ``total`` items in proportion to ``weights``."""
    weight_sum = sum(weights.values())
    exact = {key: total * weight / weight_sum for key, weight in weights.items()}
    counts = {key: math.floor(value) for key, value in exact.items()}
    by_remainder = sorted(weights, key=lambda key: (counts[key] - exact[key], key))
    for key in by_remainder[: total - sum(counts.values())]:
        counts[key] += 1
    return counts


def plan_step(
    step: int,
    cursor: DataCursor,
    *,
    dataset_len: int,
    global_batch: int,
    seed: int,
    group_weights: dict[int, float],
) -> StepPlan:
    indices, next_cursor = take_global_batch(cursor, dataset_len, global_batch, seed)
    counts = apportion(len(indices), group_weights)
    groups, start = {}, 0
    for group in sorted(group_weights):
        groups[group] = GroupPlan(group, indices[start : start + counts[group]])
        start += counts[group]
    started_at = cursor if cursor.position + global_batch <= dataset_len else DataCursor(cursor.epoch + 1, 0)
    return StepPlan(step, started_at, next_cursor, len(indices), groups)

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
import random
from dataclasses import dataclass
from functools import lru_cache

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
    samples: int
    micro_batches_by_shard: tuple[MicroBatches, ...]


@dataclass(frozen=True)
class StepPlan:
    step: int
    cursor: DataCursor
    next_cursor: DataCursor
    global_samples: int
    groups: dict[int, GroupPlan]


@lru_cache(maxsize=4)
def epoch_order(dataset_len: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(dataset_len))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return tuple(order)


def take_global_batch(
    cursor: DataCursor, dataset_len: int, batch: int, seed: int
) -> tuple[tuple[int, ...], DataCursor]:
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


def split_share(share: tuple[int, ...], shard: int, micro_batch: int) -> tuple[MicroBatches, ...]:
    per_position = [share[i * len(share) // shard : (i + 1) * len(share) // shard] for i in range(shard)]
    n_micro = max(1, max(math.ceil(len(part) / micro_batch) for part in per_position))
    plans = []
    for part in per_position:
        chunks = [part[i * micro_batch : (i + 1) * micro_batch] for i in range(n_micro)]
        plans.append(tuple(chunk or (PADDING_INDEX,) for chunk in chunks))
    return tuple(plans)


def plan_step(
    step: int,
    cursor: DataCursor,
    *,
    dataset_len: int,
    global_batch: int,
    seed: int,
    group_weights: dict[int, float],
    shard: int,
    micro_batch: int,
) -> StepPlan:
    indices, next_cursor = take_global_batch(cursor, dataset_len, global_batch, seed)
    counts = apportion(len(indices), group_weights)
    groups, start = {}, 0
    for group in sorted(group_weights):
        share = indices[start : start + counts[group]]
        start += counts[group]
        groups[group] = GroupPlan(group, len(share), split_share(share, shard, micro_batch))
    started_at = cursor if cursor.position + global_batch <= dataset_len else DataCursor(cursor.epoch + 1, 0)
    return StepPlan(step, started_at, next_cursor, len(indices), groups)

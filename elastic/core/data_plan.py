"""The data plan: which sample indices each rank consumes at a step. Pure and deterministic.

The global order is a seeded permutation per epoch, consumed one global batch per step; the
driver keeps the cursor between segments, and during a segment each rank plans every step itself
with ``rank_share`` from the segment's spec. The batch is cut into contiguous shares across live groups in proportion
to their weights (equal unless the straggler policy rebalances), each share across the
group's shard positions, and each position's part into micro-batches. Every shard position
of a group gets the same number of micro-batches because FSDP collectives run in lockstep;
an empty slot is a padding sample that carries no loss.

The split is computed on arrays (a driver may plan for thousands of groups every step); a
group's ``GroupPlan`` is a view made when dispatch asks for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Protocol

import numpy as np

# A slot of a micro-batch that holds no sample (every shard position runs the same count).
PADDING_INDEX = -1

MicroBatches = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class DataCursor:
    """Where the global order stands; valid at any world size. ``returned``: samples of this
    epoch's order before ``position`` whose training was dropped (a DiLoCo learner lost inside a
    round, ``sync.lost_learner = "drop"``): the next steps take them first."""

    epoch: int = 0
    position: int = 0
    returned: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "returned", tuple(int(index) for index in self.returned))  # a manifest's list

    def with_returned(self, indices: Iterable[int]) -> DataCursor:
        return replace(self, returned=(*self.returned, *indices))


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


class GroupPlans(Mapping[int, GroupPlan]):
    """Each live group's contiguous share of the global batch, by group id (ascending)."""

    def __init__(self, groups: np.ndarray, bounds: np.ndarray, indices: np.ndarray):
        self._groups = groups  # sorted group ids
        self._bounds = bounds  # share g is indices[bounds[i] : bounds[i + 1]]
        self._indices = indices
        self._position = dict(zip(groups.tolist(), range(len(groups))))

    def __getitem__(self, group: int) -> GroupPlan:
        i = self._position[group]
        return GroupPlan(group, self._indices[self._bounds[i] : self._bounds[i + 1]])

    def __iter__(self) -> Iterator[int]:
        return iter(self._position)

    def __len__(self) -> int:
        return len(self._groups)

    def samples(self) -> dict[int, int]:
        """Samples per group, without making the per-group views."""
        return dict(zip(self._groups.tolist(), np.diff(self._bounds).tolist()))


@dataclass(frozen=True)
class StepPlan:
    step: int
    cursor: DataCursor
    next_cursor: DataCursor
    global_samples: int
    groups: GroupPlans


@lru_cache(maxsize=4)
def epoch_order(dataset_len: int, seed: int, epoch: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(dataset_len)
    order.flags.writeable = False
    return order


def take_global_batch(
    cursor: DataCursor, dataset_len: int, batch: int, seed: int
) -> tuple[np.ndarray, DataCursor]:
    """The next ``batch`` indices: the samples returned first, then the epoch's order. An epoch
    trains its order up to a whole number of batches (the tail shorter than a batch is skipped);
    where samples were returned in it, its last batch is shorter, so that it still ends there,
    each of those samples trained once: returned samples are this epoch's, and are trained in it."""
    if batch > dataset_len:
        raise ValueError(f"global_batch={batch} exceeds the dataset's {dataset_len} samples")
    usable = dataset_len - dataset_len % batch
    returned = cursor.returned[:batch]
    if not returned and cursor.position >= usable:
        cursor = DataCursor(cursor.epoch + 1, 0)
    end = min(cursor.position + batch - len(returned), usable)
    indices = epoch_order(dataset_len, seed, cursor.epoch)[cursor.position : end]
    if returned:
        indices = np.concatenate([np.array(returned, dtype=np.int64), indices])
    return indices, DataCursor(cursor.epoch, end, cursor.returned[batch:])


def apportion_array(total: int, weights: np.ndarray, weight_sum: float | None = None) -> np.ndarray:
    """Largest-remainder split of ``total`` items in proportion to ``weights``; ties in the
    remainder go to the lower position. ``weight_sum`` lets a caller pass the sum it
    computed (``apportion`` passes Python's left-to-right sum, so results stay bit-identical)."""
    weight_sum = float(weights.sum()) if weight_sum is None else weight_sum
    exact = total * weights / weight_sum
    counts = np.floor(exact).astype(np.int64)
    left = total - int(counts.sum())
    if left:
        # lexsort's last key is the primary one: largest remainder first, then position.
        by_remainder = np.lexsort((np.arange(len(weights)), counts - exact))
        counts[by_remainder[:left]] += 1
    return counts


def apportion(total: int, weights: dict[int, float]) -> dict[int, int]:
    """Largest-remainder split of ``total`` items in proportion to ``weights`` (ties: lower key)."""
    keys = sorted(weights)
    values = [weights[key] for key in keys]
    counts = apportion_array(total, np.array(values, dtype=np.float64), sum(weights.values()))
    return dict(zip(keys, counts.tolist()))


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
    started_at = cursor if next_cursor.epoch == cursor.epoch else DataCursor(next_cursor.epoch, 0)
    return StepPlan(step, started_at, next_cursor, len(indices), split_across_groups(indices, group_weights))


def plan_eval(step: int, *, dataset_len: int, samples: int, group_weights: dict[int, float]) -> StepPlan:
    """The held-out evaluation at ``step``: the validation set's first ``samples`` samples (all
    of it when smaller), in order, split across groups like a step's batch. The cursor does
    not move."""
    indices = np.arange(min(samples, dataset_len), dtype=np.int64)
    return StepPlan(step, DataCursor(), DataCursor(), len(indices), split_across_groups(indices, group_weights))


def split_across_groups(indices: np.ndarray, group_weights: dict[int, float]) -> GroupPlans:
    """Contiguous shares of ``indices``, one per group, in proportion to the groups' weights."""
    groups = sorted(group_weights)
    weights = np.array([group_weights[group] for group in groups], dtype=np.float64)
    counts = apportion_array(len(indices), weights, sum(group_weights.values()))
    bounds = np.zeros(len(groups) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    return GroupPlans(np.array(groups, dtype=np.int64), bounds, indices)


def group_share(cursor: DataCursor, group_samples: Mapping[int, int], group: int, *, dataset_len: int,
                global_batch: int, seed: int) -> np.ndarray:
    """The samples ``group`` trained in a step that began at ``cursor`` and split its batch as
    ``group_samples`` (each group's count, contiguous in group order)."""
    indices, _ = take_global_batch(cursor, dataset_len, global_batch, seed)
    before = sum(count for other, count in group_samples.items() if other < group)
    return indices[before : before + group_samples.get(group, 0)]


def dropped_samples(steps: Iterable[tuple[DataCursor, Mapping[int, int]]], group: int, *,
                    dataset_len: int, global_batch: int, seed: int) -> list[int]:
    """What ``group`` trained in ``steps`` (each a step's cursor and its split), in step order:
    a DiLoCo round's samples of a learner dropped from it."""
    return [int(index) for cursor, group_samples in steps
            for index in group_share(cursor, group_samples, group, dataset_len=dataset_len,
                                     global_batch=global_batch, seed=seed)]


def group_weights(groups: Iterable[int], decided: Mapping[int, float]) -> dict[int, float]:
    """The quorum's data-plan weights: as the straggler policy decided them, and 1.0 (a
    typical group's) for a group it has not weighed yet, such as one that just joined."""
    return {group: decided.get(group, 1.0) for group in groups}


def token_rescale(global_tokens: int, counted: int) -> float:
    """What turns a sum over the global token count into the mean over the targets that count
    (fewer, where labels are ignored): exactly 1.0 when every target counts."""
    return global_tokens / counted if counted else 1.0


class PlanInputs(Protocol):
    """What the data plan reads of a run: ``elastic.core.protocol.SegmentSpec`` is one. Named here,
    by the plan that reads it, so that the plan does not depend on the messages that carry it."""

    @property
    def dataset_len(self) -> int: ...
    @property
    def global_batch(self) -> int: ...
    @property
    def seed(self) -> int: ...
    @property
    def group_weights(self) -> Mapping[int, float]: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def seq_len(self) -> int: ...


@dataclass(frozen=True)
class RankShare:
    """One rank's part of one step of a run, and what the step means for the whole batch."""

    step: int
    epoch: int  # the epoch the step's samples come from
    next_cursor: DataCursor
    micro_batches: MicroBatches
    global_tokens: int
    global_samples: int
    group_samples: dict[int, int]
    # at a spot check, the next group's micro-batches at this rank's place, which it replays
    replayed: MicroBatches | None = None


def rank_share(spec: PlanInputs, step: int, cursor: DataCursor, group: int, shard_index: int, shard: int) -> RankShare:
    """What the rank at ``shard_index`` of ``group`` trains at ``step`` of the run ``spec``, from
    the data order's ``cursor`` before the step: the ranks' own planning, and the sample ledger
    the tests keep."""
    plan = plan_step(step, cursor, dataset_len=spec.dataset_len, global_batch=spec.global_batch, seed=spec.seed,
                     group_weights=spec.group_weights)
    return RankShare(step, plan.cursor.epoch, plan.next_cursor,
                     plan.groups[group].micro_batches(shard_index, shard, spec.micro_batch),
                     plan.global_samples * spec.seq_len, plan.global_samples, plan.groups.samples())

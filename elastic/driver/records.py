"""What a run records of its committed work: each committed step (``StepResult``) and each
evaluation (``EvalResult``). The step listeners (``ElasticTrainer(on_step=...)``, the
Prometheus metrics, the experiment trackers, the progress bar) get each step's as it is
committed; ``summary.json`` keeps them under ``steps`` and ``eval`` (``outputs/summary.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from elastic.core.protocol import RankTimes, SegmentRecords
from elastic.core.topology import Topology


@dataclass(frozen=True)
class RankArrays:
    """A committed step's per-rank figures, one row per rank (ascending): arrays, as the segment's
    message carried them, so the driver's work per step (the straggler detector's included)
    stays a few array operations however many ranks there are."""

    ranks: np.ndarray
    times: RankTimes  # each an array over the ranks
    samples: np.ndarray  # each rank's group's share of the batch

    @classmethod
    def of_records(cls, message: SegmentRecords, index: int, topology: Topology) -> RankArrays:
        """The ranks' figures of the message's ``index``-th step."""
        record = message.records[index]
        samples = np.fromiter((record.group_samples[group] for group in message.groups), np.float64,
                              len(message.groups))
        return cls(ranks=np.asarray(topology.ranks_of(message.groups), np.int64),
                   times=RankTimes(*message.times[index].T),
                   samples=np.repeat(samples, topology.ranks_per_group))


@dataclass(frozen=True)
class StepResult:
    """A step every live group committed, as the run records it."""

    step: int
    t: float  # seconds into the run when the driver recorded it
    loss: float
    lr: float  # as the ranks applied it: a custom optimizer's own rate times the schedule's factor
    grad_norm: float  # before clipping
    grad_clip_scale: float
    step_s: float  # the slowest group's loop period
    live_groups: int
    live_ranks: int
    generation: int  # the membership's: it changes whenever a group joins or leaves
    tokens_per_s: float
    rank_arrays: RankArrays = field(compare=False, repr=False)  # each rank's times, as arrays: ``rank_times``
    group_samples: dict[int, int]  # each live group's share of the batch
    straggler_scores: dict[int, float] | None = None  # by rank; None where straggler mitigation is off
    expert_load: dict[int, float] = field(default_factory=dict)  # by expert layer: max over mean tokens
    # the bytes every group's ranks handed the cross-group sums in the step (each group hands as many)
    cross_group_bytes: int = 0
    outer_step: bool = False  # a DiLoCo outer step's turn followed it (``StepRecord.outer_step``)
    outer_sum_s: float = 0.0  # its merged outer exchanges' seconds, and those the step waited for
    outer_sum_exposed_s: float = 0.0
    replayed: bool = False  # a spot check: every group's work replayed by another, and reproduced

    @property
    def rank_times(self) -> dict[int, RankTimes]:
        """By global rank, each time rounded to 10 µs."""
        rounded = np.round(np.column_stack(self.rank_arrays.times), 5).tolist()
        return dict(zip(self.rank_arrays.ranks.tolist(), map(RankTimes._make, rounded)))


@dataclass(frozen=True)
class EvalResult:
    """The held-out loss of the state committed at ``step``."""

    step: int
    loss: float
    samples: int
    seconds: float

    def to_json(self) -> dict:
        """The ``evaluated`` event's fields."""
        return asdict(self)

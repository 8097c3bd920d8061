"""What a run records of its committed work: each committed step (``StepResult``) and each
evaluation (``EvalResult``). The step listeners (``ElasticTrainer(on_step=...)``, the
Prometheus metrics, the experiment trackers, the progress bar) get each step's as it is
committed; ``summary.json`` keeps them under ``steps`` and ``eval`` (``outputs/summary.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from elastic.core.protocol import RankTimes


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
    rank_times: dict[int, RankTimes]  # by global rank, each time rounded to 10 µs
    group_samples: dict[int, int]  # each live group's share of the batch
    straggler_scores: dict[int, float] | None = None  # by rank; None where straggler mitigation is off
    expert_load: dict[int, float] = field(default_factory=dict)  # by expert layer: max over mean tokens


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

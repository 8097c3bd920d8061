"""What a run records of its committed work: each committed step (``StepResult``) and each
evaluation (``EvalResult``). The step listeners (``ElasticTrainer(on_step=...)``, the
Prometheus metrics, the experiment trackers, the progress bar) get each step's as it is
committed; ``summary.json`` keeps their ``to_json()`` under ``steps`` and ``eval``.
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

    def to_json(self) -> dict:
        """The step's record in ``summary.json`` (ranks and groups as strings, as JSON keys are)."""
        record = {
            "step": self.step,
            "t": self.t,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "grad_clip_scale": self.grad_clip_scale,
            "step_s": self.step_s,
            "live_groups": self.live_groups,
            "live_ranks": self.live_ranks,
            "generation": self.generation,
            "tokens_per_s": self.tokens_per_s,
            "rank_step_s": {str(rank): times.wall_s for rank, times in self.rank_times.items()},
            "rank_data_s": {str(rank): times.data_s for rank, times in self.rank_times.items()},
            "rank_compute_s": {str(rank): times.compute_s for rank, times in self.rank_times.items()},
            "rank_comm_s": {str(rank): times.comm_s for rank, times in self.rank_times.items()},
            "rank_grad_sum_s": {str(rank): times.grad_sum_s for rank, times in self.rank_times.items()},
            "rank_grad_sum_exposed_s": {str(rank): times.grad_sum_exposed_s for rank, times in self.rank_times.items()},
            "group_samples": {str(group): samples for group, samples in self.group_samples.items()},
        }
        if self.straggler_scores is not None:
            record["rank_straggler_score"] = {str(rank): score for rank, score in self.straggler_scores.items()}
        if self.expert_load:
            record["expert_load"] = {str(layer): load for layer, load in self.expert_load.items()}
        return record


@dataclass(frozen=True)
class EvalResult:
    """The held-out loss of the state committed at ``step``."""

    step: int
    loss: float
    samples: int
    seconds: float

    def to_json(self) -> dict:
        """The evaluation's record in ``summary.json`` and its ``evaluated`` event's fields."""
        return asdict(self)

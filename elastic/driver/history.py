"""The run's history: the step it stands at, the data cursor, and what it committed (losses,
step and evaluation results, counters). One object the controller advances and rewinds and
the summary reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from elastic.core.data_plan import DataCursor
from elastic.core.integrity import check_due
from elastic.core.loss_scale import LossScale
from elastic.core.protocol import RankTimes, RunRecords, StepRecord
from elastic.core.topology import Topology
from elastic.driver.records import EvalResult, StepResult


def time_columns(rows: Sequence[float] | Sequence[RankTimes]) -> RankTimes:
    """Ranks' times, flat or one ``RankTimes`` per rank, as one array per time."""
    return RankTimes(*np.asarray(rows, np.float64).reshape(-1, len(RankTimes._fields)).T)


@dataclass(frozen=True)
class RankArrays:
    """A committed step's per-rank figures, one row per rank (ascending), for the straggler
    detector: arrays, so the driver's work per step stays a few array operations."""

    ranks: np.ndarray
    times: RankTimes  # each an array over the ranks
    samples: np.ndarray  # each rank's group's share of the batch


@dataclass(frozen=True)
class CommittedStep:
    """A step every group of a run committed: the values the groups decided together, and
    each rank's figures."""

    record: StepRecord  # the decided values (loss, norm, rate, shares, cursor), as one group sent them
    ranks: RankArrays
    step_s: float  # the slowest group's loop period

    @classmethod
    def of_groups(cls, records: dict[int, StepRecord]) -> CommittedStep:
        """From each group's own record of the step."""
        ordered = [records[group] for group in sorted(records)]
        first = ordered[0]
        return cls(first, RankArrays(
            ranks=np.fromiter((rank for record in ordered for rank in record.ranks), np.int64),
            times=time_columns([row for record in ordered for row in record.times]),
            samples=np.concatenate([np.full(len(record.ranks), first.group_samples[record.group], np.float64)
                                    for record in ordered]),
        ), max(record.step_s for record in ordered))

    @classmethod
    def of_run(cls, message: RunRecords, topology: Topology) -> list[CommittedStep]:
        """The steps of a run's message, in order."""
        ranks = np.asarray(topology.ranks_of(message.groups), np.int64)
        per_group = topology.ranks_per_group
        return [
            cls(record, RankArrays(
                ranks=ranks,
                times=time_columns(times),
                samples=np.repeat(np.fromiter((record.group_samples[group] for group in message.groups), np.float64,
                                              len(message.groups)), per_group),
            ), max(step_s))
            for record, times, step_s in zip(message.records, message.times, message.step_s)
        ]


@dataclass
class RunHistory:
    step: int = 0  # the next step to train
    first_step: int = 0  # where this driver's run began (a resume's step)
    cursor: DataCursor = DataCursor()
    losses: list[float] = field(default_factory=list)
    step_results: list[StepResult] = field(default_factory=list)
    eval_results: list[EvalResult] = field(default_factory=list)
    steps_discarded: int = 0
    steps_rolled_back: int = 0
    tokens_committed: int = 0
    has_state: bool = False  # the live groups hold a committed state (not only the seed's)
    integrity_every: int = 0  # steps that begin with the replicas' integrity check (0: none)
    # The newest state the replicas' check found identical (or that every group loaded): a
    # corruption the check finds later arose after it.
    verified_step: int = 0
    loss_scale: LossScale | None = None  # fp16's at ``step``: moved on by each commit and overflow

    def commit(self, committed: CommittedStep, *, generation: int, t: float,
               straggler_scores: dict[int, float] | None = None) -> StepResult:
        """Record a step every group of a run committed (their votes agree on the loss, the
        norm and the clipping factor; each group reports its own ranks' times). Returns the
        step's result."""
        first, arrays, step_s = committed.record, committed.ranks, committed.step_s
        tokens = first.counted
        rounded = np.round(np.column_stack(arrays.times), 5).tolist()
        result = StepResult(
            step=self.step, t=t, loss=first.loss, lr=first.lr, grad_norm=first.grad_norm,
            grad_clip_scale=first.clip_scale, step_s=round(step_s, 5), live_groups=len(first.group_samples),
            live_ranks=len(rounded), generation=generation, tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            rank_times=dict(zip(arrays.ranks.tolist(), map(RankTimes._make, rounded))),
            group_samples=dict(first.group_samples), straggler_scores=straggler_scores,
            expert_load=dict(first.expert_load),
        )
        self.losses.append(first.loss)
        self.cursor = first.next_cursor
        self.tokens_committed += tokens
        self.step_results.append(result)
        self.has_state = True
        if check_due(self.step, self.integrity_every) and len(first.group_samples) > 1:
            self.verified_step = self.step
        self.step += 1
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.after_commit()
        return result

    def rewind(self, step: int, cursor: DataCursor) -> None:
        """Continue from ``step`` and ``cursor`` (a checkpoint's, or the initial state's);
        later committed steps rerun."""
        self.step, self.cursor = step, cursor
        kept = max(0, step - self.first_step)
        del self.losses[kept:]
        del self.step_results[kept:]
        self.eval_results = [result for result in self.eval_results if result.step <= step]
        self.has_state = True
        self.verified_step = step

    def eval_due(self, every: int, steps: int) -> bool:
        """Every ``every`` committed steps and after the last one, once per step."""
        if not every or self.step == 0 or (self.eval_results and self.eval_results[-1].step == self.step):
            return False
        return self.step % every == 0 or self.step >= steps

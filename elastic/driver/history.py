"""The run's history: the step it stands at, the data cursor, and what it committed (losses,
step and evaluation results, counters). One object the controller advances and rewinds and
the summary reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic.core.data_plan import DataCursor
from elastic.core.integrity import check_due
from elastic.core.loss_scale import LossScale
from elastic.core.protocol import NonFinite, SegmentRecords
from elastic.driver.records import EvalResult, RankArrays, StepResult


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
    # The newest state no computation error can have spoiled, as far as the spot checks know: the
    # state after the last step whose work was replayed and reproduced (a device that began
    # computing wrong before it would have been found there)
    replayed_step: int = 0
    loss_scale: LossScale | None = None  # fp16's at ``step``: moved on by each commit and overflow
    outer_every: int = 0  # DiLoCo's round (0: every step's sum)
    # The DiLoCo round in progress: each committed step's cursor and split, what a learner
    # dropped from it had trained (``data_plan.dropped_samples``)
    round_steps: list[tuple[DataCursor, dict[int, int]]] = field(default_factory=list)
    # by group, the round's steps whose samples it had trained went back to the plan (it was
    # dropped, and may have joined the round again from its start)
    returned_through: dict[int, int] = field(default_factory=dict)

    def commit(self, message: SegmentRecords, index: int, arrays: RankArrays, *, generation: int, t: float,
               straggler_scores: dict[int, float] | None = None) -> StepResult:
        """Record the message's ``index``-th step, which every group of the segment committed (their
        votes agree on the loss, the norm and the clipping factor; ``arrays`` holds every rank's
        times). Returns the step's result."""
        first, step_s = message.records[index], float(message.step_s[index].max())  # the slowest group's period
        if self.outer_every:
            if self.step % self.outer_every == 0:
                self.round_steps, self.returned_through = [], {}
            self.round_steps.append((self.cursor, dict(first.group_samples)))
        tokens = first.counted
        result = StepResult(
            step=self.step, t=t, loss=first.loss, lr=first.lr, grad_norm=first.grad_norm,
            grad_clip_scale=first.clip_scale, step_s=round(step_s, 5), live_groups=len(first.group_samples),
            live_ranks=len(arrays.ranks), generation=generation, tokens_per_s=tokens / step_s if step_s > 0 else 0.0,
            rank_arrays=arrays, group_samples=dict(first.group_samples), straggler_scores=straggler_scores,
            expert_load=dict(first.expert_load), cross_group_bytes=first.cross_group_bytes * len(first.group_samples),
            outer_step=first.outer_step, outer_sum_s=first.outer_sum_s, outer_sum_exposed_s=first.outer_sum_exposed_s,
            replayed=first.replayed,
        )
        self.losses.append(first.loss)
        self.cursor = first.next_cursor
        self.tokens_committed += tokens
        self.step_results.append(result)
        self.has_state = True
        if check_due(self.step, self.integrity_every) and len(first.group_samples) > 1:
            self.verified_step = self.step
        if first.replayed:
            self.replayed_step = self.step + 1
        self.step += 1
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.after_commit()
        return result

    def discard_nonfinite(self, step: NonFinite) -> None:
        """Every rank discarded the step; fp16's overflow halved their loss scales, so it halves here too."""
        self.steps_discarded += 1
        if step.overflow:
            self.loss_scale = self.loss_scale.after_overflow()

    def rewind(self, step: int, cursor: DataCursor) -> None:
        """Continue from ``step`` and ``cursor`` (a checkpoint's, or the initial state's);
        later committed steps rerun."""
        self.step, self.cursor = step, cursor
        self.round_steps, self.returned_through = [], {}
        kept = max(0, step - self.first_step)
        del self.losses[kept:]
        del self.step_results[kept:]
        self.eval_results = [result for result in self.eval_results if result.step <= step]
        self.has_state = True
        self.verified_step = self.replayed_step = step

    def round_steps_of(self, group: int) -> list[tuple[DataCursor, dict[int, int]]]:
        """The round's committed steps whose samples ``group`` trained and has not returned."""
        return self.round_steps[self.returned_through.get(group, 0):]

    def return_samples(self, groups: list[int], indices: list[int]) -> None:
        """What ``groups`` trained of the round's steps so far, dropped: the next steps take it first."""
        self.cursor = self.cursor.with_returned(indices)
        for group in groups:
            self.returned_through[group] = len(self.round_steps)

    def eval_due(self, every: int, steps: int) -> bool:
        """Every ``every`` committed steps and after the last one, once per step."""
        if not every or self.step == 0 or (self.eval_results and self.eval_results[-1].step == self.step):
            return False
        return self.step % every == 0 or self.step >= steps

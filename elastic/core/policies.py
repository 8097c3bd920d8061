"""Small swappable policies the controller consults: step deadlines, failures, scaling."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from elastic.core.diagnosis import Cause, Diagnosis
from elastic.core.exits import Ending, Exit
from elastic.core.protocol import NonFinite


def segment_boundary(step: int, steps: int, every: tuple[int, ...], fault_step: int | None) -> int:
    """The step before which a segment from ``step`` pauses: the end, the next checkpoint or
    evaluation due (``every``, 0 for off), or an injected fault's step."""
    stops = [steps, *((step // interval + 1) * interval for interval in every if interval)]
    if fault_step is not None:
        stops.append(fault_step)
    return max(step + 1, min(stops))


# A rank's committed state per byte of its parameters: the parameters and an Adam's two moments
# of them (the product's own count: ``elastic.setup.memory_estimate.host_memory_per_rank``).
STATE_PER_PARAMETER_BYTE = 3
# A copy's speed before the run has timed one of its own: the slowest rank-to-rank copy measured
# (``bench/heal_transport.py`` on a 2-core machine, 0.31 GB in 1.25 s). Slow on purpose: a large
# state is then foreseen long and catches up, and a small one still heals in a moment.
FIRST_COPY_BYTES_PER_S = 0.25e9


def expected_copy_s(copy_s: float | None, parameter_bytes: int) -> float | None:
    """How long a heal's copy is expected to take: the run's last copy's ``copy_s``, else,
    before it has one, the copy of the state of a rank with ``parameter_bytes`` of parameters
    at ``FIRST_COPY_BYTES_PER_S``; None when neither is known."""
    if copy_s is not None:
        return copy_s
    if parameter_bytes <= 0:
        return None
    return STATE_PER_PARAMETER_BYTE * parameter_bytes / FIRST_COPY_BYTES_PER_S


def catch_up_pays(copy_s: float | None, step_s: float, live: int, joining: int) -> bool:
    """Whether groups joining take the state while the live groups step (``CatchUp``) rather
    than at the boundary, every group waiting. Waiting costs the whole job the copy's
    ``copy_s``; catching up costs it the joining groups' share of the step rate for the whole
    steps the copy lasts (one at least: the live groups take their samples). ``copy_s``: how
    long the copy is expected to take (``expected_copy_s``), None when nothing is known of it
    (the catch-up then, which is what a large state needs); ``step_s``: a typical step, 0
    before one is timed."""
    if copy_s is None or step_s <= 0:
        return True
    steps = max(1, math.ceil(copy_s / step_s))
    return steps * step_s * joining / (live + joining) < copy_s


class StepDeadline:
    """Deadline for a step, derived from recent step times (a hang detector)."""

    def __init__(self, factor: float, min_s: float, first_s: float, history: int = 20):
        self.factor, self.min_s, self.first_s = factor, min_s, first_s
        self.recent: deque[float] = deque(maxlen=history)

    def record(self, step_s: float) -> None:
        self.recent.append(step_s)

    def seconds(self) -> float:
        if len(self.recent) < 3:
            return self.first_s
        return max(self.min_s, self.factor * statistics.median(self.recent))

    def typical_s(self) -> float:
        """The median recent step time (0 before any step is timed)."""
        return statistics.median(self.recent) if self.recent else 0.0


@dataclass
class DivergencePolicy:
    """Steps whose loss or gradient norm is not finite are discarded; this many in a row
    (nothing committed between them) mean the run has diverged."""

    max_nonfinite_steps: int
    in_a_row: int = 0

    def diverged(self, step: NonFinite) -> Exit | None:
        """Count one more discarded step: the run's exit once it has diverged, else None."""
        self.in_a_row += 1
        if self.in_a_row < self.max_nonfinite_steps:
            return None
        return Exit(Ending.DIVERGED, f"{self.in_a_row} steps in a row with a loss or gradient norm that is not finite "
                                     f"(step {step.step}: loss {step.loss}, grad norm {step.grad_norm}); lower "
                                     "optimizer.lr, set optimizer.clip_grad_norm, or check the data")

    def committed(self) -> None:
        self.in_a_row = 0


@dataclass
class FailurePolicy:
    """Recover in place, unless no fresh process would fail differently or the budget of
    recoveries is spent. An error that is the data's or the code's, not the cluster's:
    a rank's own-data or own-code error, the same own error on several ranks at once, or the
    same own error at the same step again after the ranks that raised it were replaced."""

    max_recoveries: int
    recoveries: int = 0
    last_errors: tuple[int, frozenset[str]] = (-1, frozenset())  # the last failure's step and own errors

    def refusal(self, step: int, diagnosis: Diagnosis) -> str | None:
        """None: recover; else why the run stops instead (no rank is evicted then)."""
        own = {rank: diagnosis.errors.get(rank, "?") for rank, cause in diagnosis.culprits.items()
               if cause in (Cause.OWN_DATA, Cause.OWN_CODE, Cause.OWN_ERROR)}
        errors = frozenset(own.values())
        again = errors & self.last_errors[1] if self.last_errors[0] == step else frozenset()
        self.last_errors = (step, errors)
        data = sorted(rank for rank, cause in diagnosis.culprits.items() if cause == Cause.OWN_DATA)
        if data:
            return (f"rank {data[0]}'s data failed: {own[data[0]]} (own-data: the data or the dataset's code, "
                    "not the cluster; fix it and resume)")
        if len(own) > 1 and len(errors) == 1:
            return (f"ranks {sorted(own)} raised the same error: {next(iter(errors))} (the code or the data, "
                    "not the cluster; fix it and resume)")
        code = sorted(rank for rank, cause in diagnosis.culprits.items() if cause == Cause.OWN_CODE)
        if code:
            return (f"rank {code[0]} raised an error in your code: {own[code[0]]} (the code or the data, not the "
                    "cluster; fix it and resume)")
        if again:
            return (f"the same error again on fresh processes: {min(again)} (the code or the data, not the "
                    "cluster; fix it and resume)")
        self.recoveries += 1
        if self.recoveries > self.max_recoveries:
            last = f" (the last: {min(diagnosis.errors.values())})" if diagnosis.errors else ""
            return f"after {self.max_recoveries} recoveries{last}; raise fault_tolerance.max_recoveries"
        return None


@dataclass
class ScalingPolicy:
    """How many replica groups to want, between min and max.

    A group evicted for being slow is not regrown at once: the cluster would most likely
    place its replacement on the same slow node. The ceiling drops by one per such eviction
    until its cool-down ends.
    """

    min_groups: int
    max_groups: int
    held_back_until: list[float] = field(default_factory=list)

    def hold_back_one(self, until: float) -> None:
        self.held_back_until.append(until)

    def wants_more(self, groups_held: int, now: float) -> bool:
        self.held_back_until = [until for until in self.held_back_until if until > now]
        ceiling = max(self.min_groups, self.max_groups - len(self.held_back_until))
        return groups_held < ceiling

    def below_minimum(self, live_or_healing: int) -> bool:
        return live_or_healing < self.min_groups

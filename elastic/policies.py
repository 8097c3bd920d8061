"""Small swappable policies the controller consults: step deadlines, failures, scaling."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


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


@dataclass
class FailurePolicy:
    """Keep recovering in place until the budget of recoveries is spent."""

    max_recoveries: int
    recoveries: int = 0

    def allow_recovery(self) -> bool:
        self.recoveries += 1
        return self.recoveries <= self.max_recoveries


@dataclass(frozen=True)
class ScalingPolicy:
    """How many replica groups to want, between min and max."""

    min_groups: int
    max_groups: int

    def wants_more(self, groups_held: int) -> bool:
        return groups_held < self.max_groups

    def below_minimum(self, live_or_healing: int) -> bool:
        return live_or_healing < self.min_groups

"""Small swappable policies the controller consults: step deadlines, failures, scaling."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


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
class FailurePolicy:
    """Keep recovering in place until the budget of recoveries is spent."""

    max_recoveries: int
    recoveries: int = 0

    def allow_recovery(self) -> bool:
        self.recoveries += 1
        return self.recoveries <= self.max_recoveries


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

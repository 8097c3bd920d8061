"""The learning-rate schedule: a pure function of the committed step.

Linear warmup from ``1 / (warmup_steps + 1)`` of the peak to the peak, then a constant,
cosine or linear decay to ``min_ratio`` of the peak at ``decay_steps``, and ``min_ratio``
after it. Every rank computes the factor of each step it applies (the schedule travels in the
run's spec), so the schedule depends on nothing but the step: not on the number of live groups, the
faults on the way, or a resume (the checkpoint's step is where it continues).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Decay = Literal["constant", "cosine", "linear"]


@dataclass(frozen=True)
class LRSchedule:
    peak_lr: float
    warmup_steps: int = 0
    decay: Decay = "constant"
    decay_steps: int = 1  # the step at which the decay reaches min_ratio
    min_ratio: float = 0.0

    def factor(self, step: int) -> float:
        """The fraction of ``peak_lr`` that step ``step`` (0-based) trains with."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        if self.decay == "constant":
            return 1.0
        span = self.decay_steps - self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / span) if span > 0 else 1.0
        if self.decay == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = 1.0 - progress
        return self.min_ratio + (1.0 - self.min_ratio) * shape

    def lr(self, step: int) -> float:
        return self.peak_lr * self.factor(step)

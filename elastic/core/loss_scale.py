"""fp16's dynamic loss scale: pure, and the same on every rank of every group.

fp16 holds numbers up to 65504 and loses the small ones: the loss is multiplied by the
scale before backward so that small gradients survive, and the gradients divided by it
before they are applied. A step whose gradients overflow (a norm that is not finite while
the loss is finite) is discarded by the groups' vote, as any non-finite step, and the scale
halves; after ``growth_interval`` committed steps in a row it doubles. The driver keeps the
scale with the run's history and hands it to every rank in the run's spec; each rank moves it
on by the same rule after each step it commits, so every group holds the same scale at every
step without a message about it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Below this the scale no longer keeps gradients from overflowing: the step itself is not finite.
MIN_SCALE = 1.0


@dataclass(frozen=True)
class LossScale:
    value: float = 2.0**16
    good_steps: int = 0  # committed steps since the scale last changed
    growth_interval: int = 2000

    def after_commit(self) -> LossScale:
        if self.good_steps + 1 >= self.growth_interval:
            return replace(self, value=self.value * 2, good_steps=0)
        return replace(self, good_steps=self.good_steps + 1)

    def after_overflow(self) -> LossScale:
        return replace(self, value=max(self.value / 2, MIN_SCALE), good_steps=0)

    @property
    def exhausted(self) -> bool:
        """Whether halving it again would not help: an overflow now is the step's own."""
        return self.value <= MIN_SCALE


def saved_loss_scale(scale: LossScale | None) -> dict[str, float]:
    """What a checkpoint's manifest records of the scale (nothing without one)."""
    return {} if scale is None else {"value": scale.value, "good_steps": scale.good_steps}


def restored_loss_scale(saved: dict[str, float], now: LossScale | None) -> LossScale | None:
    """The scale a run continues with from a checkpoint: the one it recorded, under the run's
    growth interval; a checkpoint without one (or a run without fp16) keeps ``now``."""
    if now is None or not saved:
        return now
    return replace(now, value=float(saved["value"]), good_steps=int(saved["good_steps"]))

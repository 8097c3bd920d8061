"""Goodput: wall time attributed to what it was spent on, with an injectable clock.

Goodput is the share of wall time spent in steps that were committed. Every other second is
charged to one of the named overheads, and whatever no charge covered is ``idle``, so the
parts always add up to the wall time. Timings nest (a checkpoint saved while recovering):
the inner one's seconds go to its own category and are not charged to the outer one too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

# In the order reports show them: the useful time first, what remained uncharged last.
CATEGORIES = ("committed", "evaluation", "recovery", "discarded", "checkpoint_stall", "startup", "idle")


class TimeLedger:
    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.started_at = clock()
        self.seconds = {category: 0.0 for category in CATEGORIES if category != "idle"}
        self._open: list[tuple[str, float]] = []  # (category, charged up to)

    def charge(self, category: str, seconds: float) -> None:
        if category not in self.seconds:
            raise KeyError(f"unknown time category {category!r}; use one of {CATEGORIES}")
        self.seconds[category] += seconds

    @contextmanager
    def timing(self, category: str) -> Iterator[None]:
        now = self.clock()
        self._settle_open(now)
        self._open.append((category, now))
        try:
            yield
        finally:
            now = self.clock()
            self._settle_open(now)
            self._open.pop()
            if self._open:
                self._open[-1] = (self._open[-1][0], now)

    def _settle_open(self, now: float) -> None:
        """Charge the innermost open timing up to ``now``."""
        if self._open:
            category, since = self._open[-1]
            self.charge(category, now - since)
            self._open[-1] = (category, now)

    def wall(self) -> float:
        return self.clock() - self.started_at

    def breakdown(self) -> dict[str, float]:
        wall = self.wall()
        parts = dict(self.seconds)
        parts["idle"] = max(0.0, wall - sum(parts.values()))
        return {"wall_s": wall, **parts}

    def goodput(self) -> float:
        return goodput_of({"committed": self.seconds["committed"], "wall_s": self.wall()})


def goodput_of(breakdown: Mapping[str, float]) -> float:
    """Committed step time over the wall time, of a breakdown by category with its ``wall_s``:
    a leg's, a whole run's or a ledger's now (0 before any time has passed)."""
    wall = breakdown.get("wall_s", 0.0)
    return breakdown.get("committed", 0.0) / wall if wall > 0 else 0.0

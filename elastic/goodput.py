"""Goodput: wall time attributed to what it was spent on, with an injectable clock.

Goodput is the share of wall time spent in steps that were committed. Every other second is
charged to one of the named overheads, and whatever no charge covered is ``idle``, so the
parts always add up to the wall time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

CATEGORIES = ("startup", "committed", "discarded", "recovery", "checkpoint_stall", "idle")


class TimeLedger:
    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.started_at = clock()
        self.seconds = {category: 0.0 for category in CATEGORIES if category != "idle"}

    def charge(self, category: str, seconds: float) -> None:
        if category not in self.seconds:
            raise KeyError(f"unknown time category {category!r}; use one of {CATEGORIES}")
        self.seconds[category] += seconds

    @contextmanager
    def timing(self, category: str) -> Iterator[None]:
        started = self.clock()
        try:
            yield
        finally:
            self.charge(category, self.clock() - started)

    def wall(self) -> float:
        return self.clock() - self.started_at

    def breakdown(self) -> dict[str, float]:
        wall = self.wall()
        parts = dict(self.seconds)
        parts["idle"] = max(0.0, wall - sum(parts.values()))
        return {"wall_s": wall, **parts}

    def goodput(self) -> float:
        wall = self.wall()
        return self.seconds["committed"] / wall if wall > 0 else 0.0

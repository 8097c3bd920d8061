"""How long a recovery took, part by part: from the failure's detection (or the failed work's
start) until the next committed step, with the drain, the cross-group rebuilds and the heals
or restores on the way. One recovery is open at a time; a failure during it extends it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic.core.events import EventKind, EventLog


@dataclass
class OpenRecovery:
    cause: str
    culprits: dict[int, str]
    detected_at: float
    detect_s: float
    drain_s: float = 0.0
    rebuild_s: float = 0.0
    heal_s: float = 0.0


class RecoveryTiming:
    def __init__(self, events: EventLog, clock: Callable[[], float]):
        self.events = events
        self.clock = clock
        self.open_recovery: OpenRecovery | None = None

    def open(self, cause: str, culprits: dict[int, str], detected_at: float, detect_s: float,
             drain_s: float) -> None:
        if self.open_recovery is None:
            self.open_recovery = OpenRecovery(cause, dict(culprits), detected_at, detect_s, drain_s)

    def add(self, part: str, seconds: float) -> None:
        """``part``: ``rebuild_s`` or ``heal_s``; nothing when no recovery is open."""
        if self.open_recovery is not None:
            setattr(self.open_recovery, part, getattr(self.open_recovery, part) + seconds)

    def close(self, step: int) -> None:
        """A step committed: the recovery, if one is open, is over."""
        recovery, self.open_recovery = self.open_recovery, None
        if recovery is None:
            return
        self.events.emit(
            EventKind.RECOVERED, cause=recovery.cause, culprits=recovery.culprits, step=step,
            detect_s=round(recovery.detect_s, 4), drain_s=round(recovery.drain_s, 4),
            rebuild_s=round(recovery.rebuild_s, 4), heal_s=round(recovery.heal_s, 4),
            total_s=round(self.clock() - recovery.detected_at, 4),
        )

"""How long a recovery took, part by part: from the failed work's start until the next committed
step. Its parts, in the order they happen: ``detect_s`` (until the failure was seen), ``drain_s``
(the other ranks' reports), ``start_s`` (the replacement processes started, or warm spares
assumed the ranks), ``build_s`` (the group's world and model built on every rank), ``rebuild_s``
(the cross-group process groups), ``heal_s`` (the state copied from a peer, or restored), and
``first_step_s`` (from the run's restart to its first commit); ``other_s`` is the rest (the
driver's polls between them). Groups start and build side by side, so those two parts are the
longest group's. The parts add up to ``total_s`` unless they overlapped (a group that builds
while the survivors step); ``other_s`` is then 0. One recovery is open at a time; a failure during it extends it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic.core.events import EventKind, EventLog

# The ``recovered`` event's parts, in the order they happen.
MEASURED_PARTS = ("detect_s", "drain_s", "start_s", "build_s", "rebuild_s", "heal_s")
RECOVERY_PARTS = (*MEASURED_PARTS, "first_step_s", "other_s")


@dataclass
class OpenRecovery:
    cause: str
    culprits: dict[int, str]
    detected_at: float
    detect_s: float
    drain_s: float = 0.0
    start_s: float = 0.0
    build_s: float = 0.0
    rebuild_s: float = 0.0
    heal_s: float = 0.0
    stepping_since: float | None = None  # when the ranks were last handed a run


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
        """``part``: ``rebuild_s`` or ``heal_s``, which happen one after another; nothing when no
        recovery is open."""
        if self.open_recovery is not None:
            setattr(self.open_recovery, part, getattr(self.open_recovery, part) + seconds)

    def longest(self, part: str, seconds: float) -> None:
        """``part``: ``start_s`` or ``build_s``, which groups do side by side."""
        if self.open_recovery is not None:
            setattr(self.open_recovery, part, max(getattr(self.open_recovery, part), seconds))

    def stepping(self) -> None:
        """The ranks were handed a run: what follows until a commit is the first step's."""
        if self.open_recovery is not None:
            self.open_recovery.stepping_since = self.clock()

    def close(self, step: int) -> None:
        """A step committed: the recovery, if one is open, is over."""
        recovery, self.open_recovery = self.open_recovery, None
        if recovery is None:
            return
        now = self.clock()
        parts = {part: getattr(recovery, part) for part in MEASURED_PARTS}
        parts["first_step_s"] = now - recovery.stepping_since if recovery.stepping_since is not None else 0.0
        total = now - recovery.detected_at
        parts["other_s"] = max(0.0, total - sum(parts.values()))
        self.events.emit(EventKind.RECOVERED, cause=recovery.cause, culprits=recovery.culprits, step=step,
                         **{part: round(seconds, 4) for part, seconds in parts.items()}, total_s=round(total, 4))

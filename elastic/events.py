"""Structured run events: every detection, eviction, rebuild, heal, join, straggler decision
and checkpoint is one ``{t, kind, ...}`` record, logged as it happens and kept for the summary."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("elastic.events")


class EventLog:
    def __init__(self, clock: Callable[[], float], started_at: float | None = None):
        self.clock = clock
        self.started_at = clock() if started_at is None else started_at
        self.events: list[dict[str, Any]] = []
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"t": round(self.clock() - self.started_at, 4), "kind": kind, **fields}
        self.events.append(event)
        log.info("%s", json.dumps(event, default=str))
        for listener in self.listeners:
            listener(event)
        return event

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event["kind"] == kind]

"""Acting at an exact point of a run: the driver logs each event as JSON to ``elastic.events``,
and a handler there runs in the driver's own thread as the event is emitted, before the run
goes on. A test that acts on an event instead of after a guessed time holds at any speed."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastic.core.events import EventKind


class EventHook(logging.Handler):
    def __init__(self, kind: EventKind, action: Callable[[dict], None]):
        super().__init__(logging.INFO)
        self.kind = EventKind(kind).value
        self.action = action

    def emit(self, record: logging.LogRecord) -> None:
        event = json.loads(record.getMessage())
        if event["kind"] == self.kind:
            self.action(event)


@contextmanager
def on_events(actions: dict[EventKind, Callable[[dict], None]]) -> Iterator[None]:
    """Calls ``actions[kind](event)`` for each event of that kind while the block runs."""
    events = logging.getLogger("elastic.events")
    level = events.level
    hooks = [EventHook(kind, action) for kind, action in actions.items()]
    events.setLevel(logging.INFO)
    for hook in hooks:
        events.addHandler(hook)
    try:
        yield
    finally:
        for hook in hooks:
            events.removeHandler(hook)
        events.setLevel(level)

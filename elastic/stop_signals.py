"""Stop signals, caught in one place: SIGTERM (preemption, ``ray job stop``, a pod's eviction)
and Ctrl-C. Before the trainer takes them over (``SignalsBeforeTheRun``, while the command
checks the config and imports torch and Ray) and while the run goes on (``StopOnSignals``),
the first asks the run to stop at a step boundary with a checkpoint and the second stops it
at once. Plain ``signal`` and the core's events: the command imports this before anything
heavy."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

from elastic.core.events import EventKind, EventLog
from elastic.core.exits import PREEMPTED_CODE


class SignalsBeforeTheRun:
    """SIGTERM or Ctrl-C before the trainer takes the signals over (while the config and data
    are checked and torch and Ray import, seconds): remembered, so that the run ends preempted
    with its summary written instead of dying without one. A second one exits at once, 143:
    a check stuck on storage that does not answer must not hold the command."""

    def __init__(self):
        self._received: str | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self._received is not None:
            raise SystemExit(PREEMPTED_CODE)
        self._received = signal.Signals(signum).name
        print(f"elastic: {self._received} before the run started: it stops before training (send it again to "
              "stop at once)", file=sys.stderr, flush=True)

    def received(self) -> str | None:
        return self._received


class StoppedBeforeStart(Exception):
    """A stop signal came before Ray started: the run ends preempted, with nothing to save."""


class SecondSignal(BaseException):
    """A second SIGTERM or Ctrl-C while the run stops: it stops at once, not at the step
    boundary. A BaseException, so that no handler of errors between here and ``fit`` takes it
    for a fault of the run's own."""


def second_signal_behind(error: BaseException) -> SecondSignal | None:
    """The second signal ``error`` is, or came from: raised in a call into Ray's C++ core (a
    wait), it comes out as that call's SystemError, caused by it."""
    while error is not None and not isinstance(error, SecondSignal):
        error = error.__cause__ or error.__context__
    return error


class StopOnSignals:
    """SIGTERM (preemption, ``ray job stop``, pod eviction) and Ctrl-C ask the controller to
    stop at the next step boundary with a checkpoint, instead of killing the driver mid-step;
    a second one stops the run at once (``SecondSignal``). Once the run is ``finishing`` (its
    summary written, its actors stopped) a signal changes nothing: the run has its ending."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, stop: threading.Event, events: EventLog):
        self.stop, self.events, self.previous = stop, events, {}
        self.finishing = False

    def _handle(self, signum, _frame) -> None:
        if self.finishing:
            return
        if self.stop.is_set():
            raise SecondSignal(signal.Signals(signum).name)  # the user insists
        self.stop.set()
        self.events.emit(EventKind.STOP_REQUESTED, signal=signal.Signals(signum).name)

    def catch(self, caught_before: Callable[[], str | None] = lambda: None) -> None:
        """Take the signals over. ``caught_before``: the signal a caller caught until now, if
        any, read once these handlers are in place (so none falls between), as if it came now."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._handle)
                self.previous.setdefault(sig, previous)
        name = caught_before()
        if name is not None and not self.stop.is_set():
            self.stop.set()
            self.events.emit(EventKind.STOP_REQUESTED, signal=name)

    def release(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

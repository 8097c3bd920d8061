"""The run protocol of one rank (``elastic.core.protocol``), decision by decision.

A rank steps through its run on its own; around each step it decides what the driver hears
and when the run ends. The rank actor (``workers.worker``) and the fake fleet of the tests
(``tests.fake_fleet``) both follow this one loop, so what the controller is tested against is
what the ranks do:

- a group's first rank asks for the records to go out after the run's first step, then after
  the first step that starts in each new ``report_interval_s`` (``step_starts``); the groups'
  first ranks add their asks up in the step's cross-group sum, so they all send at the same
  step, gathered into one message for the run (a run of one group sends its own);
- the run ends after its last step, or after a step whose vote agreed to pause; a group's
  first rank then sends what it holds, its own, and every rank its ``RunEnd``;
- after a failed or discarded step, a group's first rank sends the records it holds, then
  every rank its ``RunEnd``;
- at steps that are multiples of ``memory_every``, every rank copies its committed state
  into host memory.

Plain data in, decisions out; the time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastic.core.protocol import RunSpec, StepRecord


@dataclass(frozen=True)
class SendRecords:
    """The committed records a group's first rank sends now."""

    records: tuple[StepRecord, ...]
    gathered: bool  # every group's, gathered by the groups' first ranks; else the group's own


@dataclass(frozen=True)
class AfterCommit:
    """What follows a committed step."""

    send: SendRecords | None  # None: the records stay held
    run_ends: bool  # the run's last step, or the ranks agreed to pause after it


def memory_snapshot_due(spec: RunSpec, next_step: int) -> bool:
    """Whether the ranks copy their state into host memory once ``next_step`` is where they stand."""
    return bool(spec.memory_every) and next_step % spec.memory_every == 0


class RankRunLoop:
    """One rank's run: its records held, and when they go out."""

    def __init__(self, spec: RunSpec, leads_group: bool, now: float):
        self.spec = spec
        self.leads_group = leads_group  # the group's first rank: it holds and sends the group's records
        self.started = now
        self.lap = now  # when the last step ended: a record's ``step_s`` is the whole loop's period
        self.reported = -1  # the report interval last sent in (by its steps' starts), counted from the run's start
        self.step_interval = 0  # the report interval the step in progress started in
        self.records: list[StepRecord] = []

    def _interval(self, now: float) -> int:
        return int((now - self.started) / self.spec.report_interval_s)

    def step_starts(self, now: float) -> bool:
        """A step starts at ``now``: whether this rank asks, in its cross-group sum, for the
        run's records to go out after it. The group's first rank does in a report interval it
        has not sent in yet (the run's first step's is one)."""
        self.step_interval = self._interval(now)
        return self.leads_group and self.step_interval > self.reported

    def committed(self, record: StepRecord, pause: bool, report: bool, now: float) -> AfterCommit:
        """The step of ``record`` committed at ``now``; ``pause`` and ``report``: what the
        ranks agreed in its vote and cross-group sum."""
        if self.leads_group:  # every rank of the group decided the same record
            self.records.append(replace(record, step_s=now - self.lap))
        self.lap = now
        run_ends = record.step + 1 >= self.spec.stop_step or pause
        if not self.leads_group or not (run_ends or report):
            return AfterCommit(None, run_ends)
        # A run that ends sends each group's own: a group may end while another goes on.
        send = SendRecords(tuple(self.records), gathered=report and not run_ends and len(self.spec.groups) > 1)
        self.records, self.reported = [], self.step_interval
        return AfterCommit(send, run_ends)

    def held(self) -> tuple[StepRecord, ...]:
        """The records held when the run stops on a failed or discarded step: they go out
        before the rank's ``RunEnd``."""
        held, self.records = tuple(self.records), []
        return held

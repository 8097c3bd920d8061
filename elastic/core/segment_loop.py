"""The segment protocol of one rank (``elastic.core.protocol``), decision by decision.

A rank steps through its segment on its own; around each step it decides what the driver hears
and when the segment ends. The rank actor (``workers.worker``) and the fake fleet of the tests
(``tests.fake_fleet``) both follow this one loop, so what the controller is tested against is
what the ranks do:

- a group's first rank asks for the records to go out after the segment's first step, then after
  the first step that starts in each new ``records_interval_s`` (``step_starts``); the groups'
  first ranks add their asks up in the step's cross-group sum, so they all send at the same
  step, gathered into one message for the segment (a segment of one group sends its own);
- the segment ends after its last step, or after a step whose vote agreed to pause; a group's
  first rank then sends what it holds, its own, and every rank its ``SegmentEnd``;
- after a failed or discarded step, a group's first rank sends the records it holds, then
  every rank its ``SegmentEnd``;
- at steps that are multiples of ``memory_every``, every rank copies its committed state
  into host memory (not a joining rank still catching up: it does not hold the state yet);
- in a segment with a catch-up (``CatchUp``), every rank plans the steps' shares with the
  joining groups' empty until the vote of a step says every joining rank holds the state, and
  from the next step with the segment's weights.

Plain data in, decisions out; the time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from elastic.core.protocol import SegmentSpec, StepRecord


@dataclass(frozen=True)
class SendRecords:
    """The committed records a group's first rank sends now."""

    records: tuple[StepRecord, ...]
    gathered: bool  # every group's, gathered by the groups' first ranks; else the group's own


@dataclass(frozen=True)
class AfterCommit:
    """What follows a committed step."""

    send: SendRecords | None  # None: the records stay held
    segment_ends: bool  # the segment's last step, or the ranks agreed to pause after it


def memory_snapshot_due(spec: SegmentSpec, next_step: int) -> bool:
    """Whether the ranks copy their state into host memory once ``next_step`` is where they stand."""
    return bool(spec.memory_every) and next_step % spec.memory_every == 0


class RankSegmentLoop:
    """One rank's segment: its records held, and when they go out."""

    def __init__(self, spec: SegmentSpec, leads_group: bool, now: float):
        self.spec = spec
        self.leads_group = leads_group  # the group's first rank: it holds and sends the group's records
        self.started = now
        self.lap = now  # when the last step ended: a record's ``step_s`` is the whole loop's period
        self.sent_in = -1  # the records interval last sent in (by its steps' starts), counted from the segment's start
        self.step_interval = 0  # the records interval the step in progress started in
        self.records: list[StepRecord] = []
        # every joining rank holds the state, as the votes said (or before the first step)
        self.caught_up = spec.catch_up is None or spec.catch_up.before_first_step

    def planning(self) -> SegmentSpec:
        """The spec the rank plans its next step's share from."""
        return self.spec if self.caught_up else self.spec.while_catching_up()

    def _interval(self, now: float) -> int:
        return int((now - self.started) / self.spec.records_interval_s)

    def step_starts(self, now: float) -> bool:
        """A step starts at ``now``: whether this rank asks, in its cross-group sum, for the
        segment's records to go out after it. The group's first rank does in a records interval it
        has not sent in yet (the segment's first step's is one)."""
        self.step_interval = self._interval(now)
        return self.leads_group and self.step_interval > self.sent_in

    def committed(self, record: StepRecord, pause: bool, records_due: bool, now: float,
                  caught_up: bool = True) -> AfterCommit:
        """The step of ``record`` committed at ``now``; ``pause``, ``records_due`` and
        ``caught_up`` (every joining rank holds the state after it): what the ranks agreed in its
        vote and cross-group sum."""
        self.caught_up = self.caught_up or caught_up
        if self.leads_group:  # every rank of the group decided the same record
            self.records.append(replace(record, step_s=now - self.lap))
        self.lap = now
        segment_ends = record.step + 1 >= self.spec.stop_step or pause
        if not self.leads_group or not (segment_ends or records_due):
            return AfterCommit(None, segment_ends)
        # A segment that ends sends each group's own: a group may end while another goes on.
        send = SendRecords(tuple(self.records), gathered=records_due and not segment_ends and len(self.spec.groups) > 1)
        self.records, self.sent_in = [], self.step_interval
        return AfterCommit(send, segment_ends)

    def held(self) -> tuple[StepRecord, ...]:
        """The records held when the segment stops on a failed or discarded step: they go out
        before the rank's ``SegmentEnd``."""
        held, self.records = tuple(self.records), []
        return held

"""Collecting a dispatched step: every rank's report within the step's deadline, and, when
the step failed, the abort, the drain and the diagnosis.

The first failure (a dead rank, an error report, the deadline) ends the wait: the hung
ranks are killed, the others are told to abort, and the rest of the reports are drained
before ``diagnose`` names the culprits. All waiting goes through the fleet, with deadlines
from the injected clock.
"""

from __future__ import annotations

from collections.abc import Callable

from elastic.core.diagnosis import Diagnosis, diagnose, least_progressed
from elastic.core.events import EventKind, EventLog
from elastic.core.policies import StepDeadline
from elastic.core.topology import Topology
from elastic.fleet import Fleet, Pending
from workers.protocol import StepReport

# How long a rank of a group that lost a member gets to report its error after the abort,
# before it counts as blocked in its group's collectives.
ABORT_SETTLE_S = 0.25
# How long a rank of a healthy group gets to return after the abort, at the least: it is
# computing its share or waiting in the cross-group all-reduce, and must not be mistaken for
# a stuck rank because the driver's call took a moment to reach it on a loaded node.
ABORT_GRACE_S = 2.0


class StepCollection:
    def __init__(self, fleet: Fleet, topology: Topology, deadline: StepDeadline, events: EventLog,
                 clock: Callable[[], float]):
        self.fleet = fleet
        self.topology = topology
        self.deadline = deadline
        self.events = events
        self.clock = clock
        self.failure_seen_at = 0.0  # when the last failed step's first failure was seen

    def collect(self, pending: Pending, step: int, attempt: int, started: float,
                deadline_s: float) -> tuple[dict[int, StepReport], Diagnosis | None]:
        """The step's reports, and its diagnosis when it failed."""
        dispatched = pending.ranks
        reports: dict[int, StepReport] = {}
        dead: set[int] = set()
        hung: list[int] = []
        failed = False
        while pending.refs and not failed:
            remaining = deadline_s - (self.clock() - started)
            if remaining <= 0:
                progress = self.fleet.probe(pending.ranks, timeout=5)
                hung = least_progressed(progress.values()) or sorted(set(pending.ranks) - set(progress))
                self.events.emit(EventKind.STEP_DEADLINE, step=step, deadline_s=round(deadline_s, 3), hung=hung)
                failed = True
                break
            failed = self._receive(self.fleet.next_reports(pending, remaining), reports, dead)
        if not failed:
            return reports, None
        self.failure_seen_at = self.clock()
        for rank in hung:
            self.fleet.kill(rank)
        still_running = Pending({rank: ref for rank, ref in pending.refs.items() if rank not in hung})
        self.fleet.abort_step(still_running.ranks, attempt)
        group_of = {rank: self.topology.group_of(rank) for rank in dispatched}
        stuck = self._drain(still_running, reports, dead, hung, group_of, started + deadline_s)
        diagnosis = diagnose(dead=dead, reports=reports, hung=hung, stuck=stuck, group_of=group_of)
        return reports, diagnosis

    @staticmethod
    def _receive(arrived: list[tuple[int, StepReport | None]], reports: dict, dead: set) -> bool:
        """File the reports that arrived; returns whether any says the step failed."""
        failed = False
        for rank, report in arrived:
            if report is None:
                dead.add(rank)
                failed = True
            else:
                reports[rank] = report
                failed |= not report.ok
        return failed

    def _drain(self, pending: Pending, reports: dict, dead: set, hung: list[int], group_of: dict[int, int],
               step_deadline: float) -> list[int]:
        """Collect the rest of a failed step; returns the ranks blocked in their own group.

        A group that lost a member (or whose world failed) is broken: its other ranks block
        in its collectives, get ``ABORT_SETTLE_S`` to report, and are then counted as stuck.
        A rank of a healthy group is computing its own share, not stuck: the abort stops its
        group at the next micro-batch boundary (or at the cross-group all-reduce), so it
        returns within a micro-batch. It gets until the step's deadline, and at least a
        typical step time (never less than ``ABORT_GRACE_S``) from now.
        """
        settle_until = self.clock() + ABORT_SETTLE_S
        finish_until = max(step_deadline, self.clock() + max(ABORT_GRACE_S, self.deadline.typical_s()))
        while pending.refs:
            broken = diagnose(dead=dead, reports=reports, hung=hung, group_of=group_of).broken_groups
            now = self.clock()
            waiting = {rank: ref for rank, ref in pending.refs.items()
                       if now < (settle_until if group_of[rank] in broken else finish_until)}
            if not waiting:
                break
            until = settle_until if any(group_of[rank] in broken for rank in waiting) else finish_until
            arrived = self.fleet.next_reports(Pending(waiting), until - now)
            for rank, _ in arrived:
                del pending.refs[rank]
            self._receive(arrived, reports, dead)
        return pending.ranks

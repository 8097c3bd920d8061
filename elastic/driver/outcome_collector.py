"""Collecting the ranks' final outcomes of their work, and the drain after a failure.

An evaluation's outcomes are collected here (``OutcomeCollector.collect``) within its
deadline. The first failure (a dead rank, an error outcome, the deadline) ends the wait: the
hung ranks are found and killed, the others are told to abort (the ranks of a broken group
that stay blocked are then released), and the rest of the outcomes are drained before
``diagnose`` names the culprits (``OutcomeCollector.after_failure``, the
one way failed work ends: a segment's watch, ``segment_watch``, ends its failures through it too,
so after any failure the other ranks get the same time to report). All waiting goes
through the fleet, with deadlines from the injected clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic.core.diagnosis import Diagnosis, diagnose, least_advanced
from elastic.core.events import EventKind, EventLog
from elastic.core.policies import StepDeadline
from elastic.core.protocol import RankOutcome
from elastic.core.topology import Topology
from elastic.fleet.api import FleetApi, Pending

# How long a rank of a group that lost a member gets to report its error after the abort,
# before it counts as blocked in its group's collectives and is released.
ABORT_SETTLE_S = 0.25
# How long a rank of a healthy group gets to return after the abort, at the least: it is
# computing its share or waiting in the cross-group all-reduce, and must not be mistaken for
# a stuck rank because the driver's call took a moment to reach it on a loaded node.
ABORT_GRACE_S = 2.0

# (ranks still waited for, seconds) -> the final outcomes that arrived (None: process gone)
Receive = Callable[[list[int], float], list[tuple[int, RankOutcome | None]]]
# Close the connections of the ranks' group worlds, so that their waits on a peer raise.
Release = Callable[[list[int]], None]


@dataclass(frozen=True)
class FailureSeen:
    """Work that failed: what the drain found, and when the failure was seen (the drain began)."""

    diagnosis: Diagnosis
    seen_at: float


def receive_into(arrived: list[tuple[int, RankOutcome | None]], outcomes: dict, dead: set) -> bool:
    """File the outcomes that arrived; returns whether any says the work failed."""
    failed = False
    for rank, outcome in arrived:
        if outcome is None:
            dead.add(rank)
            failed = True
        else:
            outcomes[rank] = outcome
            failed |= not outcome.ok
    return failed


def drain(receive: Receive, release: Release, waiting: set[int], outcomes: dict, dead: set, hung: list[int],
          group_of: dict[int, int], step_deadline: float, deadline: StepDeadline,
          clock: Callable[[], float]) -> list[int]:
    """Collect the rest of a failed step; returns the ranks stuck in their own group.

    A group that lost a member (or whose world failed) is broken: its other ranks get
    ``ABORT_SETTLE_S`` to report. One still silent then waits on a peer that left the step
    (a pipeline stage for its neighbour, a collective, the vote): it is released (its
    group's connections closed, so its wait raises) and gets ``ABORT_GRACE_S`` more, as the
    release is a call that must reach it on a loaded node too; only then is it stuck.
    A rank of a healthy group is computing its own share, not stuck: the abort stops its
    group at the next micro-batch boundary (or at the cross-group all-reduce), so it
    returns within a micro-batch. It gets until the step's deadline, and at least a
    typical step time (never less than ``ABORT_GRACE_S``) from now.
    """
    settle_until = clock() + ABORT_SETTLE_S
    finish_until = max(step_deadline, clock() + max(ABORT_GRACE_S, deadline.typical_s()))
    released: dict[int, float] = {}  # rank -> until when it may report after its release
    while waiting:
        broken = diagnose(dead=dead, outcomes=outcomes, hung=hung, group_of=group_of).broken_groups

        def until(rank: int) -> float:
            return released.get(rank, settle_until) if group_of[rank] in broken else finish_until

        now = clock()
        open_ranks = [rank for rank in sorted(waiting) if now < until(rank)]
        if not open_ranks:
            blocked = [rank for rank in sorted(waiting) if group_of[rank] in broken and rank not in released]
            if not blocked:
                break
            release(blocked)
            released.update(dict.fromkeys(blocked, clock() + ABORT_GRACE_S))
            continue
        arrived = receive(open_ranks, min(map(until, open_ranks)) - now)
        for rank, _ in arrived:
            waiting.discard(rank)
        receive_into(arrived, outcomes, dead)
    return sorted(waiting)


class OutcomeCollector:
    def __init__(self, fleet: FleetApi, topology: Topology, deadline: StepDeadline, events: EventLog,
                 clock: Callable[[], float]):
        self.fleet = fleet
        self.topology = topology
        self.deadline = deadline
        self.events = events
        self.clock = clock

    def collect(self, pending: Pending, step: int, attempt: int, started: float,
                deadline_s: float) -> tuple[dict[int, RankOutcome], FailureSeen | None]:
        """The outcomes, and the failure when the work failed."""
        dispatched = pending.ranks
        outcomes: dict[int, RankOutcome] = {}
        dead: set[int] = set()
        hung: list[int] = []
        failed = False
        while pending.refs and not failed:
            remaining = deadline_s - (self.clock() - started)
            if remaining <= 0:
                hung = self.find_hung(pending.ranks, step, deadline_s)
                failed = True
                break
            failed = receive_into(self.fleet.next_outcomes(pending, remaining), outcomes, dead)
        if not failed:
            return outcomes, None

        def receive(ranks: list[int], timeout: float):
            arrived = self.fleet.next_outcomes(Pending({rank: pending.refs[rank] for rank in ranks}), timeout)
            for rank, _ in arrived:
                del pending.refs[rank]
            return arrived

        group_of = {rank: self.topology.group_of(rank) for rank in dispatched}
        failure = self.after_failure(pending.ranks, hung, attempt, receive, outcomes, dead, group_of,
                                     started + deadline_s)
        return outcomes, failure

    def after_failure(self, unfinished: list[int], hung: list[int], attempt: int, receive: Receive,
                      outcomes: dict[int, RankOutcome], dead: set[int], group_of: dict[int, int],
                      step_deadline: float) -> FailureSeen:
        """The one way failed work ends, a segment's or an evaluation's: the hung ranks killed,
        the others aborted (and the blocked ones released), the rest of the outcomes drained
        (``drain``), the culprits named."""
        seen_at = self.clock()
        waiting = self.abort(unfinished, hung, attempt)
        stuck = drain(receive, lambda ranks: self.fleet.release_step(ranks, attempt), waiting, outcomes, dead, hung,
                      group_of, step_deadline, self.deadline, self.clock)
        return FailureSeen(diagnose(dead=dead, outcomes=outcomes, hung=hung, stuck=stuck, group_of=group_of), seen_at)

    def find_hung(self, unfinished: list[int], step: int, deadline_s: float) -> list[int]:
        """Past the deadline: the unfinished ranks that made the least progress (or do not
        answer the probe)."""
        activities = self.fleet.probe(unfinished, timeout=5)
        hung = least_advanced(activities.values()) or sorted(set(unfinished) - set(activities))
        self.events.emit(EventKind.STEP_DEADLINE, step=step, deadline_s=round(deadline_s, 3), hung=hung)
        return hung

    def abort(self, unfinished: list[int], hung: list[int], attempt: int) -> set[int]:
        """Kill the hung ranks and abort the rest; returns the ranks still to hear from."""
        for rank in hung:
            self.fleet.kill(rank)
        waiting = set(unfinished) - set(hung)
        self.fleet.end_attempt(attempt)
        return waiting

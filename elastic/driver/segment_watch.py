"""Watching a segment: the groups' committed steps as they stream in, the silence that means a
hang, and, when a step failed, the abort, the drain and the diagnosis.

The driver is off the steps' path: it reads the segment's messages (a ``SegmentRecords`` carries
every group's committed steps since the last; a ``GroupRecords`` one group's, from a segment of
one group or a segment's end) and hands each step on once every group of the segment has reported
it. A group that stays silent longer than the step deadline plus the interval between its batches
is probed like a step past its deadline; the same ``least_advanced`` names the hung
rank; so does a failure that only blames peers (ranks that waited out the step's deadline
in the cross-group sum). The first failure (a rank gone, a failed ``SegmentEnd``, the silence)
ends the segment as failed evaluations end (``OutcomeCollector.after_failure``): the hung killed,
the others aborted and drained, and ``diagnose`` naming the culprits.

A segment every rank ended on a step the replicas' integrity check discarded is a failure
without culprits: the positions that disagreed name the suspect groups, which heal.

After a failure, only the groups that stay healthy say what is committed: the segment's next
step is the furthest a healthy group reached. A healthy group behind it (its last cross-group
sum failed where another group's completed) is sent to rebuild and heal like a broken one,
so every live group holds the same state when the next segment starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from elastic.core.compute_replay import ComputeMismatch
from elastic.core.diagnosis import diagnose_compute, diagnose_mismatch
from elastic.core.events import EventKind
from elastic.core.integrity import IntegrityMismatch
from elastic.core.protocol import (
    GroupRecords,
    HealReceipt,
    NonFinite,
    RankOutcome,
    SegmentEnd,
    SegmentRecords,
    SegmentSpec,
    StepRecord,
)
from elastic.fleet.api import FleetApi, SegmentStream
from elastic.driver.outcome_collector import ABORT_SETTLE_S, FailureSeen, OutcomeCollector, receive_into

# How often the driver looks up from the stream for its own duties (uploads to commit,
# groups joining, a pause to request) while nothing arrives, and reads every rank's stream.
WATCH_POLL_S = 0.25
TICK_S = 1e-6
# A wait can return a moment before its timeout: a poll due within this is due now, rather
# than waited for in slivers.
POLL_SLACK_S = 0.01

# Hands on a step every group of the segment committed: the message that carried it, and its place there.
StepCommitted = Callable[[SegmentRecords, int], None]


@dataclass(frozen=True)
class SegmentOutcome:
    next_step: int  # the first step that no group left healthy committed
    failure: FailureSeen | None  # None: the segment paused at next_step as planned or asked
    committed_until: float  # clock time of the last committed step (or of the segment's start)
    nonfinite: NonFinite | None = None  # the segment stopped on a step whose loss or norm was not finite
    healed: dict[int, HealReceipt] = field(default_factory=dict)  # the joining ranks' catch-ups, by rank


class SegmentInbox:
    """What a segment's streams have said so far: the steps each group committed, in order of
    step, handed on once every group of the segment has it (``commit_complete``); every rank's
    final outcome, the ranks gone, each rank's next step, the discarded step's findings."""

    def __init__(self, spec: SegmentSpec, on_step: StepCommitted, clock: Callable[[], float]):
        self.on_step, self.clock = on_step, clock
        self.groups = spec.groups
        started = clock()
        self.records: dict[int, dict[int, StepRecord]] = {}  # by step, the groups that sent their own
        self.complete: dict[int, tuple[SegmentRecords, int]] = {}  # by step, its message and place in it
        self.ends: dict[int, RankOutcome] = {}  # every rank's final outcome: its failure, or ok
        self.next_steps: dict[int, int] = {}
        self.dead: set[int] = set()
        self.heard_at = dict.fromkeys(self.groups, started)
        self.next = spec.first_step  # the next step to hand on
        self.committed_until = started  # when the last was
        self.nonfinite: NonFinite | None = None
        self.mismatches: dict[tuple[int, ...], IntegrityMismatch] = {}  # by position, from the ranks that found them
        self.not_reproduced: dict[tuple[int, ...], ComputeMismatch] = {}  # a spot check's findings, alike
        self.healed: dict[int, HealReceipt] = {}

    def file(self, arrived) -> list[tuple[int, RankOutcome | None]]:
        """File the records among the messages that arrived and hand on the steps now
        complete; returns the final outcomes among them (None: a rank gone)."""
        finals = []
        for rank, message in arrived:
            # A step can come twice: from the segment's message, and from a group's own when its
            # segment ended before it heard that the gather went through.
            if isinstance(message, SegmentRecords):
                self.heard_at.update(dict.fromkeys(message.groups, self.clock()))
                self.complete.update((record.step, (message, index)) for index, record in enumerate(message.records)
                                     if record.step >= self.next)
                continue
            if isinstance(message, GroupRecords):
                self.heard_at[message.group] = self.clock()
                for record in message.records:
                    if record.step >= self.next:
                        self.records.setdefault(record.step, {})[message.group] = record
                continue
            if isinstance(message, SegmentEnd):
                self.next_steps[rank] = message.next_step
                self.nonfinite = self.nonfinite or message.nonfinite
                if message.integrity is not None:
                    self.mismatches[message.integrity.position] = message.integrity
                if message.replay is not None:
                    self.not_reproduced[message.replay.position] = message.replay
                if message.healed is not None:
                    self.healed[rank] = message.healed
                message = message.failure or RankOutcome(rank, message.next_step)
            finals.append((rank, message))
        self.commit_complete()
        return finals

    def receive(self, arrived) -> bool:
        """``file`` the messages, the final outcomes too; returns whether any rank's work failed."""
        return receive_into(self.file(arrived), self.ends, self.dead)

    def commit_next(self) -> None:
        own = self.records.pop(self.next, None)
        self.on_step(*self.complete.pop(self.next, None) or (SegmentRecords.of_groups(
            {group: [record] for group, record in own.items()}), 0))
        self.next += 1
        self.committed_until = self.clock()

    def commit_complete(self) -> None:
        while self.next in self.complete or len(self.records.get(self.next, ())) == len(self.groups):
            self.commit_next()

    def only_victims_reported(self, hung: list[int]) -> bool:
        return not hung and not self.dead and all(outcome.blames_peers for outcome in self.ends.values()
                                                 if not outcome.ok)


class SegmentWatch:
    def __init__(self, collector: OutcomeCollector):
        self.collector = collector
        self.fleet: FleetApi = collector.fleet
        self.topology = collector.topology
        self.clock = collector.clock

    def watch(self, stream: SegmentStream, spec: SegmentSpec, on_step: StepCommitted,
              between: Callable[[], None]) -> SegmentOutcome:
        """Hand on each step every group committed, call ``between`` while waiting, and
        return how the segment ended."""
        inbox = SegmentInbox(spec, on_step, self.clock)
        started = self.clock()
        group_of = {rank: self.topology.group_of(rank) for rank in stream.ranks}
        # Between polls of every rank, the wait is on the groups' first ranks only (they carry
        # the records; a peer's death or failure reaches them through the group's collectives),
        # so the driver's work per message does not grow with the group's size.
        leaders = [self.topology.global_ranks(group)[0] for group in spec.groups]
        polled_at = started
        hung: list[int] = []
        failed = False
        while stream.generators and not failed:
            silence_s = spec.deadline_s + spec.records_interval_s
            now = self.clock()
            # what is left of each group's allowed silence, and of the time to the next poll (a
            # remainder under TICK_S counts as none: the clock may not move by less)
            watched_groups = {group_of[rank] for rank in stream.generators}
            silent_for = silence_s - (now - min(inbox.heard_at[group] for group in watched_groups))
            if silent_for < TICK_S:
                if polled_at < now + silent_for:
                    # A silence is judged on a reading of every stream made after it ran out:
                    # what a group sent while the driver was elsewhere (a listener that
                    # blocked, a commit to slow storage, a loaded host) is not its silence.
                    polled_at = now
                    failed = inbox.receive(self.fleet.next_messages(stream, 0.0))
                    continue
                hung = self.collector.find_hung(stream.ranks, inbox.next, silence_s)
                failed = True
                break
            to_poll = WATCH_POLL_S - (now - polled_at)
            if to_poll < POLL_SLACK_S:
                polled_at = now
                arrived = self.fleet.next_messages(stream, 0.0)
            else:
                wait_s = min(to_poll, silent_for)
                # once a first rank has ended its segment, the others' ends follow: wait on all
                arrived = self.fleet.next_messages(
                    stream, wait_s, leaders if all(rank in stream.generators for rank in leaders) else None)
            failed = inbox.receive(arrived)
            if not failed:
                between()
        if not failed and inbox.mismatches:
            return replace(self.integrity_failed(list(inbox.mismatches.values()), inbox.next, inbox.committed_until),
                           healed=inbox.healed)
        if not failed and inbox.not_reproduced:
            return replace(self.replay_failed(list(inbox.not_reproduced.values()), inbox.next, inbox.committed_until),
                           healed=inbox.healed)
        if not failed:
            return SegmentOutcome(inbox.next, None, inbox.committed_until, inbox.nonfinite, inbox.healed)
        if inbox.only_victims_reported(hung):
            # Only victims have reported so far. A peer that died tells it through its own
            # stream, which the wait on first ranks skipped: read every stream for that long.
            settle_until = self.clock() + ABORT_SETTLE_S
            while stream.generators and not inbox.dead and self.clock() < settle_until:
                inbox.receive(self.fleet.next_messages(stream, settle_until - self.clock()))
        if inbox.only_victims_reported(hung):
            # Ranks gave up waiting on a peer at the step's deadline before the silence was
            # long enough here: the same probe names the peer they waited for.
            hung = self.collector.find_hung(stream.ranks, inbox.next, spec.deadline_s)
        for rank in hung:  # killed as the culprit: their streams end, but not as deaths
            stream.generators.pop(rank, None)

        def receive(ranks: list[int], timeout: float):
            return inbox.file(self.fleet.next_messages(stream, timeout, ranks))

        failure = self.collector.after_failure(stream.ranks, hung, stream.attempt, receive, inbox.ends, inbox.dead,
                                               group_of, self.clock() + spec.deadline_s)
        diagnosis = failure.diagnosis
        healthy = {group: min(inbox.next_steps.get(rank, inbox.next) for rank in self.topology.global_ranks(group))
                   for group in spec.groups if group not in diagnosis.broken_groups}
        reached = max(healthy.values(), default=inbox.next)
        behind = {group for group, step in healthy.items() if step < reached}
        while inbox.next < reached:  # steps a healthy group committed that a broken one never reported
            inbox.commit_next()
        diagnosis = replace(diagnosis, broken_groups=diagnosis.broken_groups | behind)
        return SegmentOutcome(inbox.next, replace(failure, diagnosis=diagnosis), inbox.committed_until,
                              healed=inbox.healed)

    def integrity_failed(self, mismatches: list[IntegrityMismatch], next_step: int,
                         committed_until: float) -> SegmentOutcome:
        """Every rank discarded ``next_step``: replicas disagreed about the state it began from."""
        seen_at = self.clock()
        for mismatch in sorted(mismatches, key=lambda found: found.position):
            self.collector.events.emit(EventKind.INTEGRITY_MISMATCH, step=mismatch.step,
                                        position=list(mismatch.position), suspects=list(mismatch.suspects),
                                        majority=list(mismatch.majority), tensors=list(mismatch.tensors))
        return SegmentOutcome(next_step, FailureSeen(diagnose_mismatch(mismatches), seen_at), committed_until)

    def replay_failed(self, found: list[ComputeMismatch], next_step: int, committed_until: float) -> SegmentOutcome:
        """Every rank discarded ``next_step``: a spot check's replays did not reproduce some
        groups' work; the rank that computed wrong is named where three groups or more could,
        else the ranks it may be."""
        seen_at = self.clock()
        for mismatch in sorted(found, key=lambda finding: finding.position):
            self.collector.events.emit(EventKind.SILENT_CORRUPTION_FOUND, step=mismatch.step,
                                        position=list(mismatch.position), groups=list(mismatch.mismatched),
                                        suspects=list(mismatch.suspect_ranks), named=mismatch.named)
        return SegmentOutcome(next_step, FailureSeen(diagnose_compute(found, self.topology.group_of), seen_at),
                              committed_until)

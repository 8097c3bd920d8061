"""A fleet without Ray, on a fake clock: ranks are entries in a table, a segment's messages arrive
at the times its steps and a scripted fault would make them arrive, and every call is recorded.

It speaks the fleet's interface (``elastic.fleet.api``), so the real controller and
checkpoint coordinator run against it unchanged, each scenario in milliseconds. Timing model
of a step: every rank computes for ``step_s`` (times its slowness, read as the step starts)
and the ranks of all groups then meet in the cross-group all-reduce and their groups' votes,
so a step ends when its slowest rank finishes, and the next one starts at once. A run is
simulated step by step as the fake clock reaches it: a pause requested before a step's vote
ends the segment after that step, as the ranks' votes would decide, and the groups' first ranks
send their records as the ranks' own segment loop decides (``elastic.core.segment_loop``).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

from elastic.core.data_plan import rank_share
from elastic.core.gradient_clipping import clip_coefficient
from elastic.core.integrity import IntegrityMismatch, check_due, compare
from elastic.core.memory_tier import Holdings, MemoryRestore
from elastic.core.protocol import (
    EvalRequest,
    GroupRecords,
    HealReceipt,
    NonFinite,
    Phase,
    RECORD_MESSAGES,
    RankActivity,
    RankOutcome,
    RankTimes,
    SegmentEnd,
    SegmentRecords,
    SegmentSpec,
    StepRecord,
)
from elastic.core.segment_loop import RankSegmentLoop, memory_snapshot_due
from elastic.core.spares import Spare
from elastic.core.topology import Topology
from elastic.fleet.api import CallFailed, HealCopy, Pending, RanksLost, SegmentStream

NEVER = float("inf")
NOTICE_S = 0.05  # a peer notices a dead rank's closed connection
RETURN_S = 0.01  # a waiting rank returns after the driver's abort
STATE_BYTES = 1 << 20  # each rank's committed state, as a heal moves it

# pickle.dumps(torch.distributed.checkpoint.metadata.Metadata(state_dict_metadata={})): the
# metadata of an empty DCP checkpoint, as bytes, so that this module imports no torch
EMPTY_DCP_METADATA = (b"\x80\x04\x95\x91\x00\x00\x00\x00\x00\x00\x00\x8c%torch.distributed.checkpoint.metadata\x94"
                      b"\x8c\x08Metadata\x94\x93\x94)\x81\x94}\x94(\x8c\x13state_dict_metadata\x94}\x94\x8c\x0cplanner_data"
                      b"\x94N\x8c\x0cstorage_data\x94N\x8c\x0cstorage_meta\x94N\x8c\x07version\x94Nub.")


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass(frozen=True)
class Kill:
    rank: int
    after_s: float = 0.5
    # Peers that wait on a living peer which left the step (a pipeline stage on its
    # neighbour): they report only once the driver releases them.
    blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Hang:
    rank: int


@dataclass(frozen=True)
class CollectiveError:
    rank: int


@dataclass(frozen=True)
class CopyFailed:
    """A joining rank's catch-up copy fails: it ends the step failed, holding no state."""

    rank: int
    why: str


@dataclass(frozen=True)
class Flip:
    """A bit flips in the rank's state as the step starts: no error, only the integrity
    check's fingerprints tell."""

    rank: int


@dataclass
class Upload:
    global_rank: int
    ok: bool
    upload_s: float = 0.0
    files: dict = field(default_factory=dict)
    error: str | None = None
    rng: dict | None = None


@dataclass
class Call:
    """A call in flight: ready at ``at`` (absolute fake time), with its result."""

    at: float
    result: object = None
    # For a step: how the rank's report depends on the driver's abort, or on its release.
    waits_for_abort: bool = False
    activity: RankActivity | None = None
    waits_for_release: bool = False
    released_at: float | None = None


class FakeFleet:
    def __init__(self, topology: Topology, clock: FakeClock, *, step_s: float = 1.0, capacity: int | None = None,
                 start_s: float = 0.0, start_stagger_s: float = 0.0, spare_slot: bool = False, upload_s: float = 0.2, stall_s: float = 0.05,
                 grad_sq_norm: float = 0.0):
        self.topology = topology
        self.clock = clock
        self.step_s = step_s
        self.capacity = capacity  # groups the cluster can place; None: every group
        self.start_s = start_s
        self.start_stagger_s = start_stagger_s  # each further rank of a start comes up this much later
        self.spare_slot = spare_slot
        self.upload_s = upload_s
        self.stall_s = stall_s
        self.grad_sq_norm = grad_sq_norm  # each rank's part of the squared gradient norm
        self.unplaceable: set[int] = set()
        self.faults: dict[int, list] = {}  # step -> faults fired at its first dispatch
        self.nonfinite: dict[int, int] = {}  # step -> how many more tries of it sum to a NaN loss
        self.slow: dict[int, float] = {}
        # control call -> [(rank, "die" | "raise")], fired once, the next time the call runs
        self.control_faults: dict[str, list[tuple[int, str]]] = {}
        self.hook_errors: dict[int, str] = {}  # rank -> what its hooks raise at every build (HookFailed)
        self.corrupt: set[int] = set()  # ranks whose state differs from their replicas' (a Flip)
        # target rank -> why its rank-to-rank heal fails, the next time it heals (it then goes
        # through the object store)
        self.heal_fallbacks: dict[int, str] = {}
        # target rank -> why its catch-up's copy fails, the next time it catches up (its group
        # then builds again and heals at the boundary)
        self.catch_up_failures: dict[int, str] = {}
        # the memory tier: each live rank's own copies (step -> cursor, the newest two) and the
        # copies it keeps for the ranks it is buddy to (owner -> step -> cursor, the newest two)
        self.buddies: dict[int, int | None] = {}
        self.own_copies: dict[int, dict] = {}
        self.held_copies: dict[int, dict] = {}
        self.memory_restores: list = []
        # warm spares: id -> when it is ready (fake time); lost ones reported once: id -> why
        self.spare_ready_at: dict[int, float] = {}
        self.spares_lost: dict[int, tuple[str, bool]] = {}
        self.spares_reserved = False
        self.spares_started = 0
        self.spares_taken: list[tuple[int, int]] = []  # (rank, spare)
        self.fail_uploads = False
        self.delivered: list[tuple[int, object]] = []  # every segment message the driver read, in order
        self.fail_staging = False
        self.stuck_steps: set[int] = set()  # saves of these steps write their file, then never end
        self.reserved: list[int] = []
        self.alive_ranks: set[int] = set()
        self.aborted_at: float | None = None
        self.segment: FakeSegment | None = None  # the segment started last
        # what the driver did
        self.releases: list[list[int]] = []  # the ranks of each release_step call
        self.starts: list[int] = []
        self.kills: list[int] = []  # every kill call, of a live process or not
        self.copies: list[tuple[int, int]] = []
        self.restores: list[tuple[tuple[int, ...], str]] = []
        self.segments: list[dict[int, SegmentSpec]] = []
        self.evaluations: list[dict[int, EvalRequest]] = []
        self.pauses: list[tuple[int, float]] = []  # (run, fake time) of each pause request
        self.paused_ranks: list[list[int]] = []  # the ranks each pause request was sent to
        self.saves: list[str] = []
        self.abandoned: list[tuple[int, ...]] = []  # the ranks of each save given up on
        self.restored_generators: list[dict] = []

    # placement

    def reserve(self, group: int) -> None:
        self.reserved.append(group)

    def placed(self, group: int) -> bool:
        placeable = [g for g in self.reserved if g not in self.unplaceable]
        if self.capacity is not None:
            placeable = placeable[: self.capacity]
        return group in placeable

    def has_spare_slot(self) -> bool:
        return self.spare_slot or any(at <= self.clock() for at in self.spare_ready_at.values())

    def release(self, group: int) -> None:
        self.reserved.remove(group)

    # rank processes

    def start(self, ranks, spares: dict[int, int] | None = None) -> Pending:
        spares = spares or {}
        calls = {}
        for place, rank in enumerate(ranks):
            self.alive_ranks.add(rank)
            self.own_copies[rank], self.held_copies[rank] = {}, {}  # a fresh process holds nothing
            self.slow.pop(rank, None)  # a fresh process on a healthy slot
            if rank in spares:
                self.spares_taken.append((rank, spares[rank]))
                calls[rank] = Call(max(self.clock(), self.spare_ready_at.pop(spares[rank])))
            else:
                self.starts.append(rank)
                calls[rank] = Call(self.clock() + self.start_s + place * self.start_stagger_s)
        return Pending(calls)

    def reserve_spares(self) -> None:
        self.spares_reserved = True

    def start_spares(self, count: int) -> list[int]:
        started = list(range(self.spares_started, self.spares_started + count))
        for spare in started:
            self.spare_ready_at[spare] = self.clock() + self.start_s
        self.spares_started += count
        return started

    def spares(self) -> list[Spare]:
        lost = [Spare(spare, False, lost=why, warm_up_raised=raised) for spare, (why, raised) in self.spares_lost.items()]
        self.spares_lost = {}
        return lost + [Spare(spare, at <= self.clock(), "node-0" if at <= self.clock() else None)
                       for spare, at in sorted(self.spare_ready_at.items())]

    def lose_spare(self, spare: int, why: str, raised: bool = False) -> None:
        del self.spare_ready_at[spare]
        self.spares_lost[spare] = (why, raised)

    def build(self, ranks, world_build: int) -> Pending:
        own_errors = {rank: self.hook_errors[rank] for rank in ranks if rank in self.hook_errors}
        if own_errors:
            raise CallFailed(list(own_errors), "; ".join(f"rank {r}: {e}" for r, e in sorted(own_errors.items())),
                             "build", own_errors)
        self._control("build")
        return Pending({rank: Call(self.clock()) for rank in ranks})

    def alive(self, rank: int, timeout: float = 5.0) -> bool:
        return rank in self.alive_ranks

    def responsive(self, ranks, timeout: float = 5.0) -> set[int]:
        return set(ranks) & self.alive_ranks

    def _control(self, call: str) -> None:
        """Fire the faults scheduled for ``call``: a rank dies in it, or raises and lives."""
        faults = self.control_faults.pop(call, [])
        dead = [rank for rank, how in faults if how == "die"]
        for rank in dead:
            self.alive_ranks.discard(rank)
        if dead:
            raise RanksLost(dead, f"ranks {dead} died during {call}", call)
        if faults:
            raise CallFailed([rank for rank, _ in faults], f"RuntimeError during {call}", call)

    def kill(self, rank: int) -> None:
        self.kills.append(rank)
        self.alive_ranks.discard(rank)

    def kill_group(self, group: int) -> None:
        for rank in self.topology.global_ranks(group):
            self.kill(rank)
        self.release(group)

    # calls in flight

    def done(self, pending: Pending, timeout: float = 0.0) -> bool:
        ready_at = max((call.at for call in pending.refs.values()), default=self.clock())
        if ready_at > self.clock() + timeout:
            self.clock.sleep(timeout)
            return False
        self.clock.now = max(self.clock.now, ready_at)
        return True

    def answered(self, pending: Pending) -> int:
        return sum(call.at <= self.clock() for call in pending.refs.values())

    def results(self, pending: Pending, timeout: float | None = None) -> dict[int, object]:
        lost = [rank for rank in pending.refs if rank not in self.alive_ranks]
        if lost:
            raise RanksLost(lost, f"ranks {lost} are gone", "results")
        return {rank: call.result for rank, call in pending.refs.items()}

    # segments

    def start_segment(self, specs: dict[int, SegmentSpec]) -> SegmentStream:
        self.segments.append(specs)
        self.aborted_at = None
        spec = next(iter(specs.values()))
        if spec.catch_up is not None:  # the copies start with the segment, one per joining rank
            pairs = sorted((source, target) for target, source in spec.catch_up.sources.items())
            self.copies.extend(pairs)
            for source, target in pairs:
                (self.corrupt.add if source in self.corrupt else self.corrupt.discard)(target)
        self.segment = FakeSegment(self, spec, sorted(specs))
        return SegmentStream(spec.attempt, dict.fromkeys(specs))

    def next_messages(self, stream: SegmentStream, timeout: float, ranks=None) -> list:
        segment = self.segment
        segment.advance(self.clock())
        watched = set(stream.generators) if ranks is None else set(ranks) & set(stream.generators)
        earliest = segment.next_event_at(watched)
        if earliest > self.clock() + timeout:
            self.clock.sleep(max(0.0, timeout))
            segment.advance(self.clock())
            return []
        self.clock.now = max(self.clock.now, earliest)
        segment.advance(self.clock())
        arrived = segment.deliver(self.clock(), watched)
        self.delivered.extend(arrived)
        for rank, message in arrived:
            if not isinstance(message, RECORD_MESSAGES):
                del stream.generators[rank]
        return arrived

    def request_pause(self, ranks, attempt: int) -> None:
        self.pauses.append((attempt, self.clock()))
        self.paused_ranks.append(list(ranks))
        if self.segment.spec.attempt == attempt:
            self.segment.pause_at = self.clock()

    # evaluations

    def evaluate(self, requests: dict[int, EvalRequest]) -> Pending:
        self.evaluations.append(requests)
        self.aborted_at = None
        now = self.clock()
        step = next(iter(requests.values())).step
        faults = self.faults.pop(step, [])
        finish = now + self.step_s
        calls = {rank: Call(finish, RankOutcome(rank, step, loss_share=1.0 / len(requests), compute_s=self.step_s,
                                                wall_s=self.step_s),
                            activity=RankActivity(rank, step, Phase.COMPUTE, 0, 9, 0.0))
                 for rank in requests}
        for fault in faults:
            assert isinstance(fault, Kill), "evaluations fail here by a kill only"
            self.alive_ranks.discard(fault.rank)
            calls[fault.rank] = Call(now + fault.after_s, None)
            for rank in requests:
                if rank != fault.rank:
                    calls[rank] = Call(NEVER, RankOutcome(rank, step, error="CollectiveAborted", failure="released"),
                                       waits_for_abort=True)
        self.in_flight = dict(calls)
        return Pending(calls)

    def _ready_at(self, call: Call) -> float:
        if call.waits_for_abort and self.aborted_at is not None:
            return self.aborted_at + RETURN_S
        if call.waits_for_release and call.released_at is not None:
            return call.released_at + RETURN_S
        return call.at

    def next_outcomes(self, pending: Pending, timeout: float) -> list[tuple[int, RankOutcome | None]]:
        earliest = min(self._ready_at(call) for call in pending.refs.values())
        if earliest > self.clock() + timeout:
            self.clock.sleep(max(0.0, timeout))
            return []
        self.clock.now = max(self.clock.now, earliest)
        arrived = [(rank, call.result) for rank, call in pending.refs.items() if self._ready_at(call) <= self.clock()]
        for rank, _ in arrived:
            del pending.refs[rank]
        return arrived

    def end_attempt(self, attempt: int) -> None:
        self.aborted_at = self.clock()

    def release_step(self, ranks, attempt: int) -> None:
        self.releases.append(sorted(ranks))
        if self.segment is not None and self.segment.spec.attempt == attempt:
            for call in self.segment.queue:
                if call.result[0] in ranks:
                    call.released_at = self.clock()

    def probe(self, ranks, timeout: float) -> dict[int, RankActivity]:
        return {rank: self.in_flight[rank].activity for rank in ranks if rank in self.alive_ranks}

    # state

    def copy_state(self, pairs) -> list[HealCopy]:
        self._control("import_state")
        self.copies.extend(pairs)
        for source, target in pairs:
            (self.corrupt.add if source in self.corrupt else self.corrupt.discard)(target)
        return [HealCopy(source, target, STATE_BYTES, self.heal_fallbacks.pop(target, None)) for source, target in pairs]

    # the memory tier

    def set_buddies(self, buddies) -> None:
        self.buddies.update(buddies)

    def snapshot(self, ranks, step: int, cursor) -> None:
        """The ranks copy their state at ``step``; each buddy alive receives its copy at once."""
        for rank in ranks:
            own = self.own_copies.setdefault(rank, {})
            own[step] = cursor
            for old in sorted(own)[:-2]:
                del own[old]
            buddy = self.buddies.get(rank)
            if buddy in self.alive_ranks:
                copies = self.held_copies.setdefault(buddy, {}).setdefault(rank, {})
                copies[step] = cursor
                for old in sorted(copies)[:-2]:
                    del copies[old]

    def memory_holdings(self, ranks) -> dict[int, Holdings]:
        self._control("memory_holdings")
        return {rank: Holdings(dict(self.own_copies.get(rank, {})),
                               {owner: dict(copies) for owner, copies in self.held_copies.get(rank, {}).items()})
                for rank in ranks if rank in self.alive_ranks}

    def restore_memory(self, plan: MemoryRestore) -> None:
        self._control("restore_memory")
        self.memory_restores.append(plan)
        self.corrupt -= set(plan.ranks)

    def local_parameters(self, ranks) -> dict[int, list]:
        return {rank: [] for rank in ranks}

    # checkpoints

    def save(self, ranks, url: str) -> None:
        self.clock.sleep(self.stall_s)
        if self.fail_staging:
            raise CallFailed([0], "rank 0: RuntimeError: staging failed", "save_checkpoint")
        self.saves.append(url)

    def finish_saves(self, ranks) -> Pending:
        """Each rank's upload: one small data file, written at once, reported ``upload_s`` later."""
        at = self.clock() + self.upload_s
        results = {}
        for rank in ranks:
            if self.fail_uploads:
                results[rank] = Upload(rank, ok=False, error="OSError: storage unreachable")
                continue
            written = {f"__{rank}_0.distcp": f"state of rank {rank}".encode()}
            if rank == ranks[0]:  # DCP's coordinator rank writes the metadata
                written[".metadata"] = EMPTY_DCP_METADATA
            os.makedirs(self.saves[-1], exist_ok=True)
            for name, data in written.items():
                with open(os.path.join(self.saves[-1], name), "wb") as handle:
                    handle.write(data)
            results[rank] = Upload(rank, ok=True, upload_s=self.upload_s,
                                   files={name: (len(data), hashlib.sha256(data).hexdigest())
                                          for name, data in written.items()},
                                   rng={"cpu": f"generator of rank {rank}".encode()})
        if int(self.saves[-1].rsplit("step-", 1)[1]) in self.stuck_steps:
            at = NEVER
        return Pending({rank: Call(at, results[rank]) for rank in ranks})

    def abandon_saves(self, ranks) -> None:
        self._control("abandon_checkpoint")
        self.abandoned.append(tuple(ranks))

    def restore(self, ranks, url: str, step: int, generators) -> None:
        self._control("load_checkpoint")
        self.corrupt -= set(ranks)
        self.restores.append((tuple(ranks), url))
        self.restored_generators.append(dict(generators))

    def shutdown(self) -> None:
        self.alive_ranks.clear()



class FakeSegment:
    """One run, simulated as the fake clock reaches its steps: each step's end (records,
    a pause, the segment's end) or its fault, as timed messages for the driver to read."""

    def __init__(self, fleet: FakeFleet, spec: SegmentSpec, ranks: list[int]):
        self.fleet = fleet
        self.spec = spec
        self.ranks = ranks
        self.groups = spec.groups
        self.topology = fleet.topology
        self.queue: list[Call] = []  # messages not yet delivered, in the order they were sent
        # the groups' first ranks' loops: the records they hold, and when they send them
        self.loops = {group: RankSegmentLoop(spec, leads_group=True, now=fleet.clock()) for group in self.groups}
        self.pause_at: float | None = None
        self.step = spec.first_step
        self.cursor = spec.cursor
        self.over = False  # ended or failed: no further step starts
        # The joining ranks' copies land within the first step: they report them at their ends,
        # and one whose copy fails ends the first step failed, its group broken.
        sources = spec.catch_up.sources if spec.catch_up is not None else {}
        failing = {target: fleet.catch_up_failures.pop(target)
                   for target in sources if target in fleet.catch_up_failures}
        self.healed = {target: HealReceipt(source, STATE_BYTES, 0.0, 0) for target, source in sources.items()
                       if target not in failing}
        if failing:
            fleet.faults.setdefault(self.step, []).extend(CopyFailed(target, why) for target, why in failing.items())
        self._start_step(fleet.clock())

    def _end(self, rank: int, step: int, failure: RankOutcome | None = None, **found) -> SegmentEnd:
        return SegmentEnd(rank, step, failure, healed=self.healed.get(rank), **found)

    @property
    def planning(self) -> SegmentSpec:
        """The spec the step in hand is planned and checked by (the joining groups' shares empty
        until they caught up)."""
        return self.loops[self.groups[0]].planning()

    def _start_step(self, now: float) -> None:
        """Step ``self.step`` starts at ``now``: its end time, or the messages of its fault."""
        fleet, step = self.fleet, self.step
        self.started = now
        # the groups' first ranks add up their asks in the step's cross-group sum
        self.records_due = any([loop.step_starts(now) for loop in self.loops.values()])
        self.compute = {rank: fleet.step_s * fleet.slow.get(rank, 1.0) for rank in self.ranks}
        self.ends_at = now + max(self.compute.values())
        fleet.in_flight = {rank: Call(NEVER, activity=RankActivity(rank, step, Phase.REPLICATE, 0, 9, 0.0))
                           for rank in self.ranks}
        faults = fleet.faults.pop(step, [])
        fleet.corrupt |= {fault.rank for fault in faults if isinstance(fault, Flip)}
        faults = [fault for fault in faults if not isinstance(fault, Flip)]
        self.mismatches = self._integrity_check(step)
        if faults:
            self._fail(now, step, faults)

    def _integrity_check(self, step: int) -> dict[int, IntegrityMismatch]:
        """What the ranks at each position find as the step begins, by rank: a corrupt rank's
        fingerprint differs from its replicas'."""
        if len(self.groups) < 2 or not check_due(step, self.planning.integrity_every):
            return {}
        found = {}
        for position in {self.topology.position_of(rank) for rank in self.fleet.corrupt & set(self.ranks)}:
            replicas = {self.topology.group_of(rank): rank for rank in self.ranks
                        if self.topology.position_of(rank) == position}
            mismatch = compare(step, position, {group: (rank if rank in self.fleet.corrupt else -1,)
                                                for group, rank in replicas.items()}, ["layers.0.weight"])
            found.update(dict.fromkeys(replicas.values(), mismatch))
        return found
    def _fail(self, now: float, step: int, faults: list) -> None:
        self.over = True
        fleet = self.fleet
        targets = {fault.rank for fault in faults}
        finals: dict[int, Call] = {}
        for fault in faults:
            group = self.topology.group_of(fault.rank)
            peers = [r for r in self.topology.global_ranks(group) if r in self.ranks and r != fault.rank]
            if isinstance(fault, Kill):
                fleet.alive_ranks.discard(fault.rank)
                finals[fault.rank] = Call(now + fault.after_s, (fault.rank, None))
                for peer in peers:
                    blocked = peer in fault.blocks
                    finals.setdefault(peer, Call(NEVER if blocked else now + fault.after_s + NOTICE_S,
                                                 (peer, self._end(peer, step, RankOutcome(
                                                     peer, step, error="Connection closed by peer",
                                                     failure="collective", group_broken=True))),
                                                 waits_for_release=blocked))
            elif isinstance(fault, Hang):
                fleet.in_flight[fault.rank] = Call(NEVER,
                                                   activity=RankActivity(fault.rank, step, Phase.COMPUTE, 0, 1, 0.0))
                finals[fault.rank] = Call(NEVER, (fault.rank, None))
                for peer in peers:
                    fleet.in_flight[peer] = Call(NEVER, activity=RankActivity(peer, step, Phase.COMPUTE, 0, 2, 0.0))
                    finals[peer] = Call(NEVER, (peer, None))
            elif isinstance(fault, CollectiveError):
                finals[fault.rank] = Call(self.ends_at, (fault.rank, self._end(fault.rank, step, RankOutcome(
                    fault.rank, step, error="RuntimeError: bad collective"))))
            elif isinstance(fault, CopyFailed):
                finals[fault.rank] = Call(self.ends_at, (fault.rank, self._end(fault.rank, step, RankOutcome(
                    fault.rank, step, error=f"HealFailed: {fault.why}", failure="no-state", group_broken=True))))
        for rank in self.ranks:  # in the cross-group all-reduce until the abort
            if rank not in finals and rank not in targets:
                finals[rank] = Call(NEVER, (rank, self._end(rank, step, RankOutcome(
                    rank, step, error="CollectiveAborted: aborted by the driver", failure="released"))),
                    waits_for_abort=True)
        for group, loop in self.loops.items():  # a first rank that lives sends what it holds first
            leader = self.topology.global_ranks(group)[0]
            call = finals.get(leader)
            records = loop.held()
            if records and call is not None and call.result[1] is not None:
                self.queue.append(Call(call.at, (leader, GroupRecords(group, records)),
                                       waits_for_abort=call.waits_for_abort))
        self.queue.extend(finals.values())

    def _finish_step(self) -> None:
        """The step's votes: every group commits it; a pause asked before them, or the segment's
        last step, ends the segment here."""
        fleet, spec, step, at = self.fleet, self.spec, self.step, self.ends_at
        if fleet.nonfinite.get(step) or self.mismatches:
            self._discard(step, at)
            return
        stepping = self.planning
        plan = rank_share(stepping, step, self.cursor, self.groups[0], 0, self.topology.shard)
        norm = (fleet.grad_sq_norm * self.topology.ranks_per_group) ** 0.5
        pause = self.pause_at is not None and self.pause_at <= at
        decided = {}  # each group's first rank's decision: every group's sees the same step, pause and records due
        for group, loop in self.loops.items():
            ranks = tuple(self.topology.global_ranks(group))
            times = tuple(RankTimes(data_s=0.01, compute_s=self.compute[rank],
                                    comm_s=at - self.started - self.compute[rank], wall_s=at - self.started)
                          for rank in ranks)
            decided[group] = loop.committed(StepRecord(
                step, group, 1.0, norm, clip_coefficient(norm, spec.clip_grad_norm), spec.schedule.lr(step),
                plan.global_samples, plan.group_samples, plan.next_cursor, ranks, times,
                counted=plan.global_samples * spec.seq_len), pause, self.records_due, at)
        sent = {group: after.send for group, after in decided.items() if after.send is not None}
        if any(send.gathered for send in sent.values()):  # one message for the segment, from its first group
            self.queue.append(Call(at, (self.topology.global_ranks(self.groups[0])[0], SegmentRecords.of_groups(
                {group: list(send.records) for group, send in sent.items()}))))
        else:
            self.queue.extend(Call(at, (self.topology.global_ranks(group)[0], GroupRecords(group, send.records)))
                              for group, send in sent.items())
        self.cursor = plan.next_cursor
        self.step += 1
        if memory_snapshot_due(stepping, self.step):
            fleet.snapshot([rank for rank in self.ranks if rank in fleet.alive_ranks], self.step, self.cursor)
        if decided[self.groups[0]].segment_ends:
            self.over = True
            self.queue.extend(Call(at, (rank, self._end(rank, self.step))) for rank in self.ranks)
            fleet.in_flight = {rank: Call(NEVER, activity=RankActivity(rank, step, Phase.DONE, 0, 9, 0.0))
                               for rank in self.ranks}

    def _discard(self, step: int, at: float) -> None:
        """Every rank's vote finds a mismatch, or else sums a NaN loss: the records held go
        out, then every rank ends the segment on the step."""
        self.over = True
        for group, loop in self.loops.items():
            records = loop.held()
            if records:
                self.queue.append(Call(at, (self.topology.global_ranks(group)[0], GroupRecords(group, records))))
        if self.mismatches:
            self.queue.extend(Call(at, (rank, self._end(rank, step, integrity=self.mismatches.get(rank))))
                              for rank in self.ranks)
            return
        self.fleet.nonfinite[step] -= 1
        nonfinite = NonFinite(step, math.nan, math.nan)
        self.queue.extend(Call(at, (rank, self._end(rank, step, nonfinite=nonfinite))) for rank in self.ranks)

    def advance(self, now: float) -> None:
        while not self.over and self.ends_at <= now:
            self._finish_step()
            if not self.over:
                self._start_step(self.ends_at)

    def next_event_at(self, ranks: set[int]) -> float:
        times = [self.fleet._ready_at(call) for call in self.queue if call.result[0] in ranks]
        if not self.over:
            times.append(self.ends_at)
        return min(times, default=NEVER)

    def deliver(self, now: float, ranks: set[int]) -> list:
        arrived = [call for call in self.queue if call.result[0] in ranks and self.fleet._ready_at(call) <= now]
        self.queue = [call for call in self.queue if call not in arrived]
        return [call.result for call in arrived]

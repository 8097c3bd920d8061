"""A failure trace replayed against three designs of a trainer, on a simulated clock.

- **This product** (``ours``), on its path as it runs today: a failure discards the step in
  flight everywhere; a hang, a NIC or a node gone silent is found by the step deadline (the
  real ``StepDeadline`` fed the run's step times, so a group out, which slows the step, widens
  it) or by Ray's health check; the ranks drain; every surviving rank rebuilds its cross-group
  process groups as the next segment starts (the segment's start a driver call per rank, and a
  communicator over the groups) while every group waits; the failed rank's group takes a warm
  spare (``choose_spares`` picks it, and the others wait up to a typical step for it) or a fresh
  process or a replaced node while the others train; at the next boundary every group waits
  for a second regroup, and the joining group takes the state rank to rank while every group
  steps (the catch-up), out until it lands. A slow GPU is found by the straggler detector and
  its group replaced; a corruption of the state a rank holds is found at the next integrity
  check and its group healed; a compute error that enters the cross-group sum is not found. It
  has no drain: a node taken for maintenance ends its ranks as a death does. Each failure goes
  through the real diagnosis and recovery plan.
- **Restart the world** in its best current form: in-memory checkpoints every 5 minutes (and
  one when told of a maintenance or a slow GPU), a 120 s collective timeout for a hang, warm
  spares; any failure stops every rank, the job restarts and trains again what it trained
  since its checkpoint.
- **Group restart** (torchft's model): a death is found by the lighthouse's heartbeat, a hang
  by the Manager's timeout; the others reconfigure their process group and go on without the
  failed group, which restarts, heals from a live peer and rejoins (one more reconfiguration).

Every design finds a slow GPU with the same detector (the real one) and acts on it as on a
planned removal. Failures during a recovery are failures like the others: a recovery is
started over from the new failure, a heal under way is aborted and its group rebuilt. Only
workloads with at least one sequence per data-parallel rank are replayed (``Job.fits``); the
step is whole micro-batches of one sequence, so a group out lengthens the step to the widest
share (with one sequence per rank, it doubles it).

Every cost is a figure of ``elastic.simulation.costs``. The ledger: time trained on kept work,
work trained and thrown away, capacity down; they add up to the wall time.
"""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from elastic.core.diagnosis import diagnose
from elastic.core.policies import StepDeadline
from elastic.core.recovery import plan_recovery
from elastic.core.spares import Spare, choose_spares
from elastic.core.straggler_detector import StragglerDetector
from elastic.core.topology import Topology
from elastic.simulation.costs import DEFAULT, Costs
from elastic.simulation.failure_mix import (
    GPUS_PER_NODE,
    NEEDS_HARDWARE,
    NODES_GONE,
    SILENT,
    Failure,
    FailureKind,
)

H100_BF16_FLOPS = 989e12  # dense, SXM
STATE_BYTES_PER_PARAMETER = 12  # fp32 parameters and AdamW's two fp32 moments: what a heal copies
SEQUENCE_TOKENS = 8192  # Llama 3's pre-training context
BATCH_SEQUENCES = 2048  # Llama 3 405B's 16 M-token batch
CORRUPTIONS = frozenset({FailureKind.STATE_CORRUPTION, FailureKind.COMPUTE_CORRUPTION})
# Restart-the-world saves a checkpoint when told of a node's maintenance or a slow GPU; this
# product and torchft have no drain (a node taken away ends its ranks as a death does), and
# remove a group as planned only on the straggler detector's word
NOTICED = frozenset({FailureKind.NODE_MAINTENANCE, FailureKind.JOB_MAINTENANCE, FailureKind.SLOW_GPU})


class Design(StrEnum):
    OURS = "ours"
    RESTART = "restart"
    GROUP_RESTART = "group-restart"


@dataclass(frozen=True)
class ModelShape:
    name: str
    parameters: float
    pp: int  # a replica group's layout (docs/presets.md's rows that fit an H100)
    shard: int
    tp: int

    @property
    def group_gpus(self) -> int:
        return self.pp * self.shard * self.tp


MODELS = {
    "8b": ModelShape("llama3-8b", 8.03e9, 1, 8, 1),
    "70b": ModelShape("llama3-70b", 70.6e9, 1, 16, 8),
    "405b": ModelShape("llama3-405b", 406e9, 16, 4, 8),
}


@dataclass(frozen=True)
class Job:
    model: ModelShape
    gpus: int
    batch_sequences: int = BATCH_SEQUENCES
    mfu: float = 0.40  # Llama 3 405B's was 38 to 43 %

    @property
    def groups(self) -> int:
        return self.gpus // self.model.group_gpus

    @property
    def ranks(self) -> int:
        return self.groups * self.model.group_gpus

    @property
    def fits(self) -> bool:
        """At least one sequence per data-parallel rank."""
        return self.groups * self.model.shard <= self.batch_sequences

    @property
    def sequence_s(self) -> float:
        """One sequence through one data-parallel rank at ``mfu``: 6 FLOPs per parameter per token."""
        model = self.model
        return 6 * model.parameters * SEQUENCE_TOKENS / (model.pp * model.tp * H100_BF16_FLOPS * self.mfu)

    def step_s(self, live: int | None = None) -> float:
        """A step with ``live`` groups (all by default): the batch apportioned over the groups,
        a group's share over its shard positions, the widest position's sequences one
        micro-batch each (``elastic.core.data_plan``)."""
        share = -(-self.batch_sequences // (live or self.groups))
        return -(-share // self.model.shard) * self.sequence_s

    @property
    def heal_bytes_per_gpu(self) -> float:
        return STATE_BYTES_PER_PARAMETER * self.model.parameters / self.model.group_gpus

    @property
    def topology(self) -> Topology:
        model = self.model
        return Topology(model.shard, model.tp, self.groups, model.pp)


@functools.cache
def straggler_detection_steps(slowdown: float) -> int:
    """Steps the straggler detector (the real one, at its defaults) takes to flag a GPU that
    turns ``slowdown`` times slower, in a fleet whose other ranks time alike."""
    detector = StragglerDetector()
    ranks = np.arange(64)
    times = np.ones(len(ranks))
    for step in range(detector.window):
        detector.observe_arrays(step, ranks, times)
    times[0] = slowdown
    steps = 0
    while 0 not in detector.flagged():
        steps += 1
        detector.observe_arrays(detector.window + steps, ranks, times)
    return steps


@dataclass
class Ledger:
    """Where a design's wall time went, in seconds of the whole job: ``trained`` on work it
    kept, ``lost`` on work it trained and then threw away, ``down`` with capacity idle."""

    wall_s: float
    trained_s: float = 0.0
    lost_s: float = 0.0
    down_s: float = 0.0
    failures: int = 0
    spares_short: int = 0  # failures that found no spare and waited for a node
    decisions: int = 0  # failures taken through the real diagnosis and recovery plan
    undetected_corruptions: int = 0  # silent corruptions trained on

    @property
    def ettr(self) -> float:
        """Effective training time ratio: the wall time's share spent training kept work."""
        return self.trained_s / self.wall_s


@dataclass
class _Timeline:
    """The job's capacity in time: stalls (every group waiting), groups out one interval each,
    a slow GPU slowing every rank; ``capacity`` is the job's share of its speed with that many
    groups out."""

    capacity: Callable[[int], float]
    slowdown: float
    stalls: list[list[float]] = field(default_factory=list)
    outs: list[list[float]] = field(default_factory=list)
    slows: list[list[float]] = field(default_factory=list)
    lost_s: float = 0.0
    spares_short: int = 0
    decisions: int = 0
    undetected_corruptions: int = 0

    def stall(self, start_s: float, seconds: float) -> list[float]:
        """Every group waits from ``start_s``: the interval, to be cut short if aborted."""
        interval = [start_s, start_s + seconds]
        self.stalls.append(interval)
        return interval

    def ledger(self, wall_s: float) -> Ledger:
        changes = sorted((min(wall_s, at), kind, sign)
                         for kind, intervals in enumerate((self.stalls, self.outs, self.slows))
                         for start, end in intervals if end > start
                         for at, sign in ((start, 1), (end, -1)))
        counts = [0, 0, 0]
        up = since = 0.0
        for at, kind, sign in changes + [(wall_s, 0, 0)]:
            if counts[0] == 0:
                up += (at - since) * self.capacity(counts[1]) / (self.slowdown if counts[2] else 1.0)
            counts[kind] += sign
            since = at
        lost = min(self.lost_s, up)  # work trained and thrown away was trained while up
        return Ledger(wall_s, up - lost, lost, wall_s - up, spares_short=self.spares_short,
                      decisions=self.decisions, undetected_corruptions=self.undetected_corruptions)


class _Spares:
    """A pool of spare GPUs, whole nodes of them; a GPU taken comes back once its failed one is
    replaced (``node_replacement_s`` later)."""

    def __init__(self, gpus: int):
        self.free = [Spare(index, ready=True, node=f"spare{index // GPUS_PER_NODE}") for index in range(gpus)]
        self.returning: list[tuple[float, list[Spare]]] = []

    def take(self, ranks: list[int], now_s: float, back_s: float) -> bool:
        """Whether every rank got a spare (each picked by ``choose_spares``)."""
        self.free += [spare for at, back in self.returning if at <= now_s for spare in back]
        self.returning = [(at, back) for at, back in self.returning if at > now_s]
        if not self.free:
            return False
        chosen = choose_spares(ranks, self.free, {rank: f"node{rank // GPUS_PER_NODE}" for rank in ranks})
        taken = [spare for spare in self.free if spare.id in chosen.values()]
        self.free = [spare for spare in self.free if spare.id not in chosen.values()]
        self.returning.append((now_s + back_s, taken))
        return len(chosen) == len(ranks)


def replay(job: Job, failures: Iterable[Failure], design: Design, wall_s: float, spare_gpus: int = 0,
           costs: Costs = DEFAULT, seed: int = 0) -> Ledger:
    """``failures`` (a trace over ``wall_s``) as ``design`` would live through them."""
    if not job.fits:
        raise ValueError(f"{job.model.name} on {job.gpus} GPUs has {job.groups * job.model.shard} data-parallel ranks "
                         f"for {job.batch_sequences} sequences: fewer than one each")
    within = [failure for failure in failures if failure.at_s < wall_s]
    rng = random.Random(seed)  # where in its step each failure strikes
    if design == Design.RESTART:
        timeline = _Timeline(lambda out: 1.0, costs.slowdown)
        _restart_the_world(job, within, timeline, spare_gpus, costs)
    else:
        kind = _Ours if design == Design.OURS else _GroupRestart
        timeline = kind.timeline(job, costs)
        kind(job, timeline, spare_gpus, costs, rng).run(within)
    ledger = timeline.ledger(wall_s)
    ledger.failures = len(within)
    return ledger


def _slow_gpu_s(job: Job, costs: Costs) -> float:
    """How long a slow GPU slows every rank before the detector flags it."""
    return straggler_detection_steps(costs.slowdown) * job.step_s() * costs.slowdown


def _world_restart_s(job: Job, costs: Costs) -> float:
    return (costs.world_restart_s + costs.comm_init_s(job.ranks)
            + job.heal_bytes_per_gpu / costs.checkpoint_load_bandwidth)


def _restart_the_world(job: Job, failures: list[Failure], timeline: _Timeline, spare_gpus: int,
                       costs: Costs) -> None:
    spares = _Spares(spare_gpus)
    restart_s = _world_restart_s(job, costs)
    resumed_at = 0.0  # the last restart's end: checkpoints are taken from there on
    for failure in failures:
        at, kind = failure.at_s, failure.kind
        if kind in CORRUPTIONS:
            timeline.undetected_corruptions += 1
            continue
        if kind == FailureKind.SLOW_GPU:
            timeline.slows.append([at, at + _slow_gpu_s(job, costs)])
            at = timeline.slows[-1][1]
        detect_s = 0.0
        if kind not in NOTICED:
            if at >= resumed_at:  # trained since the last checkpoint, lost; in a restart, nothing
                timeline.lost_s += (at - resumed_at) % costs.checkpoint_every_s
            if kind in SILENT:
                detect_s = min(costs.world_timeout_s, costs.node_death_s) if kind in NODES_GONE \
                    else costs.world_timeout_s
        wait_s = 0.0
        if kind in NEEDS_HARDWARE or kind == FailureKind.SLOW_GPU:
            struck = list(range(failure.gpu, min(failure.gpu + failure.gpus, job.ranks)))
            if not spares.take(struck, at, costs.node_replacement_s):
                timeline.spares_short += 1
                wait_s = costs.node_replacement_s
        resumed_at = max(resumed_at, timeline.stall(at, detect_s + wait_s + restart_s)[1])


@dataclass
class _Join:
    """Groups coming back, every group waiting for them: ``heal`` then ``regroup`` stalls."""

    outs: dict[int, list[float]]  # group -> its interval out of the quorum
    heal: list[float]
    regroup: list[float]


class _GroupReplay:
    """A design where a failure takes out only its groups: the events in time order (failures,
    groups built and ready to join), what every group waits for and what only the failed
    groups do. The subclasses price the phases."""

    FAILURE, FOUND, READY, JOIN = range(4)

    def __init__(self, job: Job, timeline: _Timeline, spare_gpus: int, costs: Costs, rng: random.Random):
        self.job, self.timeline, self.costs, self.rng = job, timeline, costs, rng
        self.topology = job.topology
        self.spares = _Spares(spare_gpus)
        self.out: dict[int, float] = {}  # group -> when it left the quorum
        self.built: dict[int, int] = {}  # group -> its latest build's number (a READY of an older one is stale)
        self.ready: set[int] = set()  # built, waiting for a boundary to join
        self.joining: _Join | None = None
        self.join_due = False
        self.busy_until = 0.0  # the end of the latest stall: no boundary before it
        self.events: list[tuple[float, int, int, object]] = []
        self.order = 0

    @classmethod
    def timeline(cls, job: Job, costs: Costs) -> _Timeline:
        return _Timeline(cls.capacity_of(job), costs.slowdown)

    @staticmethod
    def capacity_of(job: Job) -> Callable[[int], float]:
        raise NotImplementedError

    def push(self, at: float, kind: int, payload: object) -> None:
        self.order += 1
        heapq.heappush(self.events, (at, self.order, kind, payload))

    def stall(self, start_s: float, seconds: float) -> float:
        end = self.timeline.stall(start_s, seconds)[1]
        self.busy_until = max(self.busy_until, end)
        return end

    def run(self, failures: list[Failure]) -> None:
        for failure in failures:
            self.push(failure.at_s, self.FAILURE, failure)
        while self.events:
            at, _, kind, payload = heapq.heappop(self.events)
            if kind == self.FAILURE:
                self.fail(payload)
            elif kind == self.FOUND:  # a slow GPU flagged, a corruption found: its groups replaced
                self.committed_until(at)
                self.replace(payload, self.groups_of(payload), at,
                             heal_only=payload.kind == FailureKind.STATE_CORRUPTION)
            elif kind == self.READY:
                group, build = payload
                if self.built.get(group) == build:
                    self.ready.add(group)
                    if not self.join_due:
                        self.join_due = True
                        self.push(self.boundary(at), self.JOIN, None)
            else:
                self.join(at)
        self.timeline.outs += [[since, math.inf] for since in self.out.values()]  # still out at the end

    def boundary(self, at: float) -> float:
        """The next step boundary from ``at``: the step in flight ends first (none in a stall)."""
        return max(at + self.rng.random() * self.job.step_s(self.live()), self.busy_until)

    def live(self) -> int:
        return self.job.groups - len(self.out)

    def groups_of(self, failure: Failure) -> dict[int, list[int]]:
        ranks = range(failure.gpu, min(failure.gpu + failure.gpus, self.job.ranks))
        struck: dict[int, list[int]] = {}
        for rank in ranks:
            struck.setdefault(self.topology.group_of(rank), []).append(rank)
        return struck

    def fail(self, failure: Failure) -> None:
        at, kind = failure.at_s, failure.kind
        self.committed_until(at)
        if kind == FailureKind.COMPUTE_CORRUPTION:
            self.timeline.undetected_corruptions += 1
        elif kind == FailureKind.STATE_CORRUPTION:
            self.corrupted(failure)
        elif kind == FailureKind.JOB_MAINTENANCE:  # a configuration change: every design restarts
            self.stall(at, _world_restart_s(self.job, self.costs))
        elif kind == FailureKind.SLOW_GPU:
            self.timeline.slows.append([at, at + _slow_gpu_s(self.job, self.costs)])
            self.push(self.timeline.slows[-1][1], self.FOUND, failure)
        else:
            self.replace(failure, self.groups_of(failure), at)

    def replace(self, failure: Failure, struck: Mapping[int, list[int]], at: float, heal_only: bool = False) -> None:
        """The struck groups out of the quorum and rebuilt; every group waits for what the design
        makes it wait for."""
        kind = failure.kind
        if self.joining is not None and self.joining.heal[0] <= at < self.joining.heal[1]:
            self.abort_join(at)
        for group in set(struck) & (set(self.out) | self.ready):  # a group being built, struck: built again
            self.ready.discard(group)
            self.build(group, struck[group], kind, at, wait=False)
        live = {group: ranks for group, ranks in struck.items() if group not in self.out}
        if not live:
            return
        planned = kind == FailureKind.SLOW_GPU
        if not planned:  # the step in flight, discarded everywhere
            self.timeline.lost_s += self.rng.random() * self.job.step_s()
            at = self.stall(at, self.detect_s(kind))
        at = self.stall(at, self.leave_s(planned))
        self.timeline.decisions += 1
        ranks = [rank for group_ranks in live.values() for rank in group_ranks]
        hung = ranks if kind in (FailureKind.HANG, FailureKind.NIC) else []
        diagnosis = diagnose(dead=[] if hung else ranks, outcomes={}, hung=hung,
                             group_of={rank: self.topology.group_of(rank) for rank in ranks})
        plan = plan_recovery(diagnosis, self.topology, set(range(self.job.groups)) - set(self.out))
        evicted: dict[int, list[int]] = {group: [] for group in plan.rebuilding}
        for eviction in plan.evictions:
            evicted[eviction.group].append(eviction.rank)
        for group, group_ranks in evicted.items():
            self.out[group] = failure.at_s
            self.build(group, [] if heal_only else group_ranks, kind, at, wait=True)

    def build(self, group: int, ranks: list[int], kind: FailureKind, at: float, wait: bool,
              fresh: bool = False) -> None:
        """``group`` rebuilt from ``at``, READY when built: its ``ranks`` replaced, or with none
        its processes kept (``fresh``: started again)."""
        costs = self.costs
        on_spares = bool(ranks) and self.spares.take(ranks, at, costs.node_replacement_s)
        if not ranks:
            back_s = costs.process_start_s if fresh else 0.0
        elif on_spares:
            back_s = costs.spare_takeover_s
        elif kind in NEEDS_HARDWARE:
            self.timeline.spares_short += 1
            back_s = costs.node_replacement_s + costs.process_start_s
        else:
            back_s = costs.process_start_s  # a fresh process where the old one ran
        back_s += (costs.comm_init_s(self.job.model.group_gpus) if ranks or fresh else 0.0) + self.group_only_s()
        if wait and on_spares:
            waited = self.spares_wait_s(back_s)
            at, back_s = self.stall(at, waited), back_s - waited
        self.built[group] = self.built.get(group, 0) + 1
        self.push(at + back_s, self.READY, (group, self.built[group]))

    def join(self, at: float) -> None:
        self.join_due = False
        if not self.ready:  # struck again while they waited: built again
            return
        groups = {group: self.out.pop(group) for group in self.ready}
        self.ready.clear()
        heal = self.timeline.stall(at, self.heal_s())
        regroup = self.timeline.stall(heal[1], self.rejoin_s())
        self.busy_until = max(self.busy_until, regroup[1])
        outs = {group: [since, regroup[1] + self.catch_up_s()] for group, since in groups.items()}
        self.timeline.outs += outs.values()
        self.joining = _Join(outs, heal, regroup)

    def abort_join(self, at: float) -> None:
        """A failure while the groups heal: the heal fails, its groups start fresh processes
        (``GroupKeeper.join_ready_groups``) and heal again once built."""
        join, self.joining = self.joining, None
        join.heal[1] = join.regroup[0] = join.regroup[1] = self.busy_until = at
        for group, interval in join.outs.items():
            self.out[group] = interval[0]
            interval[1] = interval[0]
            self.build(group, [], FailureKind.SOFTWARE, at, wait=False, fresh=True)

    def committed_until(self, at: float) -> None:
        """Steps committed up to ``at``: what a design that times them sees."""

    def corrupted(self, failure: Failure) -> None:
        self.timeline.undetected_corruptions += 1

    def detect_s(self, kind: FailureKind) -> float:
        raise NotImplementedError

    def leave_s(self, planned: bool) -> float:
        raise NotImplementedError

    def spares_wait_s(self, back_s: float) -> float:
        return 0.0

    def group_only_s(self) -> float:
        return 0.0

    def heal_s(self) -> float:
        """The heal every group waits for."""
        return 0.0

    def catch_up_s(self) -> float:
        """The heal the joining groups take while every group steps: they stay out for it."""
        return 0.0

    def rejoin_s(self) -> float:
        raise NotImplementedError


class _Ours(_GroupReplay):
    def __init__(self, *args):
        super().__init__(*args)
        costs = self.costs
        self.deadline = StepDeadline(costs.deadline_factor, costs.min_deadline_s, costs.first_step_deadline_s)
        self.timed_until = 0.0

    @staticmethod
    def capacity_of(job: Job) -> Callable[[int], float]:
        """A group out lengthens the step to the widest share of the batch."""
        speeds = [job.step_s() / job.step_s(job.groups - out) for out in range(job.groups)] + [0.0]
        return lambda out: speeds[min(out, job.groups)]

    def committed_until(self, at: float) -> None:
        step_s = self.job.step_s(self.live())
        for _ in range(min(self.deadline.recent.maxlen, int(max(0.0, at - self.timed_until) // step_s))):
            self.deadline.record(step_s)
        self.timed_until = at

    def detect_s(self, kind: FailureKind) -> float:
        costs = self.costs
        if kind not in SILENT:
            return costs.drain_s
        found = self.deadline.seconds() + costs.probe_s
        return (min(found, costs.node_death_s) if kind in NODES_GONE else found) + costs.drain_s

    def regroup_s(self) -> float:
        """Every rank's cross-group groups rebuilt as the next segment starts, its spec carrying
        the new groups: one word in the driver's store, served to every rank waiting in its stream
        (``store_reads_per_s``), and a driver call to each rank of the changed group; a
        communicator over the groups; the memory tier's re-pairing."""
        costs = self.costs
        return (costs.regroup_s + self.job.ranks / costs.store_reads_per_s
                + self.job.model.group_gpus / costs.driver_calls_per_s + costs.comm_init_s(self.job.groups)
                + costs.pairing_s)

    def leave_s(self, planned: bool) -> float:
        return self.regroup_s()

    def spares_wait_s(self, back_s: float) -> float:
        """The survivors wait for a group on warm spares up to a typical step (GroupKeeper.settle)."""
        return min(back_s, self.deadline.typical_s())

    def catch_up_s(self) -> float:
        """The joining groups take the state rank to rank while every group steps
        (``elastic.core.protocol.CatchUp``): nobody waits for the copy."""
        return self.job.heal_bytes_per_gpu / self.costs.heal_bandwidth

    def rejoin_s(self) -> float:
        return self.regroup_s()

    def corrupted(self, failure: Failure) -> None:
        """Found when the next integrity check compares the replicas: the step discarded, the odd
        group healed; with two groups there is no majority and the memory tier's copies come back."""
        job, costs = self.job, self.costs
        if job.groups <= 2:
            self.timeline.lost_s += self.rng.random() * 2 * costs.memory_every_steps * job.step_s()
            return
        self.push(failure.at_s + self.rng.random() * costs.integrity_every_steps * job.step_s(self.live()),
                  self.FOUND, failure)


class _GroupRestart(_GroupReplay):
    @staticmethod
    def capacity_of(job: Job) -> Callable[[int], float]:
        """Each group trains its own share: a group out takes its share of the work with it."""
        return lambda out: max(0.0, 1 - out / job.groups)

    def detect_s(self, kind: FailureKind) -> float:
        costs = self.costs
        return costs.torchft_timeout_s if kind in (FailureKind.HANG, FailureKind.NIC) else costs.torchft_heartbeat_s

    def reconfigure_s(self) -> float:
        return self.costs.comm_init_s(self.job.groups)

    def leave_s(self, planned: bool) -> float:
        return self.reconfigure_s() + (0.0 if planned else self.costs.torchft_stall_s)

    def group_only_s(self) -> float:
        """The group's own restart and its heal from a peer, while the others train."""
        return self.costs.group_restart_s + self.job.heal_bytes_per_gpu / self.costs.heal_bandwidth

    def rejoin_s(self) -> float:
        return self.reconfigure_s()

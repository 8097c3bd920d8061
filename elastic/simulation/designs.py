"""A failure trace replayed against three designs of a trainer, on a simulated clock.

- **This product** (``ours``): every step a transaction, so a failure costs the step it
  struck; the failed rank's group leaves the quorum and the others keep training; the group
  takes a warm spare (``elastic.core.spares.choose_spares`` picks it) or waits for a node,
  rebuilds its world and heals from a live peer; a hang, a network fault or a node gone
  silent is found by the step deadline (``elastic.core.policies.StepDeadline``), a slow GPU by the straggler detector's latency, a
  silent corruption by the next integrity check. Each failure goes through the real
  diagnosis and recovery plan (``elastic.core.diagnosis``, ``elastic.core.recovery``).
- **Restart the world** (Ray Train's and torchrun's model): any failure stops every rank;
  the job restarts from its last checkpoint, on a spare node or a replaced one, and trains
  again what it had trained since; a hang holds it to the collective timeout.
- **Group restart with heal** (torchft's model): the failed group restarts fresh processes
  and heals from a live peer while the others train; a death is found by the heartbeat, a
  hang by the manager's timeout.

Every cost is a named figure in ``Costs`` with its source: measured here (``docs/benchmarks.md``)
or assumed, said so. The replay keeps a ledger per design: time the job trained on, work it
trained and then lost, and capacity it was down, which add up to the wall time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum

from elastic.core.diagnosis import diagnose
from elastic.core.policies import StepDeadline
from elastic.core.recovery import plan_recovery
from elastic.core.spares import Spare, choose_spares
from elastic.core.straggler_detector import DEFAULT_PATIENCE, DEFAULT_WINDOW
from elastic.core.topology import Topology
from elastic.simulation.failure_mix import GPUS_PER_NODE, Failure, FailureKind

H100_BF16_FLOPS = 989e12  # dense, SXM
STATE_BYTES_PER_PARAMETER = 12  # fp32 parameters and AdamW's two fp32 moments: what a heal copies


class Design(StrEnum):
    OURS = "ours"
    RESTART_THE_WORLD = "restart-the-world"
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
    global_batch_tokens: int = 16 * 2**20  # Llama 3 405B's
    mfu: float = 0.40  # Llama 3 405B's was 38 to 43 %

    @property
    def groups(self) -> int:
        return self.gpus // self.model.group_gpus

    @property
    def step_s(self) -> float:
        """A step at ``mfu``: 6 FLOPs per parameter per token."""
        return 6 * self.model.parameters * self.global_batch_tokens / (self.gpus * H100_BF16_FLOPS * self.mfu)

    @property
    def heal_bytes_per_gpu(self) -> float:
        return STATE_BYTES_PER_PARAMETER * self.model.parameters / self.model.group_gpus

    @property
    def topology(self) -> Topology:
        model = self.model
        return Topology(model.shard, model.tp, self.groups, model.pp)


@dataclass(frozen=True)
class Costs:
    """The figures each recovery is made of, in seconds (bandwidths in bytes per second).
    ``SOURCES`` says where each comes from."""

    regroup_s: float = 0.3
    spare_takeover_s: float = 4.0
    process_start_s: float = 3.5
    world_init_s_per_rank: float = 0.002
    heal_bandwidth: float = 25e9
    node_replacement_s: float = 600.0
    deadline_factor: float = 5.0
    min_deadline_s: float = 10.0
    integrity_every_steps: int = 10
    memory_every_steps: int = 10
    slowdown: float = 1.5
    slow_gpu_lasts_s: float = 7200.0
    world_restart_s: float = 9.0
    checkpoint_every_s: float = 1800.0
    checkpoint_read_per_node: float = 5e9
    collective_timeout_s: float = 600.0
    node_death_s: float = 30.0
    heartbeat_s: float = 5.0
    group_restart_s: float = 1.2
    manager_timeout_s: float = 60.0


SOURCES = {
    "regroup_s": "measured: kill -> next commit 1.7-1.9 s at 1 s steps, less the step redone and the part discarded "
                 "(bench/goodput.py, docs/benchmarks.md)",
    "spare_takeover_s": "measured: kill -> group whole with a warm spare, 3.47 steps of 1.16 s on one H100 over gloo "
                        "(bench/gpu_check.py, docs/benchmarks.md)",
    "process_start_s": "measured: a fresh rank process's start, 3-4 s on CPU (docs/architecture.md, warm spares)",
    "world_init_s_per_rank": "assumed: a communicator's bootstrap grows with its ranks, 1 s per 500 (a group's "
                             "world; the cross-group groups, one rank per group, after every failure)",
    "heal_bandwidth": "assumed: one 200 Gb/s NIC per GPU",
    "node_replacement_s": "assumed: a node replaced and its pod started (KubeRay); none measured here",
    "deadline_factor": "this product's default (fault_tolerance.deadline_factor)",
    "min_deadline_s": "this product's default (fault_tolerance.min_deadline_s)",
    "integrity_every_steps": "assumed setting of integrity.every",
    "memory_every_steps": "this product's default (checkpoint.memory_every)",
    "slowdown": "assumed: a slow GPU's step time over a healthy one's (every rank waits for it)",
    "slow_gpu_lasts_s": "assumed: how long a slow GPU slows a job that does not detect it, until someone acts",
    "world_restart_s": "measured: Ray Train V2's kill -> next commit, tiny job (bench/recovery.py)",
    "checkpoint_every_s": "assumed: restart-the-world's checkpoint interval",
    "checkpoint_read_per_node": "assumed: a node reads its shards of a checkpoint at 5 GB/s",
    "collective_timeout_s": "torch's default NCCL timeout: how long a hang holds a job that waits for the collective",
    "node_death_s": "assumed: Ray's health check marks a silent node dead (a few missed checks)",
    "heartbeat_s": "measured: torchft's default heartbeat timeout, kill -> next commit 5.0 s (bench/goodput.py)",
    "group_restart_s": "measured: torchft's kill -> group whole 6.2 s, less its 5 s heartbeat (bench/goodput.py)",
    "manager_timeout_s": "assumed: torchft's manager timeout, which ends a hang's wait",
}


@dataclass
class Ledger:
    """Where a design's wall time went, in seconds of the whole job: ``trained`` on work it
    kept, ``lost`` on work it trained and then threw away, ``down`` with capacity idle
    (groups out, the job stopped, or slowed by a slow GPU)."""

    wall_s: float
    trained_s: float = 0.0
    lost_s: float = 0.0
    down_s: float = 0.0
    failures: int = 0
    spares_short: int = 0  # failures that found no spare and waited for a node
    decisions: int = 0  # failures taken through the real diagnosis and recovery plan

    @property
    def ettr(self) -> float:
        """Effective training time ratio: the wall time's share spent training kept work."""
        return self.trained_s / self.wall_s


@dataclass
class _Outage:
    """Capacity out from ``start_s`` to ``end_s``: ``share`` of the job (1: all of it)."""

    start_s: float
    end_s: float
    share: float


@dataclass
class _Timeline:
    outages: list[_Outage] = field(default_factory=list)
    lost_s: float = 0.0
    spares_short: int = 0
    decisions: int = 0

    def out(self, start_s: float, duration_s: float, share: float) -> float:
        self.outages.append(_Outage(start_s, start_s + duration_s, share))
        return start_s + duration_s

    def ledger(self, wall_s: float) -> Ledger:
        """The outages swept in time: at each moment the share out is the sum of those under
        way, capped at the whole job."""
        changes = sorted([(min(wall_s, o.start_s), o.share) for o in self.outages]
                         + [(min(wall_s, o.end_s), -o.share) for o in self.outages] + [(wall_s, 0.0)])
        up = down = share = since = 0.0
        for at, change in changes:
            out = min(1.0, max(0.0, share))
            up, down = up + (at - since) * (1 - out), down + (at - since) * out
            share, since = share + change, at
        lost = min(self.lost_s, up)  # work trained and thrown away was trained while up
        return Ledger(wall_s, up - lost, lost, down, spares_short=self.spares_short, decisions=self.decisions)


class _Spares:
    """A pool of spare GPUs, whole nodes of them; a GPU taken comes back once its failed one is
    replaced (``node_replacement_s`` later)."""

    def __init__(self, gpus: int):
        self.free = [Spare(index, ready=True, node=f"spare{index // GPUS_PER_NODE}") for index in range(gpus)]
        self.returning: list[tuple[float, list[Spare]]] = []

    def take(self, ranks: list[int], node_of: Mapping[int, str], now_s: float, back_s: float) -> dict[int, int]:
        self.free += [spare for at, back in self.returning if at <= now_s for spare in back]
        self.returning = [(at, back) for at, back in self.returning if at > now_s]
        chosen = choose_spares(ranks, self.free, node_of)
        taken = [spare for spare in self.free if spare.id in chosen.values()]
        self.free = [spare for spare in self.free if spare.id not in chosen.values()]
        self.returning.append((now_s + back_s, taken))
        return chosen


def _struck_ranks(failure: Failure) -> list[int]:
    if failure.kind == FailureKind.NODE_LOST:
        return list(range(failure.gpu, failure.gpu + GPUS_PER_NODE))
    return [failure.gpu]


def _goes_silent(kind: FailureKind) -> bool:
    """Whether the ranks waiting on the failed one get no error and wait for a timeout: a hang,
    a network fault, a node gone without closing its connections. A GPU lost or a process
    crashed closes them, and its peers' collectives fail at once."""
    return kind in (FailureKind.HANG, FailureKind.NETWORK, FailureKind.NODE_LOST)


def _needs_hardware(kind: FailureKind) -> bool:
    return kind in (FailureKind.GPU_LOST, FailureKind.NODE_LOST)


def replay(job: Job, failures: Iterable[Failure], design: Design, wall_s: float, spare_gpus: int = 0,
           costs: Costs = Costs(), seed: int = 0) -> Ledger:
    """``failures`` (a trace over ``wall_s``) as ``design`` would live through them."""
    rng = random.Random(seed)  # where in its step each failure strikes
    run = {Design.OURS: _ours, Design.RESTART_THE_WORLD: _restart_the_world,
           Design.GROUP_RESTART: _group_restart}[design]
    within = [failure for failure in failures if failure.at_s < wall_s]
    timeline = _Timeline()
    run(job, within, timeline, spare_gpus, costs, rng)
    ledger = timeline.ledger(wall_s)
    ledger.failures = len(within)
    return ledger


def _ours(job, failures, timeline, spare_gpus, costs, rng) -> None:
    topology, step_s = job.topology, job.step_s
    spares = _Spares(spare_gpus)
    deadline = StepDeadline(costs.deadline_factor, costs.min_deadline_s, costs.min_deadline_s)
    deadline.record(step_s)
    group_share = 1 / job.groups
    heal_s = job.heal_bytes_per_gpu / costs.heal_bandwidth
    world_s = costs.world_init_s_per_rank * job.model.group_gpus
    for failure in failures:
        ranks = _struck_ranks(failure)
        at = failure.at_s
        if failure.kind == FailureKind.SLOW_GPU:
            # the whole job runs at the slow GPU's pace until the detector flags it
            detect_s = (DEFAULT_WINDOW // 2 + DEFAULT_PATIENCE) * step_s * costs.slowdown
            at = timeline.out(at, detect_s, 1 - 1 / costs.slowdown)
        elif failure.kind == FailureKind.SILENT_CORRUPTION:
            # found at the next integrity check; the odd group heals from the others
            at += rng.random() * costs.integrity_every_steps * step_s
            timeline.out(at, heal_s + world_s, group_share)
            continue
        else:
            # the step it struck is discarded everywhere; a hang first holds it to the deadline
            timeline.lost_s += rng.random() * step_s
            if _goes_silent(failure.kind):
                at = timeline.out(at, deadline.seconds(), 1.0)
            # the survivors rebuild their cross-group process groups, one rank per group each
            at = timeline.out(at, costs.regroup_s + costs.world_init_s_per_rank * job.groups, 1.0)
        timeline.decisions += 1
        group_of = {rank: topology.group_of(rank) for rank in ranks}
        diagnosis = diagnose(dead=ranks, outcomes={}, hung=[], group_of=group_of)
        plan = plan_recovery(diagnosis, topology, range(job.groups))
        evicted = [eviction.rank for eviction in plan.evictions]
        chosen = spares.take(evicted, {rank: f"node{rank // GPUS_PER_NODE}" for rank in evicted}, at,
                             costs.node_replacement_s)
        if len(chosen) == len(evicted):
            back_s = costs.spare_takeover_s
        elif _needs_hardware(failure.kind):
            timeline.spares_short += 1
            back_s = costs.node_replacement_s + costs.process_start_s
        else:
            back_s = costs.process_start_s  # a fresh process where the old one ran
        back_s += world_s + heal_s
        if job.groups == 1:  # no peer to heal from: the memory tier's copies, the steps since lost
            timeline.lost_s += rng.random() * costs.memory_every_steps * step_s
        timeline.out(at, back_s, group_share * len(plan.rebuilding))


def _restart_the_world(job, failures, timeline, spare_gpus, costs, rng) -> None:
    spares = _Spares(spare_gpus)
    nodes = job.gpus / GPUS_PER_NODE
    load_s = STATE_BYTES_PER_PARAMETER * job.model.parameters / (nodes * costs.checkpoint_read_per_node)
    restart_s = costs.world_restart_s + costs.world_init_s_per_rank * job.gpus + load_s
    resumed_at = 0.0  # the last restart's end: checkpoints are taken from there on
    for failure in failures:
        at = max(failure.at_s, resumed_at)
        if failure.kind == FailureKind.SILENT_CORRUPTION:
            continue  # not found: no time lost, a corrupt model trained on
        if failure.kind == FailureKind.SLOW_GPU:
            timeline.out(at, costs.slow_gpu_lasts_s, 1 - 1 / costs.slowdown)
            continue
        timeline.lost_s += (at - resumed_at) % costs.checkpoint_every_s  # trained since the last checkpoint
        detect_s = {FailureKind.HANG: costs.collective_timeout_s, FailureKind.NETWORK: costs.collective_timeout_s,
                    FailureKind.NODE_LOST: costs.node_death_s}.get(failure.kind, 0.0)
        wait_s = 0.0
        if _needs_hardware(failure.kind):
            ranks = _struck_ranks(failure)
            if len(spares.take(ranks, {}, at, costs.node_replacement_s)) < len(ranks):
                timeline.spares_short += 1
                wait_s = costs.node_replacement_s
        resumed_at = timeline.out(at, detect_s + wait_s + restart_s, 1.0)


def _group_restart(job, failures, timeline, spare_gpus, costs, rng) -> None:
    topology = job.topology
    spares = _Spares(spare_gpus)
    group_share = 1 / job.groups
    heal_s = job.heal_bytes_per_gpu / costs.heal_bandwidth
    restart_s = (costs.group_restart_s + costs.process_start_s + costs.world_init_s_per_rank * job.model.group_gpus
                 + heal_s)
    for failure in failures:
        at = failure.at_s
        if failure.kind == FailureKind.SILENT_CORRUPTION:
            continue
        if failure.kind == FailureKind.SLOW_GPU:
            timeline.out(at, costs.slow_gpu_lasts_s, 1 - 1 / costs.slowdown)
            continue
        # the other groups commit without it once it is found (their step counts for their share),
        # on a process group reconfigured for the new quorum
        detect_s = costs.manager_timeout_s if failure.kind in (FailureKind.HANG, FailureKind.NETWORK) \
            else costs.heartbeat_s  # a node gone stops its heartbeats too
        timeline.out(at, detect_s + costs.world_init_s_per_rank * job.groups, 1.0)
        ranks = _struck_ranks(failure)
        wait_s = 0.0
        if _needs_hardware(failure.kind) and len(spares.take(ranks, {}, at, costs.node_replacement_s)) < len(ranks):
            timeline.spares_short += 1
            wait_s = costs.node_replacement_s
        groups = {topology.group_of(rank) for rank in ranks}
        timeline.out(at + detect_s, wait_s + restart_s, group_share * len(groups))


def cost_lines(costs: Costs = Costs()) -> list[str]:
    """Each figure, its value and its source, for the output."""
    return [f"{item.name} = {getattr(costs, item.name):g}: {SOURCES[item.name]}"
            + ("" if getattr(costs, item.name) == item.default else " (replaced here)") for item in fields(costs)]

"""Failures of a large training fleet, drawn from published rates.

The rate and the mix are Llama 3's 54-day pre-training on 16,384 H100s ("The Llama 3 Herd of
Models", Meta, 2024, section 3.3.4 and Table 5): 466 interruptions, 47 of them planned
(automated maintenance: firmware upgrades, operator-initiated configuration or dataset
updates) and 419 unexpected, by root cause: faulty GPU 148, GPU HBM3 memory 72, software bug
54, network switch or cable 35, host maintenance 32, GPU SRAM memory 19, GPU system processor
17, NIC 7, NCCL watchdog timeouts 7, silent data corruption 6, GPU thermal interface and
sensor 6, SSD 3, power supply 3, server chassis 2, IO expansion board 2, dependency 2, CPU 2,
system memory 2. They are grouped here by what a trainer sees, and by how many GPUs one event
takes at once (its failure domain): a GPU (its rank dies, the node stays), a node (eight ranks,
connections left open), a rack (a top-of-rack switch: Llama 3's racks hold two 8-GPU servers
behind one switch, section 3.3.1), a power domain, a NIC or a hang (a rank stops answering
inside a collective), a software failure (a rank's process dies), a silent data corruption.

What Table 5 does not give is named in ``FailureModel`` and ``SOURCES``, each an assumption to
be replaced by a team's own: slow GPUs, power domains, repeat offenders, how a silent
corruption splits between held state and compute, how planned interruptions split between a
node's and the whole job's.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields
from enum import StrEnum

GPUS_PER_NODE = 8
HOUR_S = 3600.0
DAY_S = 86_400.0


class FailureKind(StrEnum):
    GPU_LOST = "gpu-lost"
    NODE_LOST = "node-lost"
    RACK_LOST = "rack-lost"
    POWER_DOMAIN_LOST = "power-domain-lost"
    NIC = "nic"
    HANG = "hang"
    SOFTWARE = "software"
    STATE_CORRUPTION = "state-corruption"  # a flipped bit in the state a rank holds
    COMPUTE_CORRUPTION = "compute-corruption"  # a wrong result in a step's forward or backward
    SLOW_GPU = "slow-gpu"
    NODE_MAINTENANCE = "node-maintenance"  # planned: one node drained with notice
    JOB_MAINTENANCE = "job-maintenance"  # planned: the job stopped with notice (a configuration change)


# Llama 3's Table 5, by what a trainer sees (the module's docstring names each row); the silent
# corruptions and the planned interruptions are split by ``FailureModel``
LLAMA3_UNEXPECTED = {
    FailureKind.GPU_LOST: 148 + 72 + 19 + 17 + 6,
    FailureKind.NODE_LOST: 32 + 3 + 3 + 2 + 2 + 2 + 2,
    FailureKind.RACK_LOST: 35,
    FailureKind.NIC: 7,
    FailureKind.HANG: 7,
    FailureKind.SOFTWARE: 54 + 2,
}
LLAMA3_SILENT_CORRUPTIONS = 6
LLAMA3_PLANNED = 47
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
LLAMA3_GPU_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS
RACK_GPUS = 2 * GPUS_PER_NODE

# Kinds whose struck ranks stop answering without closing their connections: a hang, a NIC, and
# nodes gone (Ray notices a node gone by its missed health checks; a hang only by a deadline)
SILENT = frozenset({FailureKind.HANG, FailureKind.NIC, FailureKind.NODE_LOST, FailureKind.RACK_LOST,
                    FailureKind.POWER_DOMAIN_LOST})
NODES_GONE = frozenset({FailureKind.NODE_LOST, FailureKind.RACK_LOST, FailureKind.POWER_DOMAIN_LOST})
NEEDS_HARDWARE = frozenset({FailureKind.GPU_LOST, *NODES_GONE, FailureKind.NODE_MAINTENANCE})
# A node that failed may fail again: a lemon node (Kokolis et al.) fails for a reason it keeps
REPEATABLE = frozenset({FailureKind.GPU_LOST, FailureKind.NODE_LOST, FailureKind.NIC, FailureKind.HANG,
                        FailureKind.SOFTWARE})


@dataclass(frozen=True)
class FailureModel:
    """What a trace is drawn from: Llama 3's rates times ``scale``, and what Table 5 does not
    give. ``SOURCES`` says where each figure comes from."""

    scale: float = 1.0
    planned: bool = True
    job_maintenance_share: float = 0.0
    sdc_state_share: float = 0.5
    slow_gpu_share: float = 0.1
    power_domains_per_gpu_day: float = 1 / (90 * LLAMA3_GPUS)
    power_domain_gpus: int = 256
    repeat_share: float = 0.1
    repeat_within_s: float = 6 * HOUR_S

    @classmethod
    def published(cls, scale: float = 1.0, planned: bool = True) -> FailureModel:
        """A publication's own figures: Llama 3's mix at ``scale``, nothing Table 5 does not give
        (no slow GPUs, power domains or repeat offenders; silent corruptions and planned
        interruptions as Table 5's kinds with the defaults' split, which moves no ETTR of the
        designs the publications ran)."""
        return cls(scale=scale, planned=planned, slow_gpu_share=0.0, power_domains_per_gpu_day=0.0,
                   repeat_share=0.0)

    @classmethod
    def at_node_rate(cls, failures_per_node_day: float) -> FailureModel:
        """Llama 3's unexpected mix scaled to ``failures_per_node_day``, nothing planned."""
        llama3 = (sum(LLAMA3_UNEXPECTED.values()) + LLAMA3_SILENT_CORRUPTIONS) / (
            LLAMA3_DAYS * LLAMA3_GPUS / GPUS_PER_NODE)
        return cls.published(failures_per_node_day / llama3, planned=False)


SOURCES = {
    "scale": "1: Llama 3's rates (Table 5, 54 days on 16,384 H100s)",
    "planned": "Llama 3's 47 planned interruptions in the same 54 days",
    "job_maintenance_share": "assumed: Llama 3 does not split its planned interruptions between firmware upgrades "
                             "(a node) and configuration or dataset updates (the job); all a node's here",
    "sdc_state_share": "assumed: no published split of silent corruptions between held state (a flipped bit the "
                       "integrity check sees, replicas differing) and compute (a wrong gradient that enters the "
                       "cross-group sum, every replica then identical, which no replica comparison sees)",
    "slow_gpu_share": "assumed: a slow GPU for every ten interruptions (Table 5 counts interruptions only)",
    "power_domains_per_gpu_day": "assumed: one power domain lost per 90 days at 16,384 GPUs (Llama 3 reports none "
                                 "in 54 days; Meta's and ByteDance's reports name power among correlated causes, "
                                 "without a rate)",
    "power_domain_gpus": "assumed: a power domain is 16 racks of Llama 3's 16 GPUs",
    "repeat_share": "assumed: one failure in ten strikes a node that failed before (Kokolis et al. 2024 describe "
                    "lemon nodes without a rate in this form)",
    "repeat_within_s": "assumed: a repeat comes within 6 hours on average",
}


def model_lines(model: FailureModel, sources: dict[str, str]) -> list[str]:
    return [f"{item.name} = {getattr(model, item.name):g}: {sources[item.name]}" for item in fields(model)]


@dataclass(frozen=True)
class Failure:
    at_s: float
    kind: FailureKind
    gpu: int  # the first GPU it strikes
    gpus: int = 1  # how many, from ``gpu`` on: its failure domain

    @property
    def node(self) -> int:
        return self.gpu // GPUS_PER_NODE


def domain_gpus(kind: FailureKind, model: FailureModel) -> int:
    return {FailureKind.NODE_LOST: GPUS_PER_NODE, FailureKind.NODE_MAINTENANCE: GPUS_PER_NODE,
            FailureKind.RACK_LOST: RACK_GPUS, FailureKind.POWER_DOMAIN_LOST: model.power_domain_gpus}.get(kind, 1)


def rates_per_gpu_hour(model: FailureModel = FailureModel()) -> dict[FailureKind, float]:
    """Each kind's rate per GPU-hour."""
    per_hour = model.scale / LLAMA3_GPU_HOURS
    rates = {kind: count * per_hour for kind, count in LLAMA3_UNEXPECTED.items()}
    rates[FailureKind.STATE_CORRUPTION] = LLAMA3_SILENT_CORRUPTIONS * model.sdc_state_share * per_hour
    rates[FailureKind.COMPUTE_CORRUPTION] = LLAMA3_SILENT_CORRUPTIONS * (1 - model.sdc_state_share) * per_hour
    rates[FailureKind.SLOW_GPU] = model.slow_gpu_share * sum(rates.values())
    rates[FailureKind.POWER_DOMAIN_LOST] = model.power_domains_per_gpu_day / 24
    planned = LLAMA3_PLANNED * per_hour if model.planned else 0.0
    rates[FailureKind.NODE_MAINTENANCE] = planned * (1 - model.job_maintenance_share)
    rates[FailureKind.JOB_MAINTENANCE] = planned * model.job_maintenance_share
    return {kind: rate for kind, rate in rates.items() if rate > 0}


def draw_failures(gpus: int, duration_s: float, seed: int, model: FailureModel = FailureModel()) -> list[Failure]:
    """A trace of failures over ``duration_s`` on ``gpus`` GPUs, in time order: each kind a
    Poisson process at its rate striking a domain drawn uniformly; then ``repeat_share`` of the
    repeatable ones moved onto the node of an earlier one, ``repeat_within_s`` after it on
    average (the count, and so the rate, unchanged)."""
    rng = random.Random(seed)
    failures = []
    for kind, rate in rates_per_gpu_hour(model).items():
        size = min(domain_gpus(kind, model), gpus)
        per_second = rate * gpus / HOUR_S
        at = rng.expovariate(per_second)
        while at < duration_s:
            first = rng.randrange(gpus // size) * size
            failures.append(Failure(at, kind, first, size))
            at += rng.expovariate(per_second)
    failures.sort(key=lambda failure: failure.at_s)
    if not model.repeat_share:
        return failures
    struck: list[Failure] = []  # repeatable failures so far, a repeat's candidates
    repeated = []
    for failure in failures:
        if failure.kind in REPEATABLE and struck and rng.random() < model.repeat_share:
            before = rng.choice(struck)
            at = before.at_s + rng.expovariate(1 / model.repeat_within_s)
            if at < duration_s:
                failure = Failure(at, failure.kind, before.node * GPUS_PER_NODE + failure.gpu % GPUS_PER_NODE,
                                  failure.gpus)
        if failure.kind in REPEATABLE:
            struck.append(failure)
        repeated.append(failure)
    return sorted(repeated, key=lambda failure: failure.at_s)


def draw_failures_every(gpus: int, duration_s: float, interval_s: float, seed: int,
                        model: FailureModel = FailureModel()) -> list[Failure]:
    """A failure every ``interval_s`` over ``duration_s`` on ``gpus`` GPUs, each of a kind drawn
    in proportion to the kinds' rates and striking a domain drawn uniformly: the accounting of
    an arithmetic that charges every failure its mean interval's share, as FT-HSDP's (Salpekar
    et al. 2026: a failure every 18 minutes, ETTR = (18 - stall) / 18) does. With a recovery
    shorter than the interval, no failure strikes during another's recovery."""
    rng = random.Random(seed)
    rates = rates_per_gpu_hour(model)
    kinds, weights = list(rates), list(rates.values())
    failures = []
    at = interval_s
    while at < duration_s:
        kind = rng.choices(kinds, weights)[0]
        size = min(domain_gpus(kind, model), gpus)
        failures.append(Failure(at, kind, rng.randrange(gpus // size) * size, size))
        at += interval_s
    return failures

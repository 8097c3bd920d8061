"""The driver's own CPU at a fleet's size, timed on the real decision code.

Per step, the driver reads the ranks' step times into the straggler detector
(``StragglerDetector.observe_arrays`` over every rank). Per failure it diagnoses, plans the
recovery, chooses spares, moves the group through the membership, and pairs every rank with
a buddy for the memory tier again where its buddy left (``BuddyPairing``, at each change of
the quorum).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from elastic.core.diagnosis import diagnose
from elastic.core.memory_tier import BuddyPairing
from elastic.core.membership import Built, Membership, Placed, Started
from elastic.core.recovery import plan_recovery
from elastic.core.spares import Spare, choose_spares
from elastic.core.straggler_detector import StragglerDetector
from elastic.simulation.designs import Job
from elastic.simulation.failure_mix import GPUS_PER_NODE


@dataclass(frozen=True)
class DriverCost:
    gpus: int
    step_observe_s: float  # the straggler detector's read of one step, every rank
    failure_decision_s: float  # diagnosis, plan, spares, membership
    buddies_s: float  # the memory tier's re-pairing at a quorum change: one group lost, then back


def _best_of(repeats: int, action: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        best = min(best, time.perf_counter() - started)
    return best


def driver_cost(job: Job, spare_gpus: int = 64, repeats: int = 3) -> DriverCost:
    topology = job.topology
    ranks = np.arange(job.groups * job.model.group_gpus)
    detector = StragglerDetector()
    times = np.random.default_rng(0).normal(1.0, 0.01, len(ranks))
    for step in range(detector.window):  # a full window: every rank scored
        detector.observe_arrays(step, ranks, times)
    step_observe_s = _best_of(repeats, lambda: detector.observe_arrays(detector.window, ranks, times))

    membership = Membership(topology)
    for _ in range(job.groups):
        group = membership.add_group()
        for change in (Placed(), Started(), Built()):
            membership.apply(group, change)
    membership.join(list(membership.groups))
    spares = [Spare(index, ready=True, node=f"spare{index // GPUS_PER_NODE}") for index in range(spare_gpus)]
    node_of = {int(rank): f"node{rank // GPUS_PER_NODE}" for rank in ranks}

    def decide(lost: int = int(ranks[-1])):
        diagnosis = diagnose(dead=[lost], outcomes={}, hung=[], group_of={lost: topology.group_of(lost)})
        plan = plan_recovery(diagnosis, topology, membership.live_groups())
        choose_spares([eviction.rank for eviction in plan.evictions], spares, node_of)
        return plan

    failure_decision_s = _best_of(repeats, decide)
    pairing = BuddyPairing(topology)
    pairing.update(membership.live_groups(), node_of)
    lost = topology.group_of(int(ranks[-1]))
    live = set(membership.live_groups())

    def re_pair():
        pairing.update(live - {lost}, node_of)
        pairing.update(live, node_of)

    buddies_s = _best_of(repeats, re_pair) / 2
    return DriverCost(len(ranks), step_observe_s, failure_decision_s, buddies_s)

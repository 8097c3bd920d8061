"""Straggler handling for the controller: detect slow ranks, decide, and measure what each
decision bought. Pure (numpy, an injectable clock), no Ray: the controller applies the
actions at the next step boundary.

Once per committed step the controller hands over every rank's outcome. Each rank's compute
seconds *per sample of its group* go to the detector (so a group that was given fewer
samples is not mistaken for a fast one); a group's speed is its slowest rank's window
median (its ranks run in lockstep) and its fixed cost the slowest rank's data time (the
previous step's optimizer update and the collation, which do not shrink with the share).
The policy then picks the cheapest action that raises the predicted throughput:

* ``rebalance``/``restore``: new data-plan weights (the gradient is unchanged by design);
* ``replace``: the controller kills the rank and heals its group with a fresh process;
* ``evict-group``: the controller drops the group from the quorum and frees its placement.

Every flag is a ``straggler-detected`` event (``rank``, ``step``, ``score``). Every decision
is a ``straggler-decided`` event when it is made, and a ``straggler-mitigated`` event
(``action``, ``rank`` or ``group``, ``step``, ``predicted_gain``, ``measured_gain``) once
its gain was measured: the median step time of the ``window`` steps before the decision against that of the ``window`` steps after it took
effect (for ``replace``, from the replacement's first step, so the group's absence while it
heals does not count against it).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from elastic.core.data_plan import group_weights
from elastic.core.events import EventKind, EventLog
from elastic.core.straggler_detector import StragglerDetector
from elastic.core.straggler_policy import Mitigation, StragglerPolicy


class StragglerSettings(Protocol):
    """What straggler handling reads of its settings: the config's ``stragglers`` section
    (``elastic.setup.config.StragglerConfig``) is one. A Protocol, so that the pure core does
    not depend on the config above it."""

    @property
    def window(self) -> int: ...
    @property
    def threshold(self) -> float: ...
    @property
    def mad_gate(self) -> float: ...
    @property
    def patience(self) -> int: ...
    @property
    def mitigate(self) -> bool: ...
    @property
    def min_saving_s(self) -> float: ...


@dataclass(frozen=True)
class StragglerActions:
    """What the controller applies at the next step boundary."""

    weights: dict[int, float] | None = None  # data-plan weights of the live groups; None: keep
    replace: tuple[int, ...] = ()  # ranks to kill and heal with a fresh process
    evict_groups: tuple[int, ...] = ()  # groups to drop from the quorum


NO_ACTIONS = StragglerActions()

# Whether the cluster has a slot for a replacement: asked (a call to the cluster) only when a
# decision is being made, never on a step that flags nothing.
SpareSlot = bool | Callable[[], bool]


@dataclass
class _Followup:
    """A decision whose gain is being measured."""

    fields: dict
    baseline_step_s: float
    waits_for_rank: int | None  # measuring starts once this rank reports again
    step_times: list[float] = field(default_factory=list)


class StragglerMitigation:
    def __init__(self, config: StragglerSettings, global_batch: int, events: EventLog,
                 clock: Callable[[], float] = time.monotonic, min_gain: float = 0.05, slow_by_data: bool = False):
        self.detector = StragglerDetector(config.window, config.threshold, config.mad_gate, config.patience, clock)
        self.policy = StragglerPolicy(min_gain, config.min_saving_s, slow_by_data)
        self.mitigate = config.mitigate
        self.global_batch = global_batch
        self.events = events
        self.measure_steps = config.window
        self.weights: dict[int, float] = {}  # live groups' data-plan weights (absent: 1.0)
        self.uniform_weights = True
        self.group_of_flagged: dict[int, int] = {}
        self.decided_for: set[int] = set()  # flagged ranks at the last decision
        self.decided_at = -1
        self.recent_step_s: deque[float] = deque(maxlen=config.window)
        self.followups: list[_Followup] = []

    def on_step(self, step: int, outcomes: Mapping, group_of: Mapping[int, int], group_samples: Mapping[int, int],
                spare_slot: SpareSlot, min_groups: int) -> StragglerActions:
        """One committed step: ``outcomes`` are the ranks' RankOutcomes, ``group_samples`` the
        samples each live group was given."""
        ranks = sorted(outcomes)
        n = len(ranks)
        return self.on_step_arrays(
            step,
            np.array(ranks, dtype=np.int64),
            np.fromiter((group_of[r] for r in ranks), np.int64, n),
            samples=np.fromiter((group_samples[group_of[r]] for r in ranks), np.float64, n),
            compute_s=np.fromiter((outcomes[r].compute_s for r in ranks), np.float64, n),
            fixed_s=np.fromiter((outcomes[r].data_s for r in ranks), np.float64, n),
            step_s=max((outcomes[r].wall_s for r in ranks), default=0.0),
            spare_slot=spare_slot,
            min_groups=min_groups,
        )

    def on_step_arrays(self, step: int, ranks: np.ndarray, groups: np.ndarray, *, samples: np.ndarray,
                       compute_s: np.ndarray, fixed_s: np.ndarray, step_s: float, spare_slot: SpareSlot,
                       min_groups: int) -> StragglerActions:
        """``on_step`` over parallel per-rank arrays (a driver with thousands of ranks);
        ``samples`` is each rank's group's share of the step."""
        with np.errstate(divide="ignore", invalid="ignore"):
            # A group given no samples only ran padding: nothing to learn about its speed.
            per_sample = np.where(samples > 0, compute_s / samples, np.nan)
        flags, recovered = self.detector.observe_arrays(step, ranks, per_sample)
        self._report_flags(step, ranks, groups, flags, recovered)
        self._measure(step_s, ranks)
        self.recent_step_s.append(step_s)
        if not self.mitigate:
            return NO_ACTIONS
        flagged = self.detector.flagged()
        if not flagged and self.uniform_weights:
            return NO_ACTIONS  # the policy's answer: nothing to do (skips building its inputs)
        if flagged.keys() == self.decided_for and step - self.decided_at < self.measure_steps:
            # Same flags as the last decision, which the window since has not yet measured:
            # deciding again would act on the timings from before it took effect.
            return NO_ACTIONS
        self.decided_for, self.decided_at = set(flagged), step
        decision = self._decide(ranks, groups, fixed_s, flagged, spare_slot, min_groups)
        return NO_ACTIONS if decision is None else self._act(step, decision)

    def forget(self, rank: int) -> None:
        """The rank's process was replaced or its group evicted: a fresh history starts."""
        self.detector.forget(rank)
        self.group_of_flagged.pop(rank, None)

    def scores(self, digits: int | None = None) -> dict[int, float]:
        """Each scored rank's compute time over the median rank's (1.0 = typical)."""
        return self.detector.scores(digits)

    def close(self) -> None:
        """The run ended: report the decisions still being measured with what was measured."""
        for followup in self.followups:
            self._emit_mitigated(followup)
        self.followups = []

    def _report_flags(self, step, ranks, groups, flags, recovered) -> None:
        for flag in flags:
            group = int(groups[np.flatnonzero(ranks == flag.rank)[0]])
            self.group_of_flagged[flag.rank] = group
            self.events.emit(EventKind.STRAGGLER_DETECTED, rank=flag.rank, group=group, step=step, score=round(flag.score, 3))
        for rank in recovered:
            self.group_of_flagged.pop(rank, None)
            self.events.emit(EventKind.STRAGGLER_RECOVERED, rank=rank, step=step)

    def _decide(self, ranks, groups, fixed_s, flagged, spare_slot, min_groups) -> Mitigation | None:
        if len(groups) > 1 and (groups[1:] < groups[:-1]).any():
            order = np.argsort(groups, kind="stable")
            ranks, groups, fixed_s = ranks[order], groups[order], fixed_s[order]
        starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
        live = groups[starts].tolist()
        # fmax skips NaN: a rank without a usable median yet does not decide its group's speed.
        speed = np.fmax.reduceat(self.detector.medians_of(ranks), starts)
        if np.isnan(speed).all():
            return None
        speed = np.where(np.isnan(speed), np.nanmedian(speed), speed)
        fixed = np.fmax.reduceat(fixed_s, starts)
        self.weights = group_weights(live, self.weights)
        return self.policy.decide(
            slow_ranks={rank: self.group_of_flagged[rank] for rank in flagged if rank in self.group_of_flagged},
            rank_scores=flagged,
            group_seconds_per_sample=dict(zip(live, speed.tolist())),
            group_fixed_seconds=dict(zip(live, np.nan_to_num(fixed).tolist())),
            weights=self.weights,
            global_batch=self.global_batch,
            spare_slots=int(spare_slot() if callable(spare_slot) else spare_slot),
            min_groups=min_groups,
        )

    def _act(self, step: int, decision: Mitigation) -> StragglerActions:
        target = {"rank": decision.rank} if decision.action == "replace" else {
            "group": decision.group if decision.action != "restore" else min(self.weights, key=self.weights.get)
        }
        fields = {"action": decision.action, **target, "step": step,
                  "predicted_gain": round(decision.predicted_gain, 4),
                  "predicted_step_s": round(decision.predicted_step_s, 5)}
        baseline = float(np.median(self.recent_step_s))
        self.followups.append(_Followup(fields, baseline, decision.rank if decision.action == "replace" else None))
        self.events.emit(EventKind.STRAGGLER_DECIDED, **fields)
        self.weights = dict(decision.weights)
        self.uniform_weights = len(set(self.weights.values())) <= 1
        return StragglerActions(
            weights=dict(decision.weights),
            replace=(decision.rank,) if decision.action == "replace" else (),
            evict_groups=(decision.group,) if decision.action == "evict-group" else (),
        )

    def _measure(self, step_s: float, ranks: np.ndarray) -> None:
        done = []
        for followup in self.followups:
            if followup.waits_for_rank is not None:
                if not (ranks == followup.waits_for_rank).any():
                    continue
                followup.waits_for_rank = None
            followup.step_times.append(step_s)
            if len(followup.step_times) >= self.measure_steps:
                done.append(followup)
        for followup in done:
            self.followups.remove(followup)
            self._emit_mitigated(followup)

    def _emit_mitigated(self, followup: _Followup) -> None:
        after = float(np.median(followup.step_times)) if followup.step_times else float("nan")
        measured = followup.baseline_step_s / after - 1.0 if after > 0 else None
        self.events.emit(
            EventKind.STRAGGLER_MITIGATED, **followup.fields,
            measured_gain=None if measured is None else round(measured, 4),
            baseline_step_s=round(followup.baseline_step_s, 5),
            measured_step_s=None if measured is None else round(after, 5),
            measured_steps=len(followup.step_times),
        )

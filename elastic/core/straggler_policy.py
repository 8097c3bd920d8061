"""Straggler mitigation: given the flagged ranks and per-group speeds, choose the cheapest
action that raises predicted throughput enough. Pure, deterministic, no Ray.

The step-time model: every live group runs each step in lockstep, so the step takes as long
as the slowest group,

    step(w) = max_g ( fixed_g + global_batch * w_g / sum(w) * s_g )

where ``s_g`` is the group's compute seconds per sample (its slowest rank's window median:
FSDP/TP collectives make a group as slow as its slowest member) and ``fixed_g`` its per-step
overhead that does not scale with samples (communication, launch, a padding micro-batch).
A group with zero weight still pays ``fixed_g``: it takes part in the step with padding.

Options, cheapest first (each only if it predicts at least ``min_gain`` over the current
weights, and a replacement or an eviction only if it also saves ``min_saving_s`` of each
step: steps of a few milliseconds are dominated by noise, and a heal costs seconds; the
best prediction wins, where predictions less than ``min_gain`` apart are a tie that goes to
the cheaper option):

1. ``rebalance``: water-filling weights that equalise ``fixed_g + share_g * s_g`` across
   groups (a group whose fixed cost alone is above the level gets no share). With no fixed
   costs this is ``w_g ∝ 1/s_g``. Free: the math is unchanged (see the data plan). The fit
   uses each flagged group's own speed and overhead but pools the unflagged groups at
   their median (so they keep equal weights): fitting the per-step noise of thousands of
   healthy groups would predict a >5 % "gain" from a fresh fit at almost every step and
   churn the data plan. Predictions always use every group's reported numbers.
2. ``replace`` (needs a spare slot): replace the flagged rank of the slowest flagged group,
   predicted as if that group then ran at the median speed (and median fixed cost) of the
   other groups, with equal weights. The prediction ignores the transient cost of the heal
   (the group sits out while the replacement starts and copies state from a live peer, a
   generation change for everybody); it is the steady-state step time afterwards. Needs at
   least one other group to estimate the healthy speed from.
3. ``evict-group``: drop the slowest flagged group (only if the remaining groups are still
   ``>= min_groups``) and water-fill the rest.

With nothing flagged, unequal weights are put back to equal (``restore``): the flag that
justified them is gone. (The rebalanced weights do not hide a slow rank from the detector,
which scores seconds *per sample*, so a still-slow group stays flagged and keeps its
weights; no flapping.)

The model is continuous: the data plan's integer apportionment and micro-batch rounding are
ignored, which matters only when a group's share is a few micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat

import numpy as np

ACTIONS = ("rebalance", "replace", "evict-group", "restore")
_COST_ORDER = {"rebalance": 0, "replace": 1, "evict-group": 2}
_TIE = 1e-9  # float slack on the comparisons
DEFAULT_MIN_SAVING_S = 0.05
_DISRUPTIVE = ("replace", "evict-group")  # they stop a process or a group; a rebalance is free


@dataclass(frozen=True)
class Mitigation:
    action: str  # "rebalance" | "replace" | "evict-group" | "restore"
    group: int  # the slow group acted on (-1 for "restore")
    rank: int | None  # the rank to replace ("replace" only)
    weights: dict[int, float]  # data-plan weights per live group after this decision
    baseline_step_s: float  # predicted step time with the current weights
    predicted_step_s: float  # predicted step time after the action

    @property
    def predicted_gain(self) -> float:
        return self.baseline_step_s / self.predicted_step_s - 1.0


def _step_seconds(weights: np.ndarray, seconds: np.ndarray, fixed: np.ndarray, global_batch: int) -> float:
    total = float(weights.sum())
    if not total > 0.0:
        raise ValueError("weights must have a positive sum")
    return float(np.max(fixed + global_batch * (weights / total) * seconds))


def predicted_step_seconds(
    weights: Mapping[int, float],
    group_seconds_per_sample: Mapping[int, float],
    group_fixed_seconds: Mapping[int, float],
    global_batch: int,
) -> float:
    """max over groups g of fixed_g + global_batch * w_g / sum(w) * s_g (missing fixed: 0)."""
    groups = sorted(weights)
    return _step_seconds(
        np.array([weights[g] for g in groups], dtype=float),
        np.array([group_seconds_per_sample[g] for g in groups], dtype=float),
        np.array([group_fixed_seconds.get(g, 0.0) for g in groups], dtype=float),
        global_batch,
    )


def water_fill(seconds: np.ndarray, fixed: np.ndarray, global_batch: int) -> tuple[np.ndarray, float]:
    """Shares (samples per group, summing to ``global_batch``) that equalise
    ``fixed_g + share_g * s_g`` at a level ``T``; groups with ``fixed_g >= T`` get 0.

    Active groups are a prefix in order of fixed cost: for the ``k`` cheapest,
    ``T_k = (B + sum f/s) / sum 1/s``, and the answer is the largest ``k`` with
    ``f_(k) < T_k``. Returns (shares, T); the step time is ``max(T, max f)``.
    """
    seconds = np.maximum(seconds, 1e-12)  # a group reported as free still gets a finite share
    order = np.argsort(fixed, kind="stable")
    f, s = fixed[order], seconds[order]
    level = (global_batch + np.cumsum(f / s)) / np.cumsum(1.0 / s)
    active = np.flatnonzero(f < level)
    k = int(active[-1]) + 1 if len(active) else 1
    level_k = float(level[k - 1])
    shares_sorted = np.zeros_like(s)
    shares_sorted[:k] = np.maximum(0.0, (level_k - f[:k]) / s[:k])
    shares = np.empty_like(shares_sorted)
    shares[order] = shares_sorted
    return shares, level_k


class StragglerPolicy:
    def __init__(self, min_gain: float = 0.05, min_saving_s: float = DEFAULT_MIN_SAVING_S,
                 slow_by_data: bool = False):
        """``slow_by_data``: a rank's work per sample depends on its data (expert parallelism:
        the rank holding a hot expert computes more rows), so a slow rank is not known to be
        slow by its device, and neither replacing it nor evicting its group is taken."""
        if min_gain < 0 or min_saving_s < 0:
            raise ValueError(f"min_gain and min_saving_s must be >= 0, got {min_gain} and {min_saving_s}")
        self.min_gain, self.min_saving_s, self.slow_by_data = min_gain, min_saving_s, slow_by_data

    def decide(
        self,
        *,
        slow_ranks: Mapping[int, int],
        group_seconds_per_sample: Mapping[int, float],
        group_fixed_seconds: Mapping[int, float],
        weights: Mapping[int, float],
        global_batch: int,
        spare_slots: int,
        min_groups: int,
        rank_scores: Mapping[int, float] | None = None,
    ) -> Mitigation | None:
        """One decision for the live groups in ``weights``, or None when nothing is worth
        doing. ``slow_ranks`` maps each flagged rank to its group (ranks of groups that are
        not live are ignored); ``rank_scores`` (optional, the detector's scores) picks the
        rank to replace within a group, else the lowest flagged rank."""
        groups = sorted(weights)
        n = len(groups)
        if not n:
            return None
        w = np.fromiter(map(weights.__getitem__, groups), dtype=float, count=n)
        try:
            s = np.fromiter(map(group_seconds_per_sample.__getitem__, groups), dtype=float, count=n)
        except KeyError:
            missing = [g for g in groups if g not in group_seconds_per_sample]
            raise ValueError(f"no seconds per sample for live groups {missing}") from None
        f = np.fromiter(map(group_fixed_seconds.get, groups, repeat(0.0)), dtype=float, count=n)
        if not (np.all(np.isfinite(s)) and np.all(s >= 0) and np.all(np.isfinite(f)) and np.all(f >= 0)):
            raise ValueError("group seconds per sample and fixed seconds must be finite and >= 0")
        baseline = _step_seconds(w, s, f, global_batch)
        equal = np.ones(n)

        slow = {rank: group for rank, group in slow_ranks.items() if group in weights}
        if not slow:
            if np.allclose(w, w.mean(), rtol=1e-9, atol=0.0):
                return None
            return Mitigation(
                "restore", -1, None, dict.fromkeys(groups, 1.0), baseline, _step_seconds(equal, s, f, global_batch)
            )

        group_array = np.asarray(groups)
        index = {g: int(np.searchsorted(group_array, g)) for g in set(slow.values())}
        slow_groups = sorted(index, key=lambda g: (-s[index[g]], g))
        worst = slow_groups[0]
        worst_i = index[worst]
        candidates: list[Mitigation] = []

        # The weights are fitted to a model where every unflagged group runs at the pooled
        # (median) speed and overhead of the unflagged groups: rebalancing moves work away
        # from the flagged groups only, instead of fitting the step-to-step noise of
        # thousands of healthy groups (which would re-trigger a rebalance every step).
        flagged_mask = np.zeros(n, dtype=bool)
        flagged_mask[list(index.values())] = True
        s_fit, f_fit = s.copy(), f.copy()
        if not flagged_mask.all():
            s_fit[~flagged_mask] = float(np.median(s[~flagged_mask]))
            f_fit[~flagged_mask] = float(np.median(f[~flagged_mask]))

        # (1) rebalance over all live groups.
        shares, _ = water_fill(s_fit, f_fit, global_batch)
        new_w = shares * (n / shares.sum())
        candidates.append(
            Mitigation(
                "rebalance", worst, None, dict(zip(groups, new_w.tolist())), baseline,
                _step_seconds(new_w, s, f, global_batch),
            )
        )

        # (2) replace the flagged rank of the slowest flagged group.
        if spare_slots >= 1 and n >= 2:
            others = np.arange(n) != worst_i
            s2, f2 = s.copy(), f.copy()
            s2[worst_i] = float(np.median(s[others]))
            f2[worst_i] = float(np.median(f[others]))
            in_group = sorted(r for r, g in slow.items() if g == worst)
            if rank_scores:
                rank = max(in_group, key=lambda r: (rank_scores.get(r, -math.inf), -r))
            else:
                rank = in_group[0]
            candidates.append(
                Mitigation(
                    "replace", worst, rank, dict.fromkeys(groups, 1.0), baseline,
                    _step_seconds(equal, s2, f2, global_batch),
                )
            )

        # (3) evict the slowest flagged group, water-fill the rest.
        if n - 1 >= max(min_groups, 1):
            keep = np.arange(n) != worst_i
            shares, _ = water_fill(s_fit[keep], f_fit[keep], global_batch)
            kept_w = shares * ((n - 1) / shares.sum())
            kept_groups = [g for g in groups if g != worst]
            candidates.append(
                Mitigation(
                    "evict-group", worst, None, dict(zip(kept_groups, kept_w.tolist())), baseline,
                    _step_seconds(kept_w, s[keep], f[keep], global_batch),
                )
            )

        worth = [c for c in candidates if c.predicted_step_s * (1.0 + self.min_gain) <= baseline * (1.0 + _TIE)
                 and (c.action not in _DISRUPTIVE
                      or not self.slow_by_data and baseline - c.predicted_step_s >= self.min_saving_s - _TIE)]
        if not worth:
            return None
        # The best prediction wins, but anything within min_gain of it is a tie that goes to
        # the cheapest option: a heal or a lost group is not worth a fraction of a percent.
        best = min(c.predicted_step_s for c in worth)
        tied = [c for c in worth if c.predicted_step_s <= best * (1.0 + self.min_gain) * (1.0 + _TIE)]
        return min(tied, key=lambda c: _COST_ORDER[c.action])

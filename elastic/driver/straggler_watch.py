"""The driver's side of straggler mitigation: each committed step's per-rank times fed to the
detector and its policy (``elastic.core.straggler_mitigation``), and the actions it decides
held until the next boundary applies them (``GroupKeeper.apply_straggler_actions``)."""

from __future__ import annotations

from collections.abc import Callable

from elastic.core.events import EventLog
from elastic.core.straggler_mitigation import NO_ACTIONS, StragglerActions, StragglerMitigation
from elastic.core.topology import Topology
from elastic.driver.records import RankArrays
from elastic.setup.config import TrainConfig


class StragglerWatch:
    """Off when ``stragglers.enabled`` is false: no scores, no weights, no actions."""

    def __init__(self, config: TrainConfig, topology: Topology, events: EventLog, clock: Callable[[], float]):
        self.topology = topology
        self.min_groups = config.scaling.min_groups
        self.mitigation = (
            # with the experts split over ranks, a rank holding a hot expert is slow by its data
            StragglerMitigation(config.stragglers, config.global_batch, events, clock,
                                slow_by_data=topology.expert_parallel)
            if config.stragglers.enabled else None
        )
        self.pending = NO_ACTIONS  # decided at a commit, applied at the next boundary

    @property
    def weights(self) -> dict[int, float]:
        """The groups' data weights the rebalance chose (none: equal)."""
        return self.mitigation.weights if self.mitigation is not None else {}

    def on_commit(self, step: int, ranks: RankArrays, has_spare_slot: bool) -> dict | None:
        """Feed a committed step's per-rank times; the ranks' straggler scores, or None when off.
        Actions it decides wait for the boundary: the run goes on until the pause."""
        if self.mitigation is None:
            return None
        times = ranks.times
        actions = self.mitigation.on_step_arrays(
            step, ranks.ranks, ranks.ranks // self.topology.ranks_per_group, samples=ranks.samples,
            compute_s=times.compute_s, fixed_s=times.data_s, step_s=float(times.wall_s.max()),
            spare_slot=has_spare_slot, min_groups=self.min_groups,
        )
        if actions != NO_ACTIONS:
            self.pending = actions
        return self.mitigation.scores(4)

    def ready(self, uploading_ranks: frozenset[int] | None) -> bool:
        """Actions are due, and stop no rank a checkpoint still uploads from
        (``uploading_ranks``; None: no upload): a slow rank costs a fraction of a step, a broken
        save a whole checkpoint interval. They wait for the upload to end."""
        if self.pending == NO_ACTIONS:
            return False
        if uploading_ranks is None:
            return True
        stopped = set(self.pending.replace) | {rank for group in self.pending.evict_groups
                                               for rank in self.topology.global_ranks(group)}
        return not stopped & uploading_ranks

    def take(self) -> StragglerActions:
        actions, self.pending = self.pending, NO_ACTIONS
        return actions

    def close(self) -> None:
        """Report the decisions still being measured."""
        if self.mitigation is not None:
            self.mitigation.close()

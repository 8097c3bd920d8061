"""What the driver's collaborators share during a leg of a run, handed to each as one value
instead of one argument apiece."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from elastic.core.events import EventLog
from elastic.core.membership import Membership
from elastic.core.topology import Topology
from elastic.driver.history import RunHistory
from elastic.driver.recovery_timing import RecoveryTiming
from elastic.fleet.api import FleetApi
from elastic.setup.config import TrainConfig


@dataclass(frozen=True)
class RunContext:
    config: TrainConfig
    fleet: FleetApi
    membership: Membership  # the live groups and each group's stage
    history: RunHistory  # what the run committed
    timing: RecoveryTiming  # the recovery in progress, if any
    events: EventLog
    clock: Callable[[], float]

    @property
    def topology(self) -> Topology:
        return self.fleet.topology

    @property
    def between_rounds(self) -> bool:
        """Whether the run stands between DiLoCo's rounds (``elastic.core.outer_rounds``), where
        every learner holds the run's state: always, when every step sums the gradients."""
        rounds = self.config.sync.outer_rounds
        return rounds is None or rounds.at_boundary(self.history.step)

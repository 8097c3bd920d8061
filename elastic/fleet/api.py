"""The fleet as the controller sees it: the calls it makes to ranks and the two errors they
raise, in plain data. No Ray here: ``elastic.fleet.ray_fleet.Fleet`` implements it with Ray, and
``tests/fake_fleet.py`` on a fake clock.

Failures come back as two exceptions, each naming its ranks: ``RanksLost`` (the processes
are gone) and ``CallFailed`` (a rank raised, or did not answer before the call's deadline).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from elastic.core.memory_tier import Holdings, MemoryRestore
from elastic.core.protocol import EvalRequest, RankActivity, RankOutcome, SegmentMessage, SegmentSpec
from elastic.core.spares import Spare
from elastic.core.topology import Topology


class FleetError(RuntimeError):
    def __init__(self, ranks: list[int], message: str, call: str = ""):
        super().__init__(message)
        self.ranks = sorted(ranks)
        self.call = call  # the rank method that failed


class RanksLost(FleetError):
    """The processes of these ranks are gone (killed, crashed, out of memory, node lost)."""


class CallFailed(FleetError):
    """These ranks raised, or did not answer in time; their processes may live.
    ``own_errors``: the ranks whose own code raised, with its one line: their hooks
    (``HookFailed``), or the rank's code as their processes started;
    ``unloadable``: the ranks a checkpoint did not load into (``CheckpointUnloadable``)."""

    def __init__(self, ranks: list[int], message: str, call: str = "", own_errors: dict[int, str] | None = None,
                 unloadable: dict[int, str] | None = None):
        super().__init__(ranks, message, call)
        self.own_errors = dict(own_errors or {})
        self.unloadable = dict(unloadable or {})


@dataclass
class Pending:
    """Calls in flight, one per rank (a Ray ``ObjectRef`` each, or a fake's stand-in)."""

    refs: dict[int, object]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.refs)


@dataclass(frozen=True)
class HealCopy:
    """How one rank's committed state reached the rank it heals: rank to rank, or, when that
    failed on either side (``fallback`` says how), through the object store."""

    source: int
    target: int
    bytes: int
    fallback: str | None = None

    @property
    def rank_to_rank_bytes(self) -> int:
        return 0 if self.fallback else self.bytes

    @property
    def object_store_bytes(self) -> int:
        return self.bytes if self.fallback else 0


@dataclass
class SegmentStream:
    """A segment in flight: each rank's stream of messages, until its ``SegmentEnd``."""

    attempt: int
    generators: dict[int, object]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.generators)


class FleetApi(Protocol):
    topology: Topology

    # placement
    def reserve(self, group: int) -> None: ...
    def placed(self, group: int) -> bool: ...
    def has_spare_slot(self) -> bool: ...
    def release(self, group: int) -> None: ...

    # rank processes and warm spares
    def start(self, ranks, spares: dict[int, int] | None = None) -> Pending: ...
    def reserve_spares(self) -> None: ...
    def start_spares(self, count: int) -> list[int]: ...
    def spares(self) -> list[Spare]: ...
    def build(self, ranks, world_build: int) -> Pending: ...
    def alive(self, rank: int, timeout: float = 5.0) -> bool: ...
    def responsive(self, ranks, timeout: float = 5.0) -> set[int]: ...
    def kill(self, global_rank: int) -> None: ...
    def kill_group(self, group: int) -> None: ...
    def done(self, pending: Pending, timeout: float = 0.0) -> bool: ...
    def answered(self, pending: Pending) -> int: ...
    def results(self, pending: Pending, timeout: float | None = None, call: str = "") -> dict[int, object]: ...

    # runs and evaluations
    def start_segment(self, specs: dict[int, SegmentSpec]) -> SegmentStream: ...
    def next_messages(self, stream: SegmentStream, timeout: float,
                      ranks: Iterable[int] | None = None) -> list[tuple[int, SegmentMessage | None]]: ...
    def request_pause(self, ranks, attempt: int) -> None: ...
    def evaluate(self, requests: dict[int, EvalRequest]) -> Pending: ...
    def next_outcomes(self, pending: Pending, timeout: float) -> list[tuple[int, RankOutcome | None]]: ...
    # the attempt is over for the driver: ranks still in it stop (at a failure, the abort)
    def end_attempt(self, attempt: int) -> None: ...
    def release_step(self, ranks, attempt: int) -> None: ...
    def probe(self, ranks, timeout: float) -> dict[int, RankActivity]: ...

    # state and checkpoints
    def copy_state(self, pairs: list[tuple[int, int]]) -> list[HealCopy]: ...
    def local_parameters(self, ranks) -> dict[int, list]: ...
    def set_buddies(self, buddies: dict[int, int | None]) -> None: ...
    def memory_holdings(self, ranks) -> dict[int, Holdings]: ...
    def restore_memory(self, plan: MemoryRestore) -> None: ...
    def save(self, ranks, url: str) -> None: ...
    def finish_saves(self, ranks) -> Pending: ...
    def abandon_saves(self, ranks) -> None: ...
    def restore(self, ranks, url: str, step: int, generators: dict) -> None: ...
    def shutdown(self) -> None: ...

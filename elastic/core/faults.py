"""Fault injection: parsed from ``--inject`` or config, scheduled by the driver, carried out
inside the workers.

Injection decorates the production path and never branches inside it: a segment pauses before
the step of every step-triggered fault (and at the first boundary once a time-triggered one
is due), the driver's ``FaultSchedule`` turns the segment specs of the ranks a due fault names
into ``InjectedSegmentSpec``s, and ``workers.fault_injection`` fires them as the segment's first
step starts. Runs without ``--inject`` (or straggler noise) use neither.

Syntax: ``;``-separated faults, each ``kind:key=value,...``. Kinds are ``kill``,
``kill-group``, ``hang``, ``slow`` (work added after the rank's compute), ``slow-device``
(work added inside each of its blocks' forward, as a slow device would: its group's peers
wait for it inside their collectives), ``fail-collective``, ``flip`` (one bit of one
parameter, silently: the integrity check's to find), ``compute`` (the rank's device computes
wrong from then on: what it hands the cross-group gradient sum has one bit flipped, or with
``relative=E`` every value off by that relative error; every ``every`` steps, default each; its
state untouched: the replay's to find) and ``slow-link`` (a group's link to the
other groups carries ``rate`` bytes a second from then on: ``bench/semi_sync.py`` throttles the
cross-group transport with it); keys are ``rank`` or ``group``
(global numbering at the start of the run; ``random`` picks one from the seed), ``step``
or ``at`` (seconds since training started), ``factor`` (for the slowdowns), ``rate`` (for
``slow-link``), ``after``
(for ``kill`` and ``kill-group``: seconds into the step, so the rank dies mid-step while
its peers compute; a step shorter than that waits for the death before its sum, so the
death lands in the step named) and ``during=outer-step`` (for ``kill`` under DiLoCo: the
rank dies inside the first outer step at or after its step, once its first collective there
is sent). A fault fires once, on the first step at or after its trigger, in the
rank(s) it names.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

from elastic.core.events import EventKind, EventLog
from elastic.core.topology import Topology
from elastic.core.protocol import SegmentSpec

KINDS = ("kill", "kill-group", "hang", "slow", "slow-device", "fail-collective", "flip", "compute", "slow-link")
_TARGET = {"kill": "rank", "kill-group": "group", "hang": "rank", "slow": "rank", "slow-device": "rank",
           "fail-collective": "rank", "flip": "rank", "compute": "rank", "slow-link": "group"}


OUTER_STEP = "outer-step"


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    group: int | None = None
    step: int | None = None
    at: float | None = None
    factor: float = 1.0
    after: float = 0.0
    rate: float = 0.0  # slow-link's bytes a second
    during: str = ""  # "outer-step": a kill inside DiLoCo's outer step
    every: int = 1  # compute's: it computes wrong every this many steps
    relative: float = 0.0  # compute's relative error (0: a flipped bit)
    random_target: bool = False

    def targets(self, rank: int, group: int) -> bool:
        return self.rank == rank if _TARGET[self.kind] == "rank" else self.group == group

    def due(self, step: int, elapsed_s: float) -> bool:
        if self.step is not None:
            return step >= self.step
        return elapsed_s >= (self.at or 0.0)


def _parse_one(text: str) -> Fault:
    kind, _, body = text.strip().partition(":")
    if kind not in KINDS:
        raise FaultSpecError(f"fault_tolerance.inject: unknown kind {kind!r} in {text!r}; use one of {KINDS}")
    fields: dict = {"kind": kind}
    for pair in filter(None, (p.strip() for p in body.split(","))):
        key, sep, value = pair.partition("=")
        if not sep:
            raise FaultSpecError(f"fault_tolerance.inject: {pair!r} in {text!r} is not key=value")
        try:
            if key in ("rank", "group"):
                if value == "random":
                    fields["random_target"] = True
                    fields[key] = -1
                else:
                    fields[key] = int(value)
            elif key in ("step", "every"):
                fields[key] = int(value)
            elif key == "during":
                if value != OUTER_STEP:
                    raise FaultSpecError(f"fault_tolerance.inject: during={value!r} in {text!r}; use during={OUTER_STEP}")
                fields["during"] = value
            elif key in ("at", "factor", "after", "rate", "relative"):
                number = float(value)
                if not math.isfinite(number):
                    raise FaultSpecError(
                        f"fault_tolerance.inject: {key}={value!r} in {text!r} is not a finite number; "
                        f"give {'a factor > 1' if key == 'factor' else 'a number of seconds'}"
                    )
                fields[key] = number
            else:
                raise FaultSpecError(
                    f"fault_tolerance.inject: unknown key {key!r} in {text!r}; use rank, group, step, at, factor, "
                    "rate, after, during, every or relative"
                )
        except ValueError as error:
            if isinstance(error, FaultSpecError):
                raise
            raise FaultSpecError(f"fault_tolerance.inject: {key}={value!r} in {text!r} is not a number") from None
    target = _TARGET[kind]
    if target not in fields:
        raise FaultSpecError(f"fault_tolerance.inject: {text!r} needs {target}=N")
    if ("step" in fields) == ("at" in fields):
        raise FaultSpecError(f"fault_tolerance.inject: {text!r} needs exactly one of step=N or at=SECONDS")
    if kind in ("slow", "slow-device") and fields.get("factor", 1.0) <= 1.0:
        raise FaultSpecError(f"fault_tolerance.inject: {text!r} needs factor > 1")
    if (kind == "slow-link") != ("rate" in fields) or fields.get("rate", 1.0) <= 0:
        raise FaultSpecError(f"fault_tolerance.inject: {text!r}: rate=BYTES_PER_S > 0 applies to slow-link, and "
                             "slow-link needs it")
    if "after" in fields and (kind not in ("kill", "kill-group") or not 0 < fields["after"] < 3600):
        raise FaultSpecError(f"fault_tolerance.inject: {text!r}: after=SECONDS (0 to 3600) applies to kill and kill-group")
    if ("every" in fields or "relative" in fields) and (
            kind != "compute" or fields.get("every", 1) < 1 or not 0 <= fields.get("relative", 0.0) < 1):
        raise FaultSpecError(f"fault_tolerance.inject: {text!r}: every=STEPS (1 or more) and relative=ERROR (0 to 1) "
                             "apply to compute")
    if "during" in fields and (kind != "kill" or "after" in fields):
        raise FaultSpecError(f"fault_tolerance.inject: {text!r}: during={OUTER_STEP} applies to kill, without after")
    return Fault(**fields)


def parse_faults(spec: str) -> list[Fault]:
    return [_parse_one(part) for part in spec.split(";") if part.strip()]


def resolve_random_targets(faults: list[Fault], seed: int, n_groups: int, ranks_per_group: int) -> list[Fault]:
    rng = random.Random(f"faults:{seed}")
    resolved = []
    for fault in faults:
        if fault.random_target:
            if _TARGET[fault.kind] == "rank":
                fault = replace(fault, rank=rng.randrange(n_groups * ranks_per_group))
            else:
                fault = replace(fault, group=rng.randrange(n_groups))
        resolved.append(fault)
    return resolved


def check_targets(faults: list[Fault], n_groups: int, ranks_per_group: int) -> None:
    n_ranks = n_groups * ranks_per_group
    for fault in faults:
        if fault.rank is not None and not fault.random_target and not 0 <= fault.rank < n_ranks:
            raise FaultSpecError(
                f"fault_tolerance.inject: rank={fault.rank} is outside the run's {n_ranks} ranks "
                f"(scaling.max_groups x shard x tp); name a rank from 0 to {n_ranks - 1}"
            )
        if fault.group is not None and not fault.random_target and not 0 <= fault.group < n_groups:
            raise FaultSpecError(
                f"fault_tolerance.inject: group={fault.group} is outside the run's {n_groups} groups "
                f"(scaling.max_groups); name a group from 0 to {n_groups - 1}"
            )


@dataclass(frozen=True)
class InjectedFault:
    """A fault one rank carries out as its segment's first step starts."""

    kind: str
    factor: float = 1.0
    after_s: float = 0.0
    rate: float = 0.0
    during: str = ""
    every: int = 1
    relative: float = 0.0


@dataclass(frozen=True)
class InjectedSegmentSpec(SegmentSpec):
    faults: tuple[InjectedFault, ...] = ()
    noise: float = 0.0  # straggler noise: a slowdown of up to 2 x noise of compute, at random


class FaultSchedule:
    """The driver's side: fires each fault once, on the first step at or after its trigger,
    by decorating the segment specs of the ranks it names; segments pause before a fault's step."""

    def __init__(self, faults: list[Fault], topology: Topology, events: EventLog, clock: Callable[[], float],
                 noise: float = 0.0):
        self.faults = list(faults)
        self.topology = topology
        self.events = events
        self.clock = clock
        self.noise = noise
        self.training_started_at: float | None = None

    def _elapsed(self) -> float:
        if self.training_started_at is None:
            self.training_started_at = self.clock()
        return self.clock() - self.training_started_at

    def next_step_after(self, step: int) -> int | None:
        """The first step after ``step`` at which a step-triggered fault fires: a segment stops before it."""
        return min((fault.step for fault in self.faults if fault.step is not None and fault.step > step), default=None)

    def time_fault_due(self) -> bool:
        """A time-triggered fault is due: the segment in progress should pause so the next one fires it."""
        return any(fault.at is not None and fault.due(0, self._elapsed()) for fault in self.faults)

    def decorate(self, step: int, requests: dict[int, SegmentSpec]) -> dict[int, SegmentSpec]:
        elapsed = self._elapsed()
        firing: dict[int, list[InjectedFault]] = {}
        for fault in list(self.faults):
            if not fault.due(step, elapsed):
                continue
            targets = sorted(r for r in requests if fault.targets(r, self.topology.group_of(r)))
            if not targets:
                continue
            self.faults.remove(fault)
            self.events.emit(EventKind.FAULT_INJECTED, fault=fault.kind, ranks=targets, step=step)
            for rank in targets:
                firing.setdefault(rank, []).append(InjectedFault(fault.kind, fault.factor, fault.after, fault.rate,
                                                                 fault.during, fault.every, fault.relative))
        return {
            rank: InjectedSegmentSpec(**vars(request), faults=tuple(firing.get(rank, ())), noise=self.noise)
            for rank, request in requests.items()
        }

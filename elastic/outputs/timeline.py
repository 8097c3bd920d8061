"""What a run's timeline shows, read from its ``RunSummary``: every leg's committed steps and
events on one clock, where each leg began and how it ended, the live ranks and groups over
the run, and each expert layer's load. ``timeline_figure`` draws it; this module is plain data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from elastic.core.events import EventKind as K
from elastic.core.exits import Ending, Exit
from elastic.core.goodput import CATEGORIES, goodput_of
from elastic.outputs.summary import RunSummary, StepEntry


@dataclass(frozen=True)
class TimelineStep:
    """A committed step as the timeline draws it: what its entry lacks (a summary cut short,
    an older one) is None."""

    t: float  # when it was committed, on the whole run's clock
    step: int | None
    leg: int  # of the run (1 unless resumed)
    step_s: float | None
    loss: float | None
    rank_step_s: dict[int, float]  # each rank's wall seconds
    expert_load: dict[int, float]  # each expert layer's most loaded expert's tokens over the mean; {} if dense

    @classmethod
    def of_entry(cls, entry: StepEntry, leg: int = 1, offset: float = 0.0) -> TimelineStep:
        return cls(t=entry.t + offset, step=entry.step, leg=leg, step_s=entry.step_s, loss=entry.loss,
                   rank_step_s={rank: seconds for rank, seconds in entry.rank_step_s.items() if seconds is not None},
                   expert_load=dict(entry.expert_load))

    @property
    def started(self) -> float:
        return self.t - (self.step_s or 0.0)


def goodput_breakdown(summary: RunSummary) -> dict[str, float]:
    """Seconds per time category (committed, recovery, discarded, checkpoint_stall, startup,
    idle) plus ``wall_s``, from the summary's time_breakdown; the parts must add up to wall_s."""
    tb = summary.time_breakdown
    wall = tb.get("wall_s", summary.wall_s)
    if wall is None:
        raise ValueError("summary has no wall time (time_breakdown.wall_s / wall_s)")
    parts = {name: float(tb.get(name) or 0.0) for name in CATEGORIES if name != "idle"}
    tol = 1e-6 * max(abs(wall), 1e-9)
    if tb.get("idle") is None:
        idle = wall - sum(parts.values())
        if idle < -tol:
            raise ValueError(
                f"time breakdown overcharged: parts add up to {sum(parts.values()):.6f}s "
                f"but wall_s is {wall:.6f}s"
            )
        parts["idle"] = max(0.0, idle)
    else:
        parts["idle"] = float(tb["idle"])
    negative = [name for name, seconds in parts.items() if seconds < -tol]
    if negative:
        raise ValueError(f"time breakdown has negative parts: {negative}")
    total = sum(parts.values())
    if not math.isclose(total, wall, rel_tol=1e-6, abs_tol=1e-9):
        raise ValueError(
            f"time breakdown does not add up: parts sum to {total:.6f}s but wall_s is {wall:.6f}s"
        )
    breakdown = {name: parts[name] for name in CATEGORIES}
    breakdown["wall_s"] = wall
    return breakdown


@dataclass(frozen=True)
class Timeline:
    """Every leg of a run as one, on one clock: a leg's times run on after the legs before it."""

    run: str
    steps: list[TimelineStep]  # leg by leg, each leg's in the order it committed them
    events: list[dict[str, Any]]  # each with its time on the run's clock
    breakdown: dict[str, float] | None  # the whole run's; None where it does not add up
    wall: float
    goodput: float
    startups: list[tuple[float, float]]  # each leg's start-up: from, to
    legs: list[tuple[float, str | None]]  # where each leg began and how it ended; [] for a run of one leg
    ranks: int | None  # the topology's ranks, at the last leg's end
    steps_committed: int
    steps_discarded: int
    exit: str | None


def over_every_leg(summary: RunSummary) -> RunSummary:
    """The summary with the whole run's time breakdown, wall time and goodput: its own for a
    run of one leg."""
    total = summary.run_total
    if total is None or not summary.earlier_legs:
        return summary
    return summary.model_copy(update={"time_breakdown": total.time_breakdown, "wall_s": total.wall_s,
                                      "goodput": total.goodput})


def whole_run(summary: RunSummary) -> Timeline:
    """The timeline of every leg of the run (``elastic.outputs.run_record``): each leg's steps
    and events in order, the time breakdown and goodput over the legs, where each leg began
    and how it ended."""
    legs = [*summary.earlier_legs, summary]
    steps: list[TimelineStep] = []
    events: list[dict[str, Any]] = []
    starts: list[float] = []
    offset = 0.0
    for number, leg in enumerate(legs, start=1):
        starts.append(offset)
        steps += [TimelineStep.of_entry(entry, number, offset) for entry in leg.steps]
        events += [{**event, "t": event["t"] + offset, "leg": number} for event in leg.events
                   if event.get("t") is not None]
        offset += float(leg.time_breakdown.get("wall_s") or leg.wall_s or 0.0)
    total = summary.run_total if len(legs) > 1 else None
    whole = over_every_leg(summary)
    try:
        breakdown: dict[str, float] | None = goodput_breakdown(whole)
    except ValueError:
        breakdown = None
    wall = float((breakdown or {}).get("wall_s") or whole.wall_s
                 or max([0.0] + [step.t for step in steps] + [float(e["t"]) for e in events]))
    if total is not None:
        startups = [(start, start + float(leg.time_breakdown.get("startup") or 0.0)) for start, leg in zip(starts, legs)]
    elif breakdown and breakdown.get("startup"):
        startups = [(0.0, float(breakdown["startup"]))]
    else:  # until the first committed step began (a rollback to step 0 drops the earlier steps' records)
        startups = [(0.0, max(0.0, min(step.started for step in steps)) if steps else wall)]
    return Timeline(
        run=summary.run or "run", steps=steps, events=events, breakdown=breakdown, wall=wall,
        goodput=goodput_of(breakdown) if breakdown else whole.goodput, startups=startups,
        legs=[] if total is None else list(zip(starts, map(leg_ending, legs))),
        ranks=summary.topology.ranks or None,
        steps_committed=total.steps_committed if total else summary.steps_committed or len(steps),
        steps_discarded=total.steps_discarded if total else summary.steps_discarded, exit=summary.exit,
    )


def leg_ending(leg: RunSummary) -> str | None:
    """How a leg of a run ended, in a few words: the head of its exit (``completed``,
    ``failed``, ``stopped``), with the signal that preempted it: ``preempted (SIGINT)``.
    None for a leg that recorded no exit."""
    if not leg.exit:
        return None
    try:
        ended = Exit.parse(leg.exit)
    except ValueError:  # a line of another version's: its head, as it is
        return leg.exit.split(":", 1)[0]
    signal = next((event.get("signal") for event in leg.events if event.get("kind") == K.STOP_REQUESTED), None)
    ending = f"{ended.ending} ({signal})" if signal and ended.ending == Ending.PREEMPTED else str(ended.ending)
    if ended.final_checkpoint_missed_at is not None:
        ending += f", final checkpoint missed (step {ended.final_checkpoint_missed_at})"
    return ending


def expert_load_series(steps: Iterable[TimelineStep]) -> dict[int, tuple[list[int], list[float]]]:
    """Each expert layer's load balance against the step: layer -> (steps, loads), in step
    order; empty for a dense model. A step done twice (a resumed leg goes back to its
    checkpoint's step) counts as done last: the run went on from that one."""
    load_at: dict[int, dict[int, float]] = {}  # layer -> step -> load
    for step in sorted(steps, key=lambda step: step.t):
        if step.step is not None:
            for layer, load in step.expert_load.items():
                load_at.setdefault(layer, {})[step.step] = load
    return {layer: (sorted(loads), [loads[number] for number in sorted(loads)])
            for layer, loads in sorted(load_at.items())}


@dataclass(frozen=True)
class RankDown:
    """A rank lost (failed or evicted) and when it was back: when its group joined the quorum
    again with it replaced, or when its leg ended."""

    rank: int
    since: float
    until: float


@dataclass
class LiveMembership:
    """The live ranks and the groups in the quorum after each change (post-style steps over
    the run, from 0 to its wall time), and the ranks lost on the way."""

    t: list[float]
    ranks: list[int]
    groups: list[int]
    downs: list[RankDown]

    def record(self, t: float, ranks: int, groups: int) -> None:
        """The state after a change at ``t`` (none where nothing changed)."""
        if (ranks, groups) == (self.ranks[-1], self.groups[-1]):
            return
        if t == self.t[-1]:  # several changes at one instant: the state after them
            self.ranks[-1], self.groups[-1] = ranks, groups
            return
        self.t.append(t)
        self.ranks.append(ranks)
        self.groups.append(groups)


def live_membership(events: list[dict[str, Any]], leg_starts: Sequence[float], wall: float) -> LiveMembership:
    """Live ranks and groups in the quorum over the run, from its membership events.

    A group's ranks go live when it joins the quorum (``groups-rebuilt`` names the quorum's
    groups and counts their ranks) and stay live until one fails or is evicted, through a
    rollback too: a group builds again around its live processes. The quorum loses a group
    when it loses a rank, when its world breaks (a discarded step's broken groups) and when it
    is evicted. Every leg starts with none live: its driver starts every rank anew."""
    live: dict[int, set[int]] = {}  # group -> its live ranks
    quorum: set[int] = set()
    lost_at: dict[int, float] = {}  # rank -> when it was lost, until it is back
    membership = LiveMembership([0.0], [0], [0], [])

    def back(ranks: Iterable[int], t: float) -> None:
        """Those of ``ranks`` that were lost are back (or gone with their leg) at ``t``."""
        for rank in ranks:
            if rank in lost_at:
                membership.downs.append(RankDown(rank, lost_at.pop(rank), t))

    leg_boundaries = [(float(start), None) for start in leg_starts]
    changes = sorted([*leg_boundaries, *((float(e["t"]), e) for e in events)], key=lambda change: change[0])
    for t, event in changes:
        kind = None if event is None else event.get("kind")
        if event is None:  # a leg begins
            back(list(lost_at), t)
            live.clear()
            quorum.clear()
        elif kind == K.GROUPS_REBUILT:
            quorum = set(event["groups"])
            # a summary written before the event counted ranks shows none live
            per_group = event.get("ranks", 0) // len(quorum) if quorum else 0
            for group in quorum:
                live[group] = set(range(group * per_group, (group + 1) * per_group))
                back(live[group], t)
        elif kind in (K.RANK_FAILED, K.RANK_EVICTED):
            rank, group = int(event["rank"]), int(event["group"])
            if rank in live.get(group, ()):
                live[group].discard(rank)
                lost_at[rank] = t
            quorum.discard(group)
        elif kind == K.GROUP_EVICTED:
            live.pop(event["group"], None)
            quorum.discard(event["group"])
        elif kind in (K.STEP_DISCARDED, K.EVAL_DISCARDED):
            quorum.difference_update(event.get("broken_groups") or ())
        else:
            continue
        membership.record(t, sum(map(len, live.values())), len(quorum))
    back(list(lost_at), wall)
    membership.t.append(max(wall, membership.t[-1]))  # the last state holds to the end of the run
    membership.ranks.append(membership.ranks[-1])
    membership.groups.append(membership.groups[-1])
    return membership

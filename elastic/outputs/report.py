"""Post-run report: goodput breakdown table and a timeline PNG from a run's ``summary.json``.

``report(run)`` reads ``<storage>/<run-name>/summary.json`` (a local path or any fsspec URL),
checks that the time breakdown adds up to the wall time, and draws a timeline of per-rank step
times, loss and live ranks with the run's failures, recoveries, straggler decisions and
checkpoints marked on it. ``main`` is the ``elastic report RUN [--output PNG]`` command.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import re
import statistics
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec

from elastic.core.events import EventKind as K, redact_credentials
from elastic.core.exits import Ending, Exit
from elastic.core.goodput import CATEGORIES, goodput_of
from elastic.outputs.run_record import SUMMARY_NAME

DEFAULT_PNG_NAME = "timeline.png"


# Above this many ranks the per-rank step times are drawn as a ranks x steps heatmap.
MAX_RANK_LINES = 16
# Above this many, the ranks' lines become a band and its median, the slow ranks named.
MAX_RANKS_APART = 4
# A rank whose median step is this much over the ranks' median stands out of the band.
OUTLIER_FACTOR = 1.15

FAILURE_COLOUR = "#d62728"
# Not the blue of the ranks' median line, nor any colour of the rank lines' palettes.
CHECKPOINT_COLOUR = "#b5179e"
# Event category -> (label, colour, line style, event kinds).
EVENT_CATEGORIES: dict[str, tuple[str, str, str, tuple[str, ...]]] = {
    "failure": ("rank failed / evicted (its row, while down)", FAILURE_COLOUR, "-", (K.RANK_FAILED, K.RANK_EVICTED)),
    "recovery": ("recovery (recovered / group-joined / group-healed)", "#2ca02c", "--",
                 (K.RECOVERED, K.GROUP_JOINED, K.GROUP_HEALED)),
    "straggler": ("straggler (detected / mitigated)", "#ff7f0e", ":",
                  (K.STRAGGLER_DETECTED, K.STRAGGLER_MITIGATED)),
    "checkpoint": ("checkpoint committed", CHECKPOINT_COLOUR, "-", (K.CHECKPOINT_COMMITTED,)),
    "checkpoint-failed": ("checkpoint failed", "#9467bd", "-.", (K.CHECKPOINT_FAILED,)),
    "discarded": ("step discarded", "#7f7f7f", ":", (K.STEP_DISCARDED,)),
}
# Goodput categories -> colour, for the wall-time bar.
BREAKDOWN_COLOURS = {"committed": "#2ca02c", "evaluation": "#bcbd22", "recovery": "#d62728", "discarded": "#7f7f7f",
                     "checkpoint_stall": CHECKPOINT_COLOUR, "startup": "#bbbbbb", "idle": "#e7e7e7"}
_CATEGORY_OF_KIND = {kind.value: cat for cat, (_, _, _, kinds) in EVENT_CATEGORIES.items() for kind in kinds}


# --------------------------------------------------------------------------------------- loading


def _summary_path(run: str) -> str:
    """The summary.json path/URL for a run directory, a run URL, or the summary file itself."""
    run = os.fspath(run)
    if run.endswith(".json"):
        return run
    return run.rstrip("/") + "/" + SUMMARY_NAME


def _is_local(path: str) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    fs, _ = fsspec.core.url_to_fs(path)
    return isinstance(fs, LocalFileSystem)


def _local_path(path: str) -> str:
    fs, stripped = fsspec.core.url_to_fs(path)
    return stripped


def load_summary(run: str) -> dict[str, Any]:
    """Load a run's summary.json. ``run`` is a run directory or URL, or the summary.json itself."""
    import json

    path = _summary_path(run)
    try:
        with fsspec.open(path, "r", encoding="utf-8") as handle:
            summary = json.load(handle)
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"no run summary found at {path!r} (looked for {SUMMARY_NAME} of run {run!r}); "
            "pass a run directory, a storage URL of one, or the summary.json path"
        ) from err
    except IsADirectoryError as err:
        raise FileNotFoundError(f"{path!r} is a directory, not a run summary") from err
    if not isinstance(summary, dict):
        raise ValueError(f"{path!r} does not hold a run summary (a JSON object)")
    return summary


# ------------------------------------------------------------------------------------- breakdown


def goodput_breakdown(summary: dict[str, Any]) -> dict[str, float]:
    """Seconds per time category (committed, recovery, discarded, checkpoint_stall, startup,
    idle) plus ``wall_s``, from the summary's time_breakdown; the parts must add up to wall_s."""
    tb = dict(summary.get("time_breakdown") or {})
    wall = tb.get("wall_s", summary.get("wall_s"))
    if wall is None:
        raise ValueError("summary has no wall time (time_breakdown.wall_s / wall_s)")
    wall = float(wall)
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


def format_breakdown(breakdown: dict[str, float]) -> str:
    """An aligned text table: category, seconds, percent of wall, a total line, and goodput."""
    wall = breakdown["wall_s"]
    names = [name for name in breakdown if name != "wall_s"]
    width = max(len("category"), len("total (wall)"), *(len(n) for n in names))

    def pct(seconds: float) -> str:
        return f"{100.0 * seconds / wall:6.1f}%" if wall > 0 else "    n/a"

    lines = [f"{'category':<{width}}  {'seconds':>10}  {'% wall':>7}"]
    rule = "-" * len(lines[0])
    lines.append(rule)
    for name in names:
        row = f"{name:<{width}}  {breakdown[name]:>10.2f}  {pct(breakdown[name]):>7}"
        if name == "committed":
            row += "  <== goodput"
        lines.append(row)
    lines.append(rule)
    lines.append(f"{'total (wall)':<{width}}  {wall:>10.2f}  {pct(wall):>7}")
    lines.append(f"** goodput = committed / wall = {100.0 * goodput_of(breakdown):.1f}% **")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- timeline


@dataclass(frozen=True)
class TimelineStep:
    """A committed step as the timeline draws it, read from its record in ``summary.json``
    (``StepResult.to_json``): what a record lacks (a summary cut short, an older one) is None."""

    t: float  # when it was committed
    step: int | None
    leg: int  # of the run (1 unless resumed)
    step_s: float | None
    loss: float | None
    rank_step_s: dict[int, float]  # each rank's wall seconds
    expert_load: dict[int, float]  # each expert layer's most loaded expert's tokens over the mean; {} if dense

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> TimelineStep:
        def number(key: str) -> float | None:
            return None if record.get(key) is None else float(record[key])

        return cls(t=float(record["t"]), step=None if record.get("step") is None else int(record["step"]),
                   leg=int(record.get("leg", 1)), step_s=number("step_s"), loss=number("loss"),
                   rank_step_s={int(rank): float(seconds) for rank, seconds in (record.get("rank_step_s") or {}).items()
                                if seconds is not None},
                   expert_load={int(layer): float(load) for layer, load in (record.get("expert_load") or {}).items()})

    @property
    def started(self) -> float:
        return self.t - (self.step_s or 0.0)


def _rank_matrix(steps: list[TimelineStep]) -> tuple[list[int], list[list[float]]]:
    """Sorted rank ids and a ranks x steps matrix of step seconds (NaN where a rank is absent)."""
    ranks = sorted({rank for step in steps for rank in step.rank_step_s})
    index = {rank: i for i, rank in enumerate(ranks)}
    matrix = [[math.nan] * len(steps) for _ in ranks]
    for j, step in enumerate(steps):
        for rank, seconds in step.rank_step_s.items():
            matrix[index[rank]][j] = seconds
    return ranks, matrix


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


def _step_columns(steps: list[TimelineStep]) -> tuple[list[float], list[int | None]]:
    """Cell edges in seconds for a heatmap with one column per step spanning [t - step_s, t];
    gaps between steps (recoveries, stalls) become empty columns (index None)."""
    edges: list[float] = []
    columns: list[int | None] = []
    prev_end: float | None = None
    for j, step in enumerate(steps):
        end = step.t
        dur = step.step_s or 0.0
        start = end - dur if dur > 0 else (prev_end if prev_end is not None else end - 1.0)
        if prev_end is None:
            edges.append(start)
        else:
            start = max(start, prev_end)
            if start > prev_end + 1e-9:
                columns.append(None)
                edges.append(start)
        if end <= edges[-1]:
            end = edges[-1] + 1e-6
        columns.append(j)
        edges.append(end)
        prev_end = end
    return edges, columns


def _event_label(event: dict[str, Any]) -> str | None:
    kind = event.get("kind")
    if kind in (K.RANK_FAILED, K.RANK_EVICTED):
        cause = event.get("cause")
        rank = event.get("rank", "?")
        return f"rank {rank}" + (f" {cause}" if cause else "") + (" evicted" if kind == K.RANK_EVICTED else "")
    if kind == K.STRAGGLER_MITIGATED:
        target = event.get("rank", event.get("group"))
        return f"{event.get('action', 'mitigate')} {target}" if target is not None else event.get("action")
    if kind == K.CHECKPOINT_FAILED:
        return "ckpt failed"
    return None


def merged_labels(labels: list[tuple[float, str, str]], within_s: float) -> list[tuple[float, list[str], str]]:
    """Event labels ``(t, text, colour)`` in time order, those within ``within_s`` of the first
    of a run of them joined into one (each text once): drawn one under another, not on top."""
    merged: list[tuple[float, list[str], str]] = []
    for t, label, colour in labels:
        if merged and t - merged[-1][0] <= within_s:
            if label not in merged[-1][1]:
                merged[-1][1].append(label)
        else:
            merged.append((t, [label], colour))
    return merged


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


def leg_ending(leg: dict[str, Any]) -> str | None:
    """How a leg of a run ended, in a few words: the head of its exit (``completed``,
    ``failed``, ``stopped``), with the signal that preempted it: ``preempted (SIGINT)``.
    None for a leg that recorded no exit."""
    exit_status = leg.get("exit")
    if not exit_status:
        return None
    try:
        ended = Exit.parse(str(exit_status))
    except ValueError:  # a line of another version's: its head, as it is
        return str(exit_status).split(":", 1)[0]
    signal = next((event.get("signal") for event in leg.get("events") or []
                   if event.get("kind") == K.STOP_REQUESTED), None)
    ending = f"{ended.ending} ({signal})" if signal and ended.ending == Ending.PREEMPTED else str(ended.ending)
    if ended.final_checkpoint_missed_at is not None:
        ending += f", final checkpoint missed (step {ended.final_checkpoint_missed_at})"
    return ending


def plot_timeline(summary: dict[str, Any], path: str) -> str:
    """Draw the run timeline to a PNG at ``path`` (local path or fsspec URL); returns ``path``."""
    _save_figure(timeline_figure(summary), path)
    return path


def timeline_figure(summary: dict[str, Any]) -> Any:
    """The run timeline as a matplotlib Figure: per-rank step times, loss, each expert layer's
    load balance (a mixture of experts' alone), live ranks, and the run's events over them."""
    # Draw on an Agg canvas directly: no pyplot, no global backend switch, no display needed.
    # matplotlib is the "report" extra: training never needs it.
    try:
        import matplotlib
    except ImportError:
        raise ValueError("the timeline is drawn with matplotlib: pip install 'elastic-trainer[report]'") from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_hex
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator, PercentFormatter

    steps = sorted((TimelineStep.of_record(record) for record in summary.get("steps") or []
                    if record.get("t") is not None), key=lambda step: step.t)
    events = [e for e in summary.get("events") or [] if e.get("t") is not None]
    try:
        breakdown: dict[str, float] | None = goodput_breakdown(summary)
    except ValueError:
        breakdown = None
    wall = float(
        (breakdown or {}).get("wall_s")
        or summary.get("wall_s")
        or max([0.0] + [step.t for step in steps] + [float(e["t"]) for e in events])
    )
    goodput = goodput_of(breakdown) if breakdown else float(summary.get("goodput") or 0.0)

    expert_loads = expert_load_series(steps)
    height_ratios = [2.2, 1.3, 1.0]
    if expert_loads:  # a panel of its own, under the loss and against the step as well
        height_ratios.insert(2, 1.0)

    fig = Figure(figsize=(14, 12 if expert_loads else 10), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(height_ratios), 2, height_ratios=height_ratios, width_ratios=[1.0, 0.16])
    ax_rank = fig.add_subplot(grid[0, 0])
    ax_loss = fig.add_subplot(grid[1, 0])  # against the step, not the clock
    ax_expert = fig.add_subplot(grid[2, 0], sharex=ax_loss) if expert_loads else None
    ax_live = fig.add_subplot(grid[-1, 0], sharex=ax_rank)
    side_top = fig.add_subplot(grid[0, 1])
    side_mid = fig.add_subplot(grid[1:, 1])
    side_mid.axis("off")
    axes = (ax_rank, ax_live)  # the panels drawn against the clock

    # (1) per-rank step time -------------------------------------------------------------------
    ranks, matrix = _rank_matrix(steps)
    times = [step.t for step in steps]
    # start-up: the ledger's (placing and building the ranks); without one, until the first
    # committed step began (a rollback to step 0 drops the earlier steps' records)
    if summary.get("leg_starts"):  # every leg's own, where it began
        startups = [(start, start + seconds) for start, seconds in zip(summary["leg_starts"], summary["leg_startup_s"])]
    elif breakdown and breakdown.get("startup"):
        startups = [(0.0, float(breakdown["startup"]))]
    else:
        startups = [(0.0, max(0.0, steps[0].started) if steps else wall)]
    membership = live_membership(events, summary.get("leg_starts") or [], wall)
    first_failure = min((float(e["t"]) for e in events if e.get("kind") == K.RANK_FAILED), default=math.inf)
    rows: dict[int, float] = {}  # each rank's row: where its failures are marked
    if not steps:
        ax_rank.text(0.5, 0.5, "no committed steps", ha="center", va="center", transform=ax_rank.transAxes)
        side_top.axis("off")
    elif len(ranks) > MAX_RANK_LINES:
        import numpy as np

        edges, columns = _step_columns(steps)
        data = np.full((len(ranks), len(columns)), np.nan)
        for c, j in enumerate(columns):
            if j is not None:
                data[:, c] = [row[j] for row in matrix]
        masked = np.ma.masked_invalid(data)
        y_edges = np.arange(len(ranks) + 1) - 0.5
        mesh = ax_rank.pcolormesh(np.asarray(edges), y_edges, masked, cmap="viridis", shading="flat")
        rows = {rank: float(i) for i, rank in enumerate(ranks)}
        ax_rank.set_ylim(len(ranks) - 0.5, -0.5)
        tick_every = max(1, len(ranks) // 16)
        ax_rank.set_yticks(range(0, len(ranks), tick_every))
        ax_rank.set_yticklabels([str(ranks[i]) for i in range(0, len(ranks), tick_every)], fontsize=7)
        ax_rank.set_ylabel("rank")
        ax_rank.set_title("per-rank step time (s); blank = rank absent or no step running", fontsize=10, loc="left")
        side_top.axis("off")
        cax = side_top.inset_axes([0.0, 0.05, 0.18, 0.9])
        fig.colorbar(mesh, cax=cax, label="step time (s)")
    else:
        rows = {rank: statistics.median([seconds for seconds in row if not math.isnan(seconds)])
                for rank, row in zip(ranks, matrix)}  # in a panel of lines, a rank's typical step time
        # the failure red is the failures' own: no rank's line is drawn in it
        colours = matplotlib.colormaps["tab20" if len(ranks) > 10 else "tab10"].colors
        palette = [colour for colour in map(to_hex, colours) if colour != FAILURE_COLOUR]
        step_s = [math.nan if step.step_s is None else step.step_s for step in steps]
        # Break the lines across long gaps (recoveries) instead of drawing through them.
        xs: list[float] = []
        cols: list[int | None] = []
        for j, t in enumerate(times):
            if j and not math.isnan(step_s[j]) and (t - step_s[j]) - times[j - 1] > step_s[j]:
                xs.append(math.nan)
                cols.append(None)
            xs.append(t)
            cols.append(j)

        def series(values: list[float]) -> list[float]:
            return [math.nan if j is None else values[j] for j in cols]

        (total,) = ax_rank.plot(xs, series(step_s), color="#555555", linewidth=2.5, alpha=0.35,
                                zorder=1, label="step (slowest)")
        handles = []
        drawn = range(len(ranks))
        if len(ranks) > MAX_RANKS_APART:
            # More lines than an eye tells apart: the ranks as a band (fastest to slowest) and
            # their median, with the ranks that stand out (slow, or failed) drawn and named.
            import numpy as np

            columns = np.array(matrix, dtype=float)
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                low, middle, high = (np.nanmin(columns, 0), np.nanmedian(columns, 0), np.nanmax(columns, 0))
                typical = np.nanmedian(np.nanmedian(columns, 1))
                slow = [i for i, row in enumerate(columns) if np.nanmedian(row) > OUTLIER_FACTOR * typical]
            ax_rank.fill_between(xs, series(list(low)), series(list(high)), color="#1f77b4", alpha=0.18,
                                 linewidth=0, zorder=1)
            (median,) = ax_rank.plot(xs, series(list(middle)), color="#1f77b4", linewidth=1.2, zorder=2,
                                     label=f"median of {len(ranks)} ranks")
            handles += [median, Patch(color="#1f77b4", alpha=0.18, label="fastest to slowest rank")]
            drawn = slow
        for i in drawn:
            rank = ranks[i]
            (line,) = ax_rank.plot(xs, series(matrix[i]), marker="o", markersize=2.5, linewidth=1.0,
                                   color=palette[i % len(palette)], zorder=2,
                                   label=f"rank {rank}" if len(ranks) <= MAX_RANKS_APART else f"rank {rank} (slow)")
            handles.append(line)
        handles.append(total)
        ax_rank.set_ylabel("step time (s)")
        ax_rank.set_ylim(bottom=0)
        ax_rank.set_title("per-rank step time", fontsize=10, loc="left")
        side_top.axis("off")
        side_top.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, title="ranks",
                        title_fontsize=9, borderaxespad=0.0)
    for down in membership.downs:  # on the lost rank's row alone, from its loss until it was back
        if down.rank in rows:
            ax_rank.plot([down.since, down.until], [rows[down.rank]] * 2, color=FAILURE_COLOUR, linewidth=2.0,
                         marker="X", markevery=[0], markersize=7, solid_capstyle="butt", zorder=5)

    # (2) loss per committed step ----------------------------------------------------------------
    loss_points = [(step.step, step.loss, step.leg) for step in steps
                   if step.loss is not None and step.step is not None]
    eval_points = [(int(e["step"]), float(e["loss"])) for e in events
                   if e.get("kind") == K.EVALUATED and e.get("step") is not None]
    legs = sorted({leg for _, _, leg in loss_points})
    for leg in legs:  # a resumed leg goes back to its checkpoint's step: drawn as a line of its own
        points = [(step, loss) for step, loss, of in loss_points if of == leg]
        ax_loss.plot([p[0] for p in points], [p[1] for p in points], marker=".", markersize=3, linewidth=1.0,
                     color="#333333" if len(legs) == 1 else matplotlib.colormaps["tab10"](leg % 10),
                     label="training" if len(legs) == 1 else f"training, leg {leg}")
    if eval_points:
        ax_loss.plot([p[0] for p in eval_points], [p[1] for p in eval_points], color="#d62728",
                     marker="o", markersize=5, linewidth=1.2, label="held-out")
    if eval_points or len(legs) > 1:
        ax_loss.legend(loc="upper right", fontsize=8, frameon=False)
    if loss_points or eval_points:
        drawn_steps = [p[0] for p in loss_points] + [p[0] for p in eval_points]
        margin = max(1.0, 0.02 * (max(drawn_steps) - min(drawn_steps)))  # the last point never on the edge
        ax_loss.set_xlim(min(drawn_steps) - margin, max(drawn_steps) + margin)
    ax_loss.set_xlabel("step")
    if not loss_points and not eval_points:
        ax_loss.text(0.5, 0.5, "no losses", ha="center", va="center", transform=ax_loss.transAxes)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss per committed step" + (", held-out loss per evaluation" if eval_points else ""),
                      fontsize=10, loc="left")

    # (3) expert load per committed step (a mixture of experts) ---------------------------------
    if ax_expert is not None:
        # a colour each while they tell apart, else in order of depth
        colour_of = (matplotlib.colormaps["tab10"] if len(expert_loads) <= 10
                     else matplotlib.colormaps["viridis"].resampled(len(expert_loads)))
        for i, (layer, (layer_steps, loads)) in enumerate(expert_loads.items()):
            ax_expert.plot(layer_steps, loads, marker=".", markersize=3, linewidth=1.0, color=colour_of(i),
                           label=f"layer {layer}")
        # drawn over the bottom spine, where the axis starts: no layer is ever more even than 1
        ax_expert.axhline(1.0, color="#333333", linewidth=1.2, linestyle="--", clip_on=False, zorder=3, label="even")
        ax_expert.set_ylim(bottom=1.0)
        # four rows at most: a model of many expert layers widens the legend rather than filling the panel
        ax_expert.legend(loc="upper right", fontsize=8, frameon=False, ncol=math.ceil((len(expert_loads) + 1) / 4))
        ax_expert.set_xlabel("step")
        ax_expert.set_ylabel("load balance")
        ax_expert.grid(True, alpha=0.25)
        ax_expert.set_title("expert load: each layer's most loaded expert's tokens over the mean per expert "
                            "(1 = even)", fontsize=10, loc="left")

    # (4) live ranks / groups --------------------------------------------------------------------
    topo_ranks = (summary.get("topology") or {}).get("ranks")
    ax_live.step(membership.t, membership.ranks, where="post", color="#17becf", linewidth=1.8, label="live ranks")
    ax_live.fill_between(membership.t, membership.ranks, step="post", color="#17becf", alpha=0.15)
    ax_live.set_ylim(0, max(membership.ranks + ([topo_ranks] if topo_ranks else [])) * 1.15 + 0.5)
    ax_groups = ax_live.twinx()
    ax_groups.step(membership.t, membership.groups, where="post", color="#8c564b", linewidth=1.0, linestyle="--")
    ax_groups.set_ylim(0, max(membership.groups) * 1.15 + 0.5)
    ax_groups.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_groups.set_ylabel("groups in the quorum", color="#8c564b")
    ax_groups.tick_params(axis="y", colors="#8c564b")
    if topo_ranks:
        ax_live.axhline(topo_ranks, color="#999999", linewidth=0.8, linestyle=":")
    ax_live.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_live.set_ylabel("live ranks", color="#17becf")
    if wall > 2 * 3600:  # a run of days read in hours
        hours_a_tick = next(h for h in (1, 2, 3, 4, 6, 12, 24, 48, 96, 10**9) if wall / 3600 / h <= 12)
        ax_live.xaxis.set_major_locator(MultipleLocator(3600 * hours_a_tick))
        ax_live.xaxis.set_major_formatter(FuncFormatter(lambda t, _: f"{t / 3600:g}"))
        ax_live.set_xlabel("hours since run start")
    else:
        ax_live.set_xlabel("seconds since run start")
    ax_live.set_title("live ranks (solid) and groups in the quorum (dashed)", fontsize=10, loc="left")

    # events -------------------------------------------------------------------------------------
    for begin, end in startups:
        for ax in axes:
            ax.axvspan(begin, end, color="#bbbbbb", alpha=0.18, zorder=0)
        if end - begin > 0.04 * wall:  # labelled where the label fits
            ax_rank.text((begin + end) / 2, 0.5, f"start-up:\nRay, actors,\ngroups built\n{end - begin:.0f} s",
                         transform=ax_rank.get_xaxis_transform(), ha="center", va="center", fontsize=9,
                         color="#666666")
    legs = zip(summary.get("leg_starts") or [], summary.get("leg_endings") or [])
    for number, (start, ending) in enumerate(legs, start=1):
        if number > 1:  # where a resume began: the time axis runs on over every leg
            for ax in axes:
                ax.axvline(start, color="black", linewidth=1.2, linestyle=(0, (6, 3)), zorder=3)
        # at two heights in turn: the label of a short leg does not run into the next one's
        ax_live.annotate(f"leg {number}" + (f": {ending}" if ending else ""),
                         xy=(start, 0.02 + 0.12 * (number % 2 == 0)), xycoords=("data", "axes fraction"),
                         xytext=(3, 0), textcoords="offset points", fontsize=8)
    present: list[str] = []
    labels: list[tuple[float, str, str]] = []  # (time, text, colour), merged below
    for event in sorted(events, key=lambda e: e["t"]):
        category = _CATEGORY_OF_KIND.get(event.get("kind"))
        if category is None or (category == "recovery" and event.get("kind") != K.RECOVERED
                                and float(event["t"]) < first_failure):
            continue  # groups joining before anything failed are the start, not a recovery
        if category not in present:
            present.append(category)
        _, colour, style, _ = EVENT_CATEGORIES[category]
        t = float(event["t"])
        width = 1.4 if category in ("failure", "checkpoint-failed") else 1.0
        # in the per-rank panel a failure is marked on the lost rank's row, not across every rank
        for ax in (ax_live,) if category == "failure" else axes:
            ax.axvline(t, color=colour, linestyle=style, linewidth=width, alpha=0.8, zorder=3)
        if event.get("kind") == K.RECOVERED and event.get("total_s"):
            for ax in axes:
                ax.axvspan(t - float(event["total_s"]), t, color=colour, alpha=0.08, zorder=0)
        label = _event_label(event)
        if label:
            labels.append((t, label, colour))
    for t, texts, colour in merged_labels(labels, 0.02 * max(wall, 1e-9))[:24]:
        ax_rank.annotate("\n".join(texts[:3]) + (f"\n(+{len(texts) - 3} more)" if len(texts) > 3 else ""),
                         xy=(t, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                         textcoords="offset points", va="top", ha="left", fontsize=8, color=colour,
                         bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "linewidth": 0})
    order = list(EVENT_CATEGORIES)
    present.sort(key=order.index)
    if present:
        handles = [Line2D([], [], color=EVENT_CATEGORIES[c][1], linestyle=EVENT_CATEGORIES[c][2],
                          marker="X" if c == "failure" else None, linewidth=1.6, label=EVENT_CATEGORIES[c][0])
                   for c in present]
        if any(e.get("kind") == K.RECOVERED and e.get("total_s") for e in events):
            handles.append(Patch(color=EVENT_CATEGORIES["recovery"][1], alpha=0.2, label="recovery window"))
        side_mid.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, title="events",
                        title_fontsize=9, borderaxespad=0.0)

    if breakdown:  # where the wall time went, drawn as one bar under the event legend
        bar = side_mid.inset_axes([0.0, 0.0, 0.9, 0.3])
        left = 0.0
        for category in CATEGORIES:
            share = breakdown[category] / breakdown["wall_s"] if breakdown["wall_s"] > 0 else 0.0
            bar.barh(0, share, left=left, color=BREAKDOWN_COLOURS[category], label=f"{category} {share:.0%}")
            left += share
        bar.set_xlim(0, 1)
        bar.set_yticks([])
        bar.xaxis.set_major_formatter(PercentFormatter(1.0))
        bar.tick_params(labelsize=7)
        bar.set_title("wall time", fontsize=9, loc="left")
        bar.legend(loc="lower left", bbox_to_anchor=(0.0, 1.25), fontsize=7, frameon=False, ncol=2)

    for ax in (*axes, ax_loss):
        ax.grid(True, alpha=0.25)
    for ax in axes:
        ax.set_xlim(0, max(wall, 1e-9))
    if len(ranks) > MAX_RANK_LINES:
        ax_rank.grid(False)
    ax_rank.tick_params(labelbottom=False)

    run_name = summary.get("run") or "run"
    title = (f"{run_name} — goodput {100.0 * goodput:.1f}% — "
             f"{summary.get('steps_committed', len(steps))} steps committed, "
             f"{summary.get('steps_discarded', 0)} discarded")
    exit_status = summary.get("exit")
    if exit_status and exit_status != str(Exit(Ending.COMPLETED)):
        title += f"\nexit: {str(exit_status)[:100]}"
    fig.suptitle(title, fontsize=13)
    return fig


def _save_figure(fig: Any, path: str) -> None:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    if _is_local(path):
        local = _local_path(path)
        parent = os.path.dirname(os.path.abspath(local))
        os.makedirs(parent, exist_ok=True)
        with open(local, "wb") as handle:
            handle.write(buffer.getvalue())
    else:
        with fsspec.open(path, "wb") as handle:
            handle.write(buffer.getvalue())


# ---------------------------------------------------------------------------------------- report


def _default_output(run: str, summary: dict[str, Any]) -> str:
    summary_path = _summary_path(run)
    if _is_local(summary_path):
        return os.path.join(os.path.dirname(os.path.abspath(_local_path(summary_path))), DEFAULT_PNG_NAME)
    name = summary.get("run")
    if not name:
        parts = [p for p in summary_path.rstrip("/").split("/") if p]
        name = parts[-2] if len(parts) >= 2 else "run"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._") or "run"
    return os.path.join(os.getcwd(), f"{safe}-timeline.png")


def whole_run(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary of every leg of the run as one (``elastic.outputs.run_record``): each leg's
    steps and events in order, their times after the legs before it, the time breakdown and
    goodput summed over the legs, and where each leg began and how it ended. A single leg's
    summary is itself."""
    legs = [*summary.get("earlier_legs", []), summary]
    if len(legs) == 1:
        return summary
    steps, events, offset, starts, startups = [], [], 0.0, [], []
    for number, leg in enumerate(legs, start=1):
        starts.append(offset)
        startups.append(float((leg.get("time_breakdown") or {}).get("startup") or 0.0))
        steps += [{**record, "t": record["t"] + offset, "leg": number} for record in leg.get("steps") or []
                  if record.get("t") is not None]
        events += [{**event, "t": event["t"] + offset, "leg": number} for event in leg.get("events") or []
                   if event.get("t") is not None]
        offset += float((leg.get("time_breakdown") or {}).get("wall_s") or leg.get("wall_s") or 0.0)
    total = summary["run_total"]
    return {**summary, "steps": steps, "events": events, "time_breakdown": total["time_breakdown"],
            "wall_s": total["wall_s"], "goodput": total["goodput"], "leg_starts": starts,
            "leg_startup_s": startups, "leg_endings": [leg_ending(leg) for leg in legs],
            "steps_committed": total["steps_committed"], "steps_discarded": total["steps_discarded"]}


def report(run: str, output: str | None = None) -> tuple[str, dict[str, float]]:
    """Load a run's summary, write its timeline PNG of every leg and return (png path, goodput
    breakdown over the whole run).

    The PNG goes to ``output`` if given, else ``timeline.png`` in the run directory when it is
    local, else ``<run>-timeline.png`` in the current directory."""
    summary = whole_run(load_summary(run))
    breakdown = goodput_breakdown(summary)
    path = output if output is not None else _default_output(run, summary)
    plot_timeline(summary, path)
    return path, breakdown


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="elastic report",
        description="Goodput breakdown and timeline PNG for a finished (or crashed) run.",
    )
    parser.add_argument("run", metavar="RUN",
                        help="run directory or storage URL (e.g. s3://bucket/prefix/run-name), "
                             "or its summary.json")
    parser.add_argument("--output", "-o", metavar="PNG", default=None,
                        help="where to write the timeline PNG (default: timeline.png in a local run "
                             "directory, <run>-timeline.png in the current directory for remote runs)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        path, breakdown = report(args.run, args.output)
    except (FileNotFoundError, ValueError) as err:
        print(f"elastic report: error: {redact_credentials(str(err))}", file=sys.stderr)
        return 1
    print(format_breakdown(breakdown))
    print(f"timeline: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

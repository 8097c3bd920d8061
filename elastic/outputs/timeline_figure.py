"""The run timeline as a matplotlib figure, one function per panel: per-rank step times
(lines, a band, or a heatmap as the ranks grow), the loss against the step, each expert
layer's load balance (a mixture of experts' alone), the live ranks and groups, the run's
events over them, and where the wall time went.

Drawn on an Agg canvas directly: no pyplot, no global backend switch, no display needed.
matplotlib is the "report" extra: training never needs it.
"""

from __future__ import annotations

import io
import math
import os
import statistics
import warnings
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic.core.events import EventKind as K
from elastic.core.exits import Ending, Exit
from elastic.core.goodput import CATEGORIES
from elastic.outputs.timeline import Timeline, TimelineStep, expert_load_series, live_membership

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
    "corruption": ("silent corruption found (a spot check's replay, the integrity check)", "#e377c2", "-.",
                   (K.SILENT_CORRUPTION_FOUND, K.INTEGRITY_MISMATCH)),
}
# Goodput categories -> colour, for the wall-time bar.
BREAKDOWN_COLOURS = {"committed": "#2ca02c", "evaluation": "#bcbd22", "recovery": "#d62728", "discarded": "#7f7f7f",
                     "checkpoint_stall": CHECKPOINT_COLOUR, "startup": "#bbbbbb", "idle": "#e7e7e7"}
_CATEGORY_OF_KIND = {kind.value: cat for cat, (_, _, _, kinds) in EVENT_CATEGORIES.items() for kind in kinds}


def plot_timeline(timeline: Timeline, path: str) -> str:
    """Draw the run timeline to a PNG at ``path`` (local path or fsspec URL); returns ``path``."""
    buffer = io.BytesIO()
    timeline_figure(timeline).savefig(buffer, format="png")
    fs, stripped = fsspec.core.url_to_fs(path)
    if isinstance(fs, LocalFileSystem):
        os.makedirs(os.path.dirname(os.path.abspath(stripped)), exist_ok=True)
    with fs.open(stripped, "wb") as handle:
        handle.write(buffer.getvalue())
    return path


@dataclass(frozen=True)
class Axes:
    """The figure's panels: those against the clock (rank times, live ranks) share its axis."""

    rank: Any
    loss: Any  # against the step, not the clock
    expert: Any | None  # a mixture of experts' alone
    live: Any
    side_top: Any  # the rank panel's legend or colour bar
    side: Any  # the events' legend and the wall-time bar

    @property
    def on_clock(self) -> tuple[Any, Any]:
        return self.rank, self.live


def timeline_figure(timeline: Timeline) -> Any:
    """The run timeline as a matplotlib Figure: per-rank step times, loss, each expert layer's
    load balance (a mixture of experts' alone), live ranks, and the run's events over them."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("the timeline is drawn with matplotlib: pip install 'elastic-trainer[report]'") from None

    expert_loads = expert_load_series(timeline.steps)
    height_ratios = [2.2, 1.3, 1.0]
    if expert_loads:  # a panel of its own, under the loss and against the step as well
        height_ratios.insert(2, 1.0)
    fig = Figure(figsize=(14, 12 if expert_loads else 10), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(len(height_ratios), 2, height_ratios=height_ratios, width_ratios=[1.0, 0.16])
    rank = fig.add_subplot(grid[0, 0])
    loss = fig.add_subplot(grid[1, 0])
    axes = Axes(rank=rank, loss=loss, expert=fig.add_subplot(grid[2, 0], sharex=loss) if expert_loads else None,
                live=fig.add_subplot(grid[-1, 0], sharex=rank), side_top=fig.add_subplot(grid[0, 1]),
                side=fig.add_subplot(grid[1:, 1]))
    axes.side.axis("off")
    axes.side_top.axis("off")

    membership = live_membership(timeline.events, [start for start, _ in timeline.legs], timeline.wall)
    rows = draw_rank_times(fig, axes, sorted(timeline.steps, key=lambda step: step.t))
    for down in membership.downs:  # on the lost rank's row alone, from its loss until it was back
        if down.rank in rows:
            axes.rank.plot([down.since, down.until], [rows[down.rank]] * 2, color=FAILURE_COLOUR, linewidth=2.0,
                           marker="X", markevery=[0], markersize=7, solid_capstyle="butt", zorder=5)
    draw_losses(axes.loss, timeline)
    if axes.expert is not None:
        draw_expert_load(axes.expert, expert_loads)
    draw_live_ranks(axes.live, membership, timeline)
    draw_legs(axes, timeline)
    draw_events(axes, timeline)
    if timeline.breakdown:
        draw_wall_time(axes.side, timeline.breakdown)

    for ax in (*axes.on_clock, axes.loss):
        ax.grid(True, alpha=0.25)
    for ax in axes.on_clock:
        ax.set_xlim(0, max(timeline.wall, 1e-9))
    if len(rows) > MAX_RANK_LINES:
        axes.rank.grid(False)
    axes.rank.tick_params(labelbottom=False)
    title = (f"{timeline.run} — goodput {100.0 * timeline.goodput:.1f}% — "
             f"{timeline.steps_committed} steps committed, {timeline.steps_discarded} discarded")
    if timeline.exit and timeline.exit != str(Exit(Ending.COMPLETED)):
        title += f"\nexit: {timeline.exit[:100]}"
    fig.suptitle(title, fontsize=13)
    return fig



def draw_rank_times(fig: Any, axes: Axes, steps: list[TimelineStep]) -> dict[int, float]:
    """Each rank's step time against the clock: a line each for a few ranks, a band with the
    slow ranks named for more, a heatmap beyond ``MAX_RANK_LINES``. Returns each rank's row
    (where its failures are marked)."""
    ax = axes.rank
    ranks, matrix = _rank_matrix(steps)
    if not steps:
        ax.text(0.5, 0.5, "no committed steps", ha="center", va="center", transform=ax.transAxes)
        return {}
    if len(ranks) > MAX_RANK_LINES:
        return _draw_rank_heatmap(fig, axes, steps, ranks, matrix)
    return _draw_rank_lines(axes, steps, ranks, matrix)


def _draw_rank_heatmap(fig: Any, axes: Axes, steps: list[TimelineStep], ranks: list[int],
                       matrix: list[list[float]]) -> dict[int, float]:
    import numpy as np

    ax = axes.rank
    edges, columns = _step_columns(steps)
    data = np.full((len(ranks), len(columns)), np.nan)
    for c, j in enumerate(columns):
        if j is not None:
            data[:, c] = [row[j] for row in matrix]
    y_edges = np.arange(len(ranks) + 1) - 0.5
    mesh = ax.pcolormesh(np.asarray(edges), y_edges, np.ma.masked_invalid(data), cmap="viridis", shading="flat")
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    tick_every = max(1, len(ranks) // 16)
    ax.set_yticks(range(0, len(ranks), tick_every))
    ax.set_yticklabels([str(ranks[i]) for i in range(0, len(ranks), tick_every)], fontsize=7)
    ax.set_ylabel("rank")
    ax.set_title("per-rank step time (s); blank = rank absent or no step running", fontsize=10, loc="left")
    fig.colorbar(mesh, cax=axes.side_top.inset_axes([0.0, 0.05, 0.18, 0.9]), label="step time (s)")
    return {rank: float(i) for i, rank in enumerate(ranks)}


def _draw_rank_lines(axes: Axes, steps: list[TimelineStep], ranks: list[int],
                     matrix: list[list[float]]) -> dict[int, float]:
    import matplotlib
    from matplotlib.colors import to_hex
    from matplotlib.patches import Patch

    ax = axes.rank
    times = [step.t for step in steps]
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

    (total,) = ax.plot(xs, series(step_s), color="#555555", linewidth=2.5, alpha=0.35, zorder=1,
                       label="step (slowest)")
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
        ax.fill_between(xs, series(list(low)), series(list(high)), color="#1f77b4", alpha=0.18, linewidth=0, zorder=1)
        (median,) = ax.plot(xs, series(list(middle)), color="#1f77b4", linewidth=1.2, zorder=2,
                            label=f"median of {len(ranks)} ranks")
        handles += [median, Patch(color="#1f77b4", alpha=0.18, label="fastest to slowest rank")]
        drawn = slow
    for i in drawn:
        rank = ranks[i]
        (line,) = ax.plot(xs, series(matrix[i]), marker="o", markersize=2.5, linewidth=1.0,
                          color=palette[i % len(palette)], zorder=2,
                          label=f"rank {rank}" if len(ranks) <= MAX_RANKS_APART else f"rank {rank} (slow)")
        handles.append(line)
    handles.append(total)
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title("per-rank step time", fontsize=10, loc="left")
    axes.side_top.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, title="ranks",
                         title_fontsize=9, borderaxespad=0.0)
    # in a panel of lines, a rank's row is its typical step time
    return {rank: statistics.median([seconds for seconds in row if not math.isnan(seconds)])
            for rank, row in zip(ranks, matrix)}


def draw_losses(ax: Any, timeline: Timeline) -> None:
    """The loss per committed step, a line per leg (a resumed leg goes back to its
    checkpoint's step), and the held-out loss per evaluation."""
    import matplotlib

    loss_points = [(step.step, step.loss, step.leg) for step in timeline.steps
                   if step.loss is not None and step.step is not None]
    eval_points = [(int(e["step"]), float(e["loss"])) for e in timeline.events
                   if e.get("kind") == K.EVALUATED and e.get("step") is not None]
    legs = sorted({leg for _, _, leg in loss_points})
    for leg in legs:
        points = [(step, loss) for step, loss, of in loss_points if of == leg]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", markersize=3, linewidth=1.0,
                color="#333333" if len(legs) == 1 else matplotlib.colormaps["tab10"](leg % 10),
                label="training" if len(legs) == 1 else f"training, leg {leg}")
    if eval_points:
        ax.plot([p[0] for p in eval_points], [p[1] for p in eval_points], color="#d62728",
                marker="o", markersize=5, linewidth=1.2, label="held-out")
    if eval_points or len(legs) > 1:
        ax.legend(loc="upper right", fontsize=8, frameon=False)
    if loss_points or eval_points:
        drawn_steps = [p[0] for p in loss_points] + [p[0] for p in eval_points]
        margin = max(1.0, 0.02 * (max(drawn_steps) - min(drawn_steps)))  # the last point never on the edge
        ax.set_xlim(min(drawn_steps) - margin, max(drawn_steps) + margin)
    else:
        ax.text(0.5, 0.5, "no losses", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss per committed step" + (", held-out loss per evaluation" if eval_points else ""),
                 fontsize=10, loc="left")


def draw_expert_load(ax: Any, expert_loads: dict[int, tuple[list[int], list[float]]]) -> None:
    """Each expert layer's load balance per committed step (a mixture of experts)."""
    import matplotlib

    # a colour each while they tell apart, else in order of depth
    colour_of = (matplotlib.colormaps["tab10"] if len(expert_loads) <= 10
                 else matplotlib.colormaps["viridis"].resampled(len(expert_loads)))
    for i, (layer, (layer_steps, loads)) in enumerate(expert_loads.items()):
        ax.plot(layer_steps, loads, marker=".", markersize=3, linewidth=1.0, color=colour_of(i), label=f"layer {layer}")
    # drawn over the bottom spine, where the axis starts: no layer is ever more even than 1
    ax.axhline(1.0, color="#333333", linewidth=1.2, linestyle="--", clip_on=False, zorder=3, label="even")
    ax.set_ylim(bottom=1.0)
    # four rows at most: a model of many expert layers widens the legend rather than filling the panel
    ax.legend(loc="upper right", fontsize=8, frameon=False, ncol=math.ceil((len(expert_loads) + 1) / 4))
    ax.set_xlabel("step")
    ax.set_ylabel("load balance")
    ax.grid(True, alpha=0.25)
    ax.set_title("expert load: each layer's most loaded expert's tokens over the mean per expert (1 = even)",
                 fontsize=10, loc="left")


def draw_live_ranks(ax: Any, membership, timeline: Timeline) -> None:
    """The rank processes alive (solid) and the groups in the quorum (dashed) over the run. A
    group out of the quorum keeps its live processes, which train nothing until it joins
    again: the progress bar and ``elastic_live_ranks`` count the quorum's ranks."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, MultipleLocator

    topo_ranks = timeline.ranks
    ax.step(membership.t, membership.ranks, where="post", color="#17becf", linewidth=1.8, label="rank processes alive")
    ax.fill_between(membership.t, membership.ranks, step="post", color="#17becf", alpha=0.15)
    ax.set_ylim(0, max(membership.ranks + ([topo_ranks] if topo_ranks else [])) * 1.15 + 0.5)
    ax_groups = ax.twinx()
    ax_groups.step(membership.t, membership.groups, where="post", color="#8c564b", linewidth=1.0, linestyle="--")
    ax_groups.set_ylim(0, max(membership.groups) * 1.15 + 0.5)
    ax_groups.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_groups.set_ylabel("groups in the quorum", color="#8c564b")
    ax_groups.tick_params(axis="y", colors="#8c564b")
    if topo_ranks:
        ax.axhline(topo_ranks, color="#999999", linewidth=0.8, linestyle=":")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("rank processes alive", color="#17becf")
    wall = timeline.wall
    if wall > 2 * 3600:  # a run of days read in hours
        hours_a_tick = next(h for h in (1, 2, 3, 4, 6, 12, 24, 48, 96, 10**9) if wall / 3600 / h <= 12)
        ax.xaxis.set_major_locator(MultipleLocator(3600 * hours_a_tick))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda t, _: f"{t / 3600:g}"))
        ax.set_xlabel("hours since run start")
    else:
        ax.set_xlabel("seconds since run start")
    ax.set_title("rank processes alive (solid) and groups in the quorum (dashed)", fontsize=10, loc="left")


def draw_legs(axes: Axes, timeline: Timeline) -> None:
    """Each leg's start-up shaded, where each resume began, and how each leg ended."""
    wall = timeline.wall
    for begin, end in timeline.startups:
        for ax in axes.on_clock:
            ax.axvspan(begin, end, color="#bbbbbb", alpha=0.18, zorder=0)
        if end - begin > 0.04 * wall:  # labelled where the label fits
            axes.rank.text((begin + end) / 2, 0.5, f"start-up:\nRay, actors,\ngroups built\n{end - begin:.0f} s",
                           transform=axes.rank.get_xaxis_transform(), ha="center", va="center", fontsize=9,
                           color="#666666")
    for number, (start, ending) in enumerate(timeline.legs, start=1):
        if number > 1:  # where a resume began: the time axis runs on over every leg
            for ax in axes.on_clock:
                ax.axvline(start, color="black", linewidth=1.2, linestyle=(0, (6, 3)), zorder=3)
        # at two heights in turn: the label of a short leg does not run into the next one's
        axes.live.annotate(f"leg {number}" + (f": {ending}" if ending else ""),
                           xy=(start, 0.02 + 0.12 * (number % 2 == 0)), xycoords=("data", "axes fraction"),
                           xytext=(3, 0), textcoords="offset points", fontsize=8)


def draw_events(axes: Axes, timeline: Timeline) -> None:
    """The run's failures, recoveries, straggler decisions and checkpoints as vertical lines
    (a failure on the live-ranks panel only: the rank panel marks it on the lost rank's row),
    recovery windows shaded, nearby labels merged, and a legend of the kinds present."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    events = timeline.events
    first_failure = min((float(e["t"]) for e in events if e.get("kind") == K.RANK_FAILED), default=math.inf)
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
        for ax in (axes.live,) if category == "failure" else axes.on_clock:
            ax.axvline(t, color=colour, linestyle=style, linewidth=width, alpha=0.8, zorder=3)
        if event.get("kind") == K.RECOVERED and event.get("total_s"):
            for ax in axes.on_clock:
                ax.axvspan(t - float(event["total_s"]), t, color=colour, alpha=0.08, zorder=0)
        label = _event_label(event)
        if label:
            labels.append((t, label, colour))
    for t, texts, colour in merged_labels(labels, 0.02 * max(timeline.wall, 1e-9))[:24]:
        axes.rank.annotate("\n".join(texts[:3]) + (f"\n(+{len(texts) - 3} more)" if len(texts) > 3 else ""),
                           xy=(t, 1.0), xycoords=("data", "axes fraction"), xytext=(3, -3),
                           textcoords="offset points", va="top", ha="left", fontsize=8, color=colour,
                           bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "linewidth": 0})
    present.sort(key=list(EVENT_CATEGORIES).index)
    if present:
        handles = [Line2D([], [], color=EVENT_CATEGORIES[c][1], linestyle=EVENT_CATEGORIES[c][2],
                          marker="X" if c == "failure" else None, linewidth=1.6, label=EVENT_CATEGORIES[c][0])
                   for c in present]
        if any(e.get("kind") == K.RECOVERED and e.get("total_s") for e in events):
            handles.append(Patch(color=EVENT_CATEGORIES["recovery"][1], alpha=0.2, label="recovery window"))
        axes.side.legend(handles=handles, loc="upper left", fontsize=8, frameon=False, title="events",
                         title_fontsize=9, borderaxespad=0.0)


def draw_wall_time(ax: Any, breakdown: dict[str, float]) -> None:
    """Where the wall time went, as one bar under the event legend."""
    from matplotlib.ticker import PercentFormatter

    bar = ax.inset_axes([0.0, 0.0, 0.9, 0.3])
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


def _rank_matrix(steps: list[TimelineStep]) -> tuple[list[int], list[list[float]]]:
    """Sorted rank ids and a ranks x steps matrix of step seconds (NaN where a rank is absent)."""
    ranks = sorted({rank for step in steps for rank in step.rank_step_s})
    index = {rank: i for i, rank in enumerate(ranks)}
    matrix = [[math.nan] * len(steps) for _ in ranks]
    for j, step in enumerate(steps):
        for rank, seconds in step.rank_step_s.items():
            matrix[index[rank]][j] = seconds
    return ranks, matrix


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
    if kind == K.SILENT_CORRUPTION_FOUND:
        return f"computed wrong: rank {', '.join(map(str, event.get('suspects', [])))}"
    if kind == K.INTEGRITY_MISMATCH:
        return f"state differs: group {', '.join(map(str, event.get('suspects', [])))}"
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

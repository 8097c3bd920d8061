"""Post-run report: goodput breakdown table and a timeline PNG from a run's ``summary.json``.

``report(run)`` reads ``<storage>/<run-name>/summary.json`` (a local path or any fsspec URL)
through its schema (``RunSummary``), checks that the time breakdown adds up to the wall time,
and draws every leg's timeline (``timeline_figure``). ``main`` is the ``elastic report RUN
[--output PNG]`` command; for a mixture it also prints each source's samples.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

import fsspec
from fsspec.implementations.local import LocalFileSystem

from elastic.core.events import EventKind, redact_credentials
from elastic.core.goodput import goodput_of
from elastic.outputs.summary import SUMMARY_NAME, RunSummary
from elastic.outputs.timeline import goodput_breakdown, over_every_leg, whole_run
from elastic.outputs.timeline_figure import plot_timeline

DEFAULT_PNG_NAME = "timeline.png"


def _summary_path(run: str) -> str:
    """The summary.json path/URL for a run directory, a run URL, or the summary file itself."""
    run = os.fspath(run)
    if run.endswith(".json"):
        return run
    return run.rstrip("/") + "/" + SUMMARY_NAME


def load_summary(run: str) -> RunSummary:
    """Load a run's summary.json. ``run`` is a run directory or URL, or the summary.json itself."""
    path = _summary_path(run)
    try:
        with fsspec.open(path, "rb") as handle:
            text = handle.read()
    except FileNotFoundError as err:
        raise FileNotFoundError(
            f"no run summary found at {path!r} (looked for {SUMMARY_NAME} of run {run!r}); "
            "pass a run directory, a storage URL of one, or the summary.json path"
        ) from err
    except IsADirectoryError as err:
        raise FileNotFoundError(f"{path!r} is a directory, not a run summary") from err
    try:
        return RunSummary.read(text)
    except ValueError as err:
        raise ValueError(f"{path!r} does not hold a run summary: {err}") from None


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


def format_sources(samples: dict[str, int]) -> str:
    """An aligned text table of a mixture's sources: samples trained, and their share of all,
    to hold against the weights."""
    total = sum(samples.values())
    width = max(len("source"), *(len(name) for name in samples))
    lines = [f"{'source':<{width}}  {'samples':>10}  {'share':>7}"]
    for name, count in samples.items():
        share = f"{100.0 * count / total:6.1f}%" if total else "    n/a"
        lines.append(f"{name:<{width}}  {count:>10}  {share:>7}")
    return "\n".join(lines)


def format_traffic(summary: RunSummary) -> str | None:
    """What crossed groups over every leg's committed steps, per step, and the DiLoCo rounds
    committed, with the learners lost inside them; None for a run of one group (nothing
    crossed)."""
    legs = (*summary.earlier_legs, summary)
    steps = [entry for leg in legs for entry in leg.steps]
    total = sum(entry.cross_group_bytes for entry in steps)
    if not total:
        return None
    rounds = sum(entry.outer_step for entry in steps)
    line = f"across groups: {total / 1e6:.2f} MB over {len(steps)} committed steps, {total / len(steps) / 1e3:.1f} kB a step"
    if not rounds:
        return line
    events = [event for leg in legs for event in leg.events]
    redone = sum(event["kind"] == EventKind.ROUND_REDONE for event in events)
    dropped = [event for event in events if event["kind"] == EventKind.LEARNER_DROPPED]
    lost = (f" ({redone} redone, {sum(len(event['groups']) for event in dropped)} learners dropped, "
            f"{sum(event['returned_samples'] for event in dropped)} samples returned)" if redone or dropped else "")
    exchanged = sum(entry.outer_sum_s for entry in steps)
    hidden = (f", their exchanges {exchanged:.1f} s, {1 - sum(entry.outer_sum_exposed_s for entry in steps) / exchanged:.0%}"
              " hidden behind compute" if exchanged else "")
    return f"{line}; {rounds} DiLoCo outer steps{lost}{hidden}"


def _default_output(run: str, summary: RunSummary) -> str:
    summary_path = _summary_path(run)
    fs, stripped = fsspec.core.url_to_fs(summary_path)
    if isinstance(fs, LocalFileSystem):
        return os.path.join(os.path.dirname(os.path.abspath(stripped)), DEFAULT_PNG_NAME)
    name = summary.run
    if not name:
        parts = [p for p in summary_path.rstrip("/").split("/") if p]
        name = parts[-2] if len(parts) >= 2 else "run"
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", str(name)).strip("._") or "run"
    return os.path.join(os.getcwd(), f"{safe}-timeline.png")


def report(run: str, output: str | None = None) -> tuple[str, dict[str, float]]:
    """Load a run's summary, write its timeline PNG of every leg and return (png path, goodput
    breakdown over the whole run).

    The PNG goes to ``output`` if given, else ``timeline.png`` in the run directory when it is
    local, else ``<run>-timeline.png`` in the current directory."""
    return _report(run, load_summary(run), output)


def _report(run: str, summary: RunSummary, output: str | None) -> tuple[str, dict[str, float]]:
    breakdown = goodput_breakdown(over_every_leg(summary))
    path = output if output is not None else _default_output(run, summary)
    plot_timeline(whole_run(summary), path)
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
        summary = load_summary(args.run)
        path, breakdown = _report(args.run, summary, args.output)
    except (FileNotFoundError, ValueError) as err:
        print(f"elastic report: error: {redact_credentials(str(err))}", file=sys.stderr)
        return 1
    print(format_breakdown(breakdown))
    traffic = format_traffic(summary)
    if traffic:
        print(traffic)
    samples = summary.run_total.source_samples if summary.run_total else summary.source_samples
    if samples:
        print(format_sources(samples))
    print(f"timeline: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One run, one history: ``summary.json`` spans every leg of a run (its start, each resume
after a preemption, a failure or a stop), not only the last.

A leg's summary is what ``ElasticTrainer`` writes at its end (its steps, evaluations, events,
goodput and exit). The next leg of the same run reads it before it starts and keeps it, with
the legs before it, under ``earlier_legs``; ``run_total`` adds the legs up (wall time, the
time by category and so the goodput over the whole run, the steps discarded, each leg's
exit). The file is replaced whole (written beside it, then moved over it), so a leg that dies
before it writes leaves the record of the legs before it as it was; a record that does not
parse is moved aside, never overwritten.
"""

from __future__ import annotations

import json
import logging
import time

from elastic.core.goodput import goodput_of
from elastic.outputs.summary import SUMMARY_NAME, RunSummary, RunTotal

log = logging.getLogger("elastic.outputs.run_record")


def earlier_legs(fs, directory: str, run: str) -> list[RunSummary]:
    """The legs of ``run`` that a summary in ``directory`` records, oldest first (none for a
    new run)."""
    path = f"{directory}/{SUMMARY_NAME}"
    if not fs.exists(path):
        return []
    try:
        previous = RunSummary.read(fs.cat_file(path))
        if previous.run != run:
            raise ValueError(f"it records run {previous.run!r}")
    except (ValueError, UnicodeDecodeError) as error:
        aside = f"{directory}/summary-unreadable-{time.strftime('%Y%m%d-%H%M%S')}.json"
        fs.mv(path, aside)
        log.warning("the run's summary does not parse (%s): moved aside to %s", error, aside)
        return []
    return [*previous.earlier_legs, previous.model_copy(update={"earlier_legs": [], "run_total": None})]


def with_history(summary: RunSummary, earlier: list[RunSummary]) -> RunSummary:
    """This leg's ``summary`` with the legs before it, and the whole run's totals."""
    legs = [*earlier, summary]
    breakdown: dict[str, float] = {}
    sources: dict[str, int] = {}
    for leg in legs:
        for category, seconds in leg.time_breakdown.items():
            breakdown[category] = breakdown.get(category, 0.0) + seconds
        for source, samples in leg.source_samples.items():
            sources[source] = sources.get(source, 0) + samples
    total = RunTotal(
        legs=len(legs),
        wall_s=breakdown.get("wall_s", 0.0),
        goodput=goodput_of(breakdown),
        time_breakdown=breakdown,
        steps_committed=sum(leg.steps_committed for leg in legs),
        steps_discarded=sum(leg.steps_discarded for leg in legs),
        steps_rolled_back=sum(leg.steps_rolled_back for leg in legs),
        exits=[leg.exit for leg in legs],
        source_samples=sources,
    )
    return summary.model_copy(update={"leg": len(legs), "run_total": total, "earlier_legs": earlier})


def write_summary(fs, directory: str, summary: RunSummary) -> None:
    """Replace the summary whole: a leg killed mid-write leaves the one before it."""
    fs.makedirs(directory, exist_ok=True)
    staged = f"{directory}/.{SUMMARY_NAME}.writing"
    with fs.open(staged, "w") as handle:
        json.dump(summary.written(), handle, indent=1)
    fs.mv(staged, f"{directory}/{SUMMARY_NAME}")

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
from typing import Any

from elastic.core.goodput import goodput_of

log = logging.getLogger("elastic.outputs.run_record")

SUMMARY_NAME = "summary.json"


def earlier_legs(fs, directory: str, run: str) -> list[dict[str, Any]]:
    """The legs of ``run`` that a summary in ``directory`` records, oldest first (none for a
    new run)."""
    path = f"{directory}/{SUMMARY_NAME}"
    if not fs.exists(path):
        return []
    try:
        previous = json.loads(fs.cat_file(path))
        if not isinstance(previous, dict) or previous.get("run") != run:
            raise ValueError(f"it records run {previous.get('run') if isinstance(previous, dict) else None!r}")
    except (ValueError, UnicodeDecodeError) as error:
        aside = f"{directory}/summary-unreadable-{time.strftime('%Y%m%d-%H%M%S')}.json"
        fs.mv(path, aside)
        log.warning("the run's summary does not parse (%s): moved aside to %s", error, aside)
        return []
    legs = previous.pop("earlier_legs", [])
    previous.pop("run_total", None)
    return [*legs, previous]


def with_history(summary: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """This leg's ``summary`` with the legs before it, and the whole run's totals."""
    legs = [*earlier, summary]
    breakdown: dict[str, float] = {}
    for leg in legs:
        for category, seconds in leg.get("time_breakdown", {}).items():
            breakdown[category] = breakdown.get(category, 0.0) + seconds
    wall = breakdown.get("wall_s", 0.0)
    total = {
        "legs": len(legs),
        "wall_s": wall,
        "goodput": goodput_of(breakdown),
        "time_breakdown": breakdown,
        "steps_committed": sum(leg.get("steps_committed", 0) for leg in legs),
        "steps_discarded": sum(leg.get("steps_discarded", 0) for leg in legs),
        "steps_rolled_back": sum(leg.get("steps_rolled_back", 0) for leg in legs),
        "exits": [leg.get("exit") for leg in legs],
    }
    return {**summary, "leg": len(legs), "run_total": total, "earlier_legs": earlier}


def write_summary(fs, directory: str, summary: dict[str, Any]) -> None:
    """Replace the summary whole: a leg killed mid-write leaves the one before it."""
    fs.makedirs(directory, exist_ok=True)
    staged = f"{directory}/.{SUMMARY_NAME}.writing"
    with fs.open(staged, "w") as handle:
        json.dump(summary, handle, indent=1, default=str, allow_nan=False)
    fs.mv(staged, f"{directory}/{SUMMARY_NAME}")

"""Growing: a node added mid-run lets the second replica group place, heal and join, and the
committed steps are those of the fault-free reference, none lost or doubled."""

import json
import subprocess
import sys
from pathlib import Path

from elastic.config import build_config
from elastic.core.events import EventKind
from tests.reference import max_relative_difference, reference_run

SCRIPT = Path(__file__).with_name("grow_cluster.py")


def test_second_group_joins_when_a_node_is_added(tmp_path):
    # Long enough for the node and the group's actors to start (the group joins near step 50
    # on a loaded 2-core machine), short enough that float drift from the reference's
    # reduction order stays far below 1e-5 (it passes 1e-5 near step 300).
    steps = 200
    completed = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(steps)],
                               capture_output=True, text=True, timeout=540)
    assert completed.returncode == 0, completed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit"] == "completed"
    records = summary["steps"]
    assert [r["step"] for r in records] == list(range(steps)) and summary["steps_committed"] == steps
    assert summary["steps_discarded"] == 0

    [joined] = [e for e in summary["events"] if e["kind"] == EventKind.GROUP_JOINED and e["group"] == 1]
    assert joined["t"] > records[0]["t"], "the second group joined before training started"
    [healed] = [e for e in summary["events"] if e["kind"] == EventKind.GROUP_HEALED]
    assert (healed["group"], healed["source_group"]) == (1, 0)
    live = [r["live_groups"] for r in records]
    grown_at = live.index(2)
    assert 0 < grown_at and set(live[:grown_at]) == {1} and set(live[grown_at:]) == {2}

    reference, _ = reference_run(build_config(summary["config"]), steps)
    assert max_relative_difference(summary["losses"], reference) <= 1e-5

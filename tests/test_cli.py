"""`elastic train` with no arguments: the embedded default, end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_cli_default_runs_and_loss_falls(ray_cluster, tmp_path):
    # Join the session's Ray cluster through RAY_ADDRESS, as under `ray job submit`.
    env = dict(os.environ, RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    completed = subprocess.run(
        [sys.executable, "-m", "elastic", "train", "--quiet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    [summary_path] = list(Path(tmp_path, "runs").glob("*/summary.json"))
    summary = json.loads(summary_path.read_text())
    assert summary["exit"] == "completed"
    topology = summary["topology"]
    assert topology["groups"] >= 2 and topology["shard"] >= 2 and topology["tp"] >= 2
    assert summary["steps_committed"] == summary["config"]["steps"] == len(summary["losses"])
    losses = summary["losses"]
    assert losses[-1] < losses[0] - 1.0
    for key in ("run", "config", "steps_discarded", "final_loss", "wall_s", "tokens_per_s", "goodput", "events"):
        assert key in summary
    # The ranks run in Ray's working directory, not the driver's: the default storage must
    # still put their checkpoint files next to the driver's manifest.
    final = Path(summary["last_checkpoint"])
    assert final.is_relative_to(tmp_path / "runs")
    assert (final / "manifest.json").exists() and (final / ".metadata").exists()

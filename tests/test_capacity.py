"""Below the minimum at run time: the capacity check passes, a group cannot be placed, and
`elastic train` stops with a message naming the minimum and exits non-zero."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

pytestmark = pytest.mark.waits  # a driver process of its own waits out the capacity timeout

CONFIG = """
run_name = "below-minimum"
steps = 5
global_batch = 8
micro_batch = 2
[scaling]
cpus_per_rank = 0.75
[model]
dim = 32
n_layers = 2
n_heads = 4
ffn_hidden = 64
[data]
seq_len = 32
corpus_tokens = 40000
[fault_tolerance]
capacity_timeout_s = 1.0
first_step_deadline_s = 2.0
"""


def test_second_group_cannot_be_placed_stops_and_cli_exits_nonzero(ray_head, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    # Hold all but one CPU: one 0.75-CPU group places, the second never does. The capacity
    # check counts the cluster's totals, so the job starts and meets this at run time.
    hold = placement_group([{"CPU": ray.cluster_resources()["CPU"] - 1.0}])
    ray.get(hold.ready(), timeout=60)
    env = ray_head.driver_env()
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "elastic", "train", "--config", str(config), "--groups", "2:2", "--shard", "1",
             "--tp", "1", "--storage", str(tmp_path / "runs"), "--quiet"],
            env=env, capture_output=True, text=True, timeout=300,
        )
    finally:
        remove_placement_group(hold)
    assert completed.returncode == 1, completed.stderr[-3000:]
    summary = json.loads(Path(tmp_path, "runs", "below-minimum", "summary.json").read_text())
    exit_reason = summary["exit"]
    assert exit_reason.startswith("stopped: below the minimum of 2 live replica group(s)"), exit_reason
    assert "1: 'placing'" in exit_reason
    assert summary["steps_committed"] == 0
    assert exit_reason in completed.stdout

"""bench/gpu_check.py on CPU (``--quick``): every part the suite can afford runs its smallest
form and lands in the table, so the script a GPU machine runs for minutes has not rotted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Each part, and the rows it writes, in a test of its own: the script then gives the part its
# own time limit. Given all of them under one budget, as it was, the parts before control_plane
# left it 45 s of its 150 on a loaded machine. stragglers is bench/stragglers.py's own main, four
# Ray runs (45 s here): left to that bench. throughput computes, in the computing lane; the
# others start a Ray and wait on it (control_plane's null ranks sleep out their steps, and
# its figure here is not the GPU host's: the suite reads the row, not the verdict).
PARTS = {
    "throughput": ["| tokens/s, product / plain script", "| in-memory tier every step"],
    "integrity": ["| integrity fingerprint at every = "],
    "gloo_ops": ["| gloo reduce_scatter_tensor on cpu tensors, 2 processes on one device | finds out | works |"],
    "control_plane": ["| driver CPU per steady-state step"],
}
COMPUTING = {"throughput"}
# shared_gpu, experts, context, precision, heal_transport and torchtitan (25 s to two minutes
# each here, and torchtitan's package is not the suite's) are rehearsed by hand before a GPU run:
# python bench/gpu_check.py --device cpu --quick --out /tmp/check --only shared_gpu,experts,context,precision,heal_transport


def gpu_check(out: Path, part: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, str]:
    """The script's run of ``part`` alone, and its table. Not bounded here: a part that hangs is
    its "failed (timed out ...)" row once the part's own limit ends it."""
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--quick", "--out", str(out),
                          "--only", part], cwd=ROOT, env=env, capture_output=True, text=True)
    return run, (out / "gpu_check.md").read_text()


@pytest.mark.parametrize("part", [part if part in COMPUTING else pytest.param(part, marks=pytest.mark.waits)
                                  for part in PARTS])
def test_the_part_runs_on_cpu_and_lands_in_the_table(ray_head, tmp_path, part):
    # The part's Ray's workers fork from the test run's (elastic/testing/forked_ray_workers.py).
    run, table = gpu_check(tmp_path, part, ray_head.forking_env())
    assert "failed (" not in table, table + run.stdout
    assert f"--only {part} " in table
    for row in PARTS[part]:
        assert row in table, table
    # Verdicts are the GPU run's business; here the exit status only says some figure missed its goal.
    assert run.returncode in (0, 1), run.stderr


def test_float8_is_skipped_on_cpu_with_its_reason(tmp_path):
    run, table = gpu_check(tmp_path, "float8")
    assert "skipped float8: float8 is refused on CPU ranks" in run.stdout
    assert "- float8: float8 is refused on CPU ranks" in table
    assert run.returncode == 0, run.stderr

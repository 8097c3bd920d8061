"""``ray job submit`` against a Ray head started with ``ray start`` as a user starts one
(elastic/testing/ray_head.py), with the dashboard, whose job API the command talks to: a short run
succeeds and its logs show progress; submitting the same run again resumes it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from elastic.testing.ray_head import RAY, RayHead

pytestmark = pytest.mark.waits  # a head of its own, two jobs submitted, each with Ray's plain start-up

REPO = Path(__file__).resolve().parents[1]
# Keep the upload small: the CI virtualenv lives in the repository, and so may a checkout's
# git-ignored .gpu (58 MB of wheels here, zipped and unpacked again for each of the three jobs).
RUNTIME_ENV = {"excludes": [".git", ".venv", ".gpu", "runs", ".pytest_cache", "**/__pycache__", "*.egg-info"]}


@pytest.fixture(scope="module")
def job_server():
    """A head of this module's own, with the dashboard: the lanes' heads run without it."""
    head = RayHead(num_cpus=8, job_server=True)
    yield head
    leftovers = head.stop()
    assert not leftovers, f"processes of the job server's Ray head outlived it: {leftovers}"


def submitted(head: RayHead, *train_args: str) -> subprocess.CompletedProcess:
    """``ray job submit`` of ``python -m elastic train ...``, done."""
    command = [*RAY, "job", "submit", "--address", head.dashboard, "--working-dir", str(REPO),
               "--runtime-env-json", json.dumps(RUNTIME_ENV), "--", "python", "-m", "elastic", "train", *train_args]
    return subprocess.run(command, env=head.env, capture_output=True, text=True, timeout=400)


def submit(head: RayHead, *train_args: str) -> str:
    """``ray job submit`` of ``python -m elastic train ...``; returns the job's logs."""
    done = submitted(head, *train_args)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, f"ray job submit failed:\n{output}"
    return output


def test_a_job_that_would_keep_its_run_in_its_own_unpacked_files_is_refused_naming_storage(job_server):
    """No ``--storage``: the driver starts in Ray's copy of the working directory, and ``./runs``
    there would be deleted with it, and never found by a job submitted again."""
    done = submitted(job_server, "--steps", "2")
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output
    [line] = {line for line in output.splitlines() if line.startswith("elastic: ")}  # a failed job's logs come twice
    assert line.startswith("elastic: invalid config: storage: ") and "/runtime_resources/" in line, line
    assert "is in Ray's runtime directory" in line and "--run-name" in line, line


def test_submit_then_resubmit_resumes(job_server, tmp_path):
    storage = tmp_path / "runs"
    args = ["--groups", "1", "--shard", "1", "--tp", "1", "--storage", str(storage), "--run-name", "submitted",
            "--checkpoint-every", "3"]
    summary_path = storage / "submitted" / "summary.json"

    first = submit(job_server, "--steps", "6", *args)
    assert "6/6" in first, f"no progress in the job's logs:\n{first}"
    assert "run submitted: completed; 6 steps committed" in first
    assert json.loads(summary_path.read_text())["resumed_from_step"] is None

    second = submit(job_server, "--steps", "10", *args)
    assert "10/10" in second, f"no progress in the job's logs:\n{second}"
    summary = json.loads(summary_path.read_text())
    assert summary["resumed_from_step"] == 6, "the second submission did not resume from the first's checkpoint"
    assert summary["steps_committed"] == 4
    assert [record["step"] for record in summary["steps"]] == [6, 7, 8, 9]

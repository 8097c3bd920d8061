"""Checkpoints on real Ray actors, to a local directory and to a real S3 API server (moto)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from checkpointing.catalog import STEP_DIR
from checkpointing.lease import LeaseDirectory, lease_url
from elastic import ElasticTrainer
from elastic.core.events import EventKind
from tests.events import on_events
from elastic.testing.loopback import wait_for
from elastic.testing.paced import paced_model
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import tiny_config

TOLERANCE = 1e-5


def kinds(summary, kind):
    return [event for event in summary["events"] if event["kind"] == kind]


def committed_steps(summary):
    return [event["step"] for event in kinds(summary, "checkpoint-committed")]


def continues_reference(result, config, start, tolerance=TOLERANCE):
    reference, _ = reference_run(config, config.steps)
    return max_relative_difference(result.losses, reference[start:]) <= tolerance


def test_stop_and_resume_continues_the_same_losses_and_skips_a_corrupt_checkpoint(ray_cluster, tmp_path):
    # The first two legs upload through processes of their own (the default on CUDA; CPU ranks
    # upload on a thread unless told otherwise), the last two on a thread.
    process = {"checkpoint__upload": "process"}
    first = ElasticTrainer(tiny_config(tmp_path, shard=2, steps=10, checkpoint__every=5, **process)).fit()
    assert first.ok and first.summary["resumed_from_step"] is None
    assert committed_steps(first.summary) == [5, 10]
    checkpoints = Path(first.run_dir, "checkpoints")
    manifest = json.loads((checkpoints / "step-00000010" / "manifest.json").read_text())
    assert manifest["step"] == 10 and manifest["cursor"]["position"] == 80
    assert {f["name"] for f in manifest["files"]} == {".metadata", "__0_0.distcp", "__1_0.distcp"}

    config = tiny_config(tmp_path, shard=2, steps=20, checkpoint__every=5, **process)
    second = ElasticTrainer(config).fit()
    assert second.ok and second.summary["resumed_from_step"] == 10
    assert [r["step"] for r in second.summary["steps"]] == list(range(10, 20))
    assert continues_reference(second, config, 10)
    # keep=3: the oldest committed checkpoint was deleted
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000010", "step-00000015", "step-00000020"]

    shard = checkpoints / "step-00000020" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    config = tiny_config(tmp_path, shard=2, steps=25, checkpoint__every=5)
    third = ElasticTrainer(config).fit()
    assert third.ok and third.summary["resumed_from_step"] == 15
    [skipped] = kinds(third.summary, "checkpoint-skipped")
    assert skipped["step"] == 20 and "__1_0.distcp" in skipped["reason"]
    assert continues_reference(third, config, 15)

    # Other bytes under step 25's shard, its manifest rewritten to match them (what someone
    # who can write the bucket but lacks the signing key can do): it verifies, but does not
    # load. It is moved aside and step 20 loaded into the same ranks, none replaced.
    shard = checkpoints / "step-00000025" / "__1_0.distcp"
    forged = os.urandom(shard.stat().st_size)
    shard.write_bytes(forged)
    manifest_path = checkpoints / "step-00000025" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for record in manifest["files"]:
        if record["name"] == "__1_0.distcp":
            record["sha256"] = hashlib.sha256(forged).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    config = tiny_config(tmp_path, shard=2, steps=30, checkpoint__every=5)
    fourth = ElasticTrainer(config).fit()
    assert fourth.ok, fourth.exit
    assert fourth.summary["resumed_from_step"] == 20
    [skipped] = kinds(fourth.summary, "checkpoint-skipped")
    assert skipped["step"] == 25 and "does not load" in skipped["reason"]
    assert not kinds(fourth.summary, "rank-failed") and not kinds(fourth.summary, "rank-evicted")
    assert (checkpoints / "corrupt-step-00000025").is_dir()
    assert continues_reference(fourth, config, 20)

    # One run, one history: every leg's record is kept, and the report draws them all.
    from elastic.outputs.summary import RunSummary
    from elastic.outputs.timeline import whole_run

    summary = json.loads(Path(fourth.run_dir, "summary.json").read_text())
    assert summary["leg"] == 4 and [leg["resumed_from_step"] for leg in summary["earlier_legs"]] == [None, 10, 15]
    assert [len(leg["losses"]) for leg in summary["earlier_legs"]] == [10, 10, 10]
    assert summary["earlier_legs"][0]["losses"] == first.losses
    total = summary["run_total"]
    assert total["legs"] == 4 and total["steps_committed"] == 40 and total["exits"] == ["completed"] * 4
    assert total["wall_s"] == pytest.approx(sum(leg["time_breakdown"]["wall_s"] for leg in [*summary["earlier_legs"], summary]))
    drawn = whole_run(RunSummary.model_validate(summary))
    assert len(drawn.steps) == 40 and [step.t for step in drawn.steps] == sorted(step.t for step in drawn.steps)


def test_resume_into_another_topology_through_s3(ray_cluster, tmp_path, s3_server):
    storage = {"storage": s3_server.url("runs"), "checkpoint__s3_endpoint_url": s3_server.endpoint_url}
    saved = ElasticTrainer(tiny_config(tmp_path, groups=2, shard=2, steps=10, checkpoint__every=5, **storage)).fit()
    assert saved.ok and committed_steps(saved.summary) == [5, 10]
    assert saved.summary["topology"]["groups"] == 2
    assert s3_server.filesystem().exists(f"{s3_server.bucket}/runs/test/checkpoints/step-00000010/manifest.json")

    config = tiny_config(tmp_path, groups=1, tp=2, steps=16, checkpoint__every=5, **storage)
    resumed = ElasticTrainer(config).fit()
    assert resumed.ok and resumed.summary["resumed_from_step"] == 10
    assert resumed.summary["topology"] == {"groups": 1, "pp": 1, "shard": 1, "cp": 1, "tp": 2, "ep": 1, "ranks": 2}
    assert continues_reference(resumed, config, 10)


@pytest.mark.waits  # steps paced to 0.3 s
def test_a_single_group_without_the_memory_tier_reruns_from_the_initial_state_then_from_the_latest_checkpoint(
        ray_cluster, tmp_path):
    """Losing the only copy of the state (no peer group, the memory tier off) costs the steps
    since the last checkpoint, or since step 0 before the first: the seed determines that state."""
    config = tiny_config(tmp_path, shard=2, steps=20, checkpoint__every=5, checkpoint__memory_every=0,
                         fault_tolerance__inject="kill:rank=1,step=3;kill:rank=1,step=12")
    # Steps of at least 0.3 s leave step 10's upload the time to commit before step 12.
    result = ElasticTrainer(config, model_fn=paced_model(config, 0.3)).fit()
    assert result.ok, result.exit
    [restart] = kinds(result.summary, "restored-initial-state")
    assert restart["rolled_back_steps"] == 3
    [restored] = kinds(result.summary, "restored-from-checkpoint")
    assert restored["step"] == 10 and restored["rolled_back_steps"] == 2
    [_, recovered] = kinds(result.summary, "recovered")
    assert recovered["heal_s"] >= restored["seconds"] > 0
    assert result.summary["steps_rolled_back"] == 5
    assert [r["step"] for r in result.summary["steps"]] == list(range(20))
    assert continues_reference(result, config, 0)


@pytest.mark.waits  # an outage; steps paced to 0.1 s
def test_s3_outage_during_upload_is_not_committed_and_a_later_checkpoint_succeeds(ray_cluster, tmp_path, own_s3_server):
    # The outage spans s3fs's retries (about 2 s of backoff, then a save fails) and the
    # server's restart: over by step 12 on a quiet machine, and the final checkpoint commits
    # after it however late the failure comes.
    steps = 40
    storage = {"storage": own_s3_server.url("runs"), "checkpoint__s3_endpoint_url": own_s3_server.endpoint_url}
    # One botocore attempt (s3fs still retries with backoff): the outage outlasts the retries.
    config = tiny_config(tmp_path, groups=1, shard=2, steps=steps, checkpoint__every=4, checkpoint__s3_max_attempts=1,
                         **storage)
    # The server goes down as the first checkpoint commits and comes back once a save has
    # failed. Steps of at least 0.1 s bound how many steps s3fs's retries span on any machine.
    outage = []

    def down(_committed):
        if not outage:
            outage.append("down")
            own_s3_server.stop()

    def back_up(_failed):
        if outage == ["down"]:
            outage.append("up")
            own_s3_server.start()

    with on_events({EventKind.CHECKPOINT_COMMITTED: down, EventKind.CHECKPOINT_FAILED: back_up}):
        result = ElasticTrainer(config, model_fn=paced_model(config, 0.1)).fit()
    assert result.ok, result.exit
    failed = [e["step"] for e in kinds(result.summary, "checkpoint-failed")]
    committed = committed_steps(result.summary)
    assert committed[0] == 4 and failed, "the outage should have failed an upload"
    assert not set(failed) & set(committed)
    assert max(committed) > max(failed), "a checkpoint after the outage should commit"
    assert [r["step"] for r in result.summary["steps"]] == list(range(steps))
    assert continues_reference(result, config, 0)
    fs = own_s3_server.filesystem()
    last = f"{own_s3_server.bucket}/runs/test/checkpoints/step-{max(committed):08d}/manifest.json"
    assert fs.exists(last)


def lease_expired(run_url: str, options) -> bool:
    """Whether the run's newest lease record has ended, as the next driver will judge it."""
    records = LeaseDirectory(lease_url(run_url), options)
    return not records.read(max(records.generations())).live(time.time())


def driver(tmp_path, ray_head, config):
    """``elastic train`` in its own process, joined to the session's cluster like a Ray job. Its
    output goes to ``tmp_path/driver.log``: a pipe nobody reads until the end would block the
    driver once full."""
    config_file = tmp_path / "job.yaml"
    config_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    env = ray_head.driver_env()
    with open(tmp_path / "driver.log", "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "elastic", "train", "--quiet", "--config", str(config_file)],
            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
        )


@pytest.mark.waits  # a driver process of its own; the lease expires
def test_driver_killed_while_an_upload_is_in_flight_resumes_from_the_previous_commit(ray_head, tmp_path, own_s3_server):
    fs = own_s3_server.filesystem()
    root = f"{own_s3_server.bucket}/runs/job/checkpoints"
    s3 = {"run_name": "job", "storage": own_s3_server.url("runs"),
          "checkpoint__s3_endpoint_url": own_s3_server.endpoint_url}
    job_config = tiny_config(tmp_path, shard=2, steps=400, checkpoint__every=5, checkpoint__lease_ttl_s=4, **s3)
    job = driver(tmp_path, ray_head, job_config)
    wait_for(lambda: fs.exists(f"{root}/step-00000005/manifest.json"), 300, "the first commit", interval=0.05)

    def next_save_started() -> bool:
        # Step 10's save, or, where step 5's upload was still out at step 10, the first
        # boundary's after it ended (the save deferred until then): the newest step directory,
        # which retention never deletes, whatever steps the run has saved since.
        steps = {int(match.group(1)): path for path in fs.ls(root, refresh=True)
                 if (match := STEP_DIR.match(path.rsplit("/", 1)[-1]))}
        return max(steps) > 5 and bool(fs.ls(steps[max(steps)], refresh=True))

    # The next save's first files are out: stop the storage mid-upload. (Should the save
    # commit in the moment between, the run resumes from it: what the test computes below.)
    wait_for(next_save_started, 300, "the next save's first files", interval=0.05)
    own_s3_server.pause()
    job.kill()
    job.wait()
    own_s3_server.resume()
    run_url = own_s3_server.url("runs", "job")
    wait_for(lambda: lease_expired(run_url, job_config.checkpoint.storage_options()), 60,
             "the dead driver's run lease to expire", interval=0.1)
    fs.invalidate_cache()
    committed = sorted(p for p in fs.ls(root) if fs.exists(f"{p}/manifest.json"))
    last_committed = int(committed[-1].rsplit("-", 1)[-1])

    config = tiny_config(tmp_path, shard=2, steps=last_committed + 5, checkpoint__every=5, **s3)
    resumed = ElasticTrainer(config).fit()
    assert resumed.ok and resumed.summary["resumed_from_step"] == last_committed
    assert continues_reference(resumed, config, last_committed)
    fs.invalidate_cache()
    assert all(fs.exists(f"{p}/manifest.json") for p in fs.ls(root)), "partial checkpoints are cleaned up"


@pytest.mark.waits  # a driver process of its own
def test_sigterm_checkpoints_within_the_grace_period_and_the_rerun_resumes(ray_head, tmp_path):
    storage = str(tmp_path / "runs")
    job = driver(tmp_path, ray_head, tiny_config(tmp_path, shard=2, steps=2000, checkpoint__every=50, run_name="job"))
    summary_path = Path(storage, "job", "summary.json")
    checkpoints = Path(storage, "job", "checkpoints")
    wait_for(lambda: (checkpoints / "step-00000050" / "manifest.json").exists(), 300, "the step-50 commit",
             interval=0.05)
    job.send_signal(signal.SIGTERM)
    job.wait(timeout=120)
    assert job.returncode == 143, (tmp_path / "driver.log").read_text()[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["exit"] == "preempted"
    stopped_at = summary["steps"][-1]["step"] + 1
    assert 50 < stopped_at < 2000
    assert committed_steps(summary)[-1] == stopped_at
    assert (checkpoints / f"step-{stopped_at:08d}" / "manifest.json").exists()

    config = tiny_config(tmp_path, shard=2, steps=stopped_at + 3, run_name="job")
    resumed = ElasticTrainer(config).fit()
    assert resumed.ok and resumed.summary["resumed_from_step"] == stopped_at
    assert continues_reference(resumed, config, stopped_at)

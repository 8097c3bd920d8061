"""What a pre-training run needs, on real Ray actors: a learning-rate schedule, clipping by
the global gradient norm, generators carried through faults and resumes, and held-out
evaluation. Each must keep the math independent of the number of live groups, of faults and
of resumes."""

from __future__ import annotations

import pytest

from elastic import ElasticTrainer
from elastic.core.events import EventKind
from elastic.testing.paced import paced_model
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_trace
from tests.tiny import FAST_DETECTION, tiny_config

# Clipping at 0.5 is active on every step of these runs (the tiny model's norm is ~1.3-1.6).
CLIPPED = {"optimizer__clip_grad_norm": 0.5, "eval__every": 4}


@pytest.mark.parametrize("layouts", [[(1, 2, 2), (2, 2, 1), (4, 1, 1)]], ids=["1x(2x2) 2x(2x1) 4x(1x1)"])
def test_clipped_runs_with_1_2_and_4_groups_commit_the_same_losses_norms_and_eval_losses(ray_cluster, tmp_path,
                                                                                       layouts):
    steps = 12
    runs = {}
    for groups, shard, tp in layouts:
        config = tiny_config(tmp_path, groups=groups, min_groups=groups, shard=shard, tp=tp, steps=steps,
                             run_name=f"clip-{groups}", **CLIPPED)
        result = ElasticTrainer(config).fit()
        assert result.ok, result.exit
        assert {record["live_groups"] for record in result.summary["steps"]} == {groups}
        runs[groups] = result.summary
    reference = reference_trace(config, steps)
    for groups, summary in runs.items():
        records = summary["steps"]
        assert max_relative_difference(summary["losses"], reference.losses) <= 1e-5, groups
        assert max_relative_difference([r["grad_norm"] for r in records], reference.grad_norms) <= 1e-5, groups
        assert all(r["grad_clip_scale"] < 1.0 for r in records), "clipping must be active to prove anything"
        assert [r["lr"] for r in records] == pytest.approx(reference.lrs, rel=1e-12)
    # the held-out loss: the same whatever the number of groups, and falling as the model learns
    evals = {groups: [(e["step"], e["loss"]) for e in summary["eval"]] for groups, summary in runs.items()}
    assert [step for step, _ in evals[1]] == [4, 8, 12]
    for groups in (2, 4):
        assert [step for step, _ in evals[groups]] == [4, 8, 12]
        assert max_relative_difference([loss for _, loss in evals[groups]], [loss for _, loss in evals[1]]) <= 1e-5
    eval_losses = [loss for _, loss in evals[1]]
    assert eval_losses[0] > eval_losses[1] > eval_losses[2]
    assert runs[1]["final_eval_loss"] == eval_losses[-1]


# Dropout, a warmup + cosine schedule and clipping together, at a fixed layout (two groups of
# two shards, both required): every random draw comes from the ranks' generators.
RECIPE = {
    "groups": 2, "min_groups": 2, "shard": 2, "model__dropout": 0.2,
    "optimizer__warmup_steps": 3, "optimizer__schedule": "cosine", "optimizer__decay_steps": 12,
    "optimizer__min_lr_ratio": 0.1, "optimizer__clip_grad_norm": 1.0, **FAST_DETECTION,
}
STEPS = 12


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("uninterrupted"), steps=STEPS, **RECIPE)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    return result.summary


def test_dropout_is_active_and_the_lr_follows_the_schedule(uninterrupted, tmp_path):
    config = tiny_config(tmp_path, steps=STEPS, **RECIPE)
    without_dropout = reference_trace(config.model_copy(update={"model": config.model.model_copy(update={"dropout": 0.0})}),
                                      STEPS)
    assert max_relative_difference(uninterrupted["losses"], without_dropout.losses) > 1e-3
    schedule = config.lr_schedule
    assert [r["lr"] for r in uninterrupted["steps"]] == [schedule.lr(step) for step in range(STEPS)]
    assert uninterrupted["final_lr"] == schedule.lr(STEPS - 1)


def test_dropout_killed_healed_stopped_and_resumed_commits_the_uninterrupted_losses_at_the_scheduled_lr(
        uninterrupted, tmp_path):
    # The first leg loses a rank and heals its group from the peer group (both groups are
    # required, so the leg waits for it); the second resumes from the first's checkpoint.
    first = ElasticTrainer(tiny_config(tmp_path, steps=6, fault_tolerance__inject="kill:rank=1,step=3", **RECIPE)).fit()
    assert first.ok, first.exit
    assert first.summary["steps_discarded"] >= 1
    assert [e["group"] for e in first.summary["events"] if e["kind"] == EventKind.GROUP_HEALED] == [0]
    resumed = ElasticTrainer(tiny_config(tmp_path, steps=STEPS, **RECIPE)).fit()
    assert resumed.ok and resumed.summary["resumed_from_step"] == 6
    assert max_relative_difference(first.losses + resumed.losses, uninterrupted["losses"]) <= 1e-5
    lrs = [r["lr"] for r in first.summary["steps"] + resumed.summary["steps"]]
    assert lrs == [r["lr"] for r in uninterrupted["steps"]]


@pytest.mark.parametrize("memory_every,restored_kind,restored_steps", [
    (0, EventKind.RESTORED_FROM_CHECKPOINT, (4,)),
    # step 7's copies, or step 6's if a buddy's copy of step 7 was still on its way
    (1, EventKind.RESTORED_FROM_MEMORY, (6, 7)),
])
def test_dropout_restored_after_losing_every_copy_commits_the_uninterrupted_losses(
        uninterrupted, tmp_path, memory_every, restored_kind, restored_steps):
    # Both copies of shard position 0 die at step 7: no peer holds it. With the memory tier
    # the state of step 7 comes back from the buddies' and the survivors' host memory; without
    # it the run rolls back to the checkpoint of step 4, and reruns steps 4-6. Generators
    # included either way. Steps of at least 0.3 s leave that checkpoint's upload the time to
    # commit before step 7 on a busy machine too.
    inject = "kill:rank=0,step=7;kill:rank=2,step=7"
    config = tiny_config(tmp_path, steps=STEPS, fault_tolerance__inject=inject, checkpoint__every=4,
                         checkpoint__memory_every=memory_every, **RECIPE)
    result = ElasticTrainer(config, model_fn=paced_model(config, 0.3)).fit()
    assert result.ok, result.exit
    [restored] = [e for e in result.summary["events"] if e["kind"] == restored_kind]
    assert restored["step"] in restored_steps and restored["rolled_back_steps"] == 7 - restored["step"]
    assert not [e for e in result.summary["events"] if e["kind"] == EventKind.RNG_RESEEDED]
    assert max_relative_difference(result.losses, uninterrupted["losses"]) <= 1e-5

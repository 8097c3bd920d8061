"""End-to-end training on real Ray actors with real gloo process groups."""

import pytest

from elastic import ElasticTrainer
from tests.reference import max_relative_difference, reference_run
from tests.tiny import tiny_config

STEPS = 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    losses, _ = reference_run(tiny_config(tmp_path_factory.mktemp("ref")), STEPS)
    return losses


@pytest.mark.parametrize("groups,shard,tp", [(1, 2, 1), (1, 1, 2), (2, 1, 2), (2, 2, 1)])
def test_losses_match_single_process_reference(ray_cluster, tmp_path, reference, groups, shard, tp):
    config = tiny_config(tmp_path, groups=groups, min_groups=groups, shard=shard, tp=tp, steps=STEPS)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert result.summary["topology"] == {"groups": groups, "shard": shard, "tp": tp, "ranks": groups * shard * tp}
    assert max_relative_difference(result.losses, reference) <= 1e-4
    assert result.summary["steps_committed"] == STEPS
    assert result.losses[-1] < result.losses[0] - 0.5


def test_loss_does_not_depend_on_the_number_of_groups(ray_cluster, tmp_path):
    runs = {}
    for groups in (1, 2, 4):
        config = tiny_config(tmp_path, groups=groups, min_groups=groups, steps=STEPS, run_name=f"split-{groups}")
        result = ElasticTrainer(config).fit()
        assert result.ok, result.exit
        runs[groups] = result.losses
    assert max_relative_difference(runs[2], runs[1]) <= 1e-5
    assert max_relative_difference(runs[4], runs[1]) <= 1e-5


def test_bf16_trains_on_two_groups_of_shard_2_by_tp_2(ray_cluster, tmp_path, reference):
    config = tiny_config(tmp_path, groups=2, min_groups=2, shard=2, tp=2, steps=STEPS, compute__precision="bf16",
                         compute__activation_checkpointing="full")
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert result.summary["topology"]["ranks"] == 8
    assert result.losses[-1] < result.losses[0] - 0.5
    # bf16 is in effect (not the fp32 losses), and tracks them closely
    assert 1e-4 < max_relative_difference(result.losses, reference) < 0.05


def test_compiled_blocks_train_the_same_model(ray_cluster, tmp_path, reference):
    config = tiny_config(tmp_path, groups=1, shard=2, steps=STEPS, compute__compile=True)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    # Inductor's fused kernels sum in another order than eager ones.
    assert max_relative_difference(result.losses, reference) <= 1e-4


def test_a_diverging_run_stops_as_diverged_and_commits_no_nonfinite_step(ray_cluster, tmp_path):
    import json
    import math

    # two groups of two: the ranks of every group discard the same step, together
    config = tiny_config(tmp_path, groups=2, min_groups=2, shard=2, steps=8, optimizer__lr=1e30,
                         optimizer__max_nonfinite_steps=2, run_name="diverging")
    result = ElasticTrainer(config).fit()
    assert result.exit.startswith("diverged: 2 steps in a row"), result.exit
    assert result.summary["steps_committed"] < 8
    assert all(math.isfinite(loss) for loss in result.losses)
    nonfinite = [event for event in result.summary["events"] if event["kind"] == "nonfinite-step"]
    assert len(nonfinite) == 2 and nonfinite[0]["step"] == nonfinite[1]["step"] == result.summary["steps_committed"]
    with open(result.summary_path) as handle:
        json.loads(handle.read(), parse_constant=lambda name: pytest.fail(f"summary.json holds a bare {name}"))


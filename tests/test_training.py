"""End-to-end training on real Ray actors with real gloo process groups."""

import re

import pytest
import torch

from elastic import ElasticTrainer
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import tiny_config

STEPS = 20


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    losses, _ = reference_run(tiny_config(tmp_path_factory.mktemp("ref")), STEPS)
    return losses


# Two groups of shard 2, and 1, 2 and 4 groups against each other at 1e-5: tests/test_training_recipe.py.
# Two groups of tp 2 at 1e-5, before and after both copies of a TP position are killed:
# tests/test_faults.py's sequence-parallel test.
@pytest.mark.parametrize("groups,shard,tp", [(1, 2, 1), (1, 1, 2)])
def test_losses_match_single_process_reference(ray_cluster, tmp_path, reference, groups, shard, tp):
    config = tiny_config(tmp_path, groups=groups, min_groups=groups, shard=shard, tp=tp, steps=STEPS)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert result.summary["topology"] == {"groups": groups, "pp": 1, "shard": shard, "cp": 1, "tp": tp, "ep": 1,
                                         "ranks": groups * shard * tp}
    assert max_relative_difference(result.losses, reference) <= 1e-4
    assert result.summary["steps_committed"] == STEPS
    assert result.losses[-1] < result.losses[0] - 0.5


def test_bf16_trains_on_two_groups_of_shard_2_by_tp_2(ray_cluster, tmp_path, reference):
    # Half the steps: bf16 steps on CPU are slow, and ten take the loss 1.3 below its start.
    steps = STEPS // 2
    config = tiny_config(tmp_path, groups=2, min_groups=2, shard=2, tp=2, steps=steps, compute__precision="bf16",
                         compute__activation_checkpointing="full")
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert result.summary["topology"]["ranks"] == 8
    assert len(result.losses) == steps and result.losses[-1] < result.losses[0] - 0.5
    # bf16 is in effect (not the fp32 losses), and tracks them closely
    assert 1e-4 < max_relative_difference(result.losses, reference[:steps]) < 0.05


def test_compiled_blocks_train_the_same_model_under_selective_recomputation(ray_cluster, tmp_path, reference):
    config = tiny_config(tmp_path, groups=1, shard=2, steps=STEPS, compute__compile=True,
                         compute__activation_checkpointing="selective")
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



def test_huggingface_style_samples_with_ignored_labels_train_the_huggingface_mean_loss(ray_cluster, tmp_path):
    """Dict samples whose prompts are ignored (-100), split over 2 groups of 2 shards: every
    step's loss, and the held-out loss at the end, are HuggingFace's mean over the labels
    that count, as one process computes it over the whole batch."""
    import torch

    from elastic.setup.hooks import model_args
    from tests.reference import huggingface_loss, reference_trace
    from tests.test_train_step import PromptAndAnswer
    from workers.model import Transformer

    config = tiny_config(tmp_path, groups=2, min_groups=2, shard=2, steps=8, data__seq_len=16, eval__every=8,
                         eval__samples=12)
    train, held_out = PromptAndAnswer(64, seed=1), PromptAndAnswer(12, seed=2)
    result = ElasticTrainer(config, dataset=train, eval_dataset=held_out).fit()
    assert result.ok, result.exit
    reference = reference_trace(config, 8, dataset=train)
    assert max_relative_difference(result.losses, reference.losses) <= 1e-5
    model = Transformer(model_args(config))
    with torch.no_grad():
        for param, trained in zip(model.parameters(), reference.params):
            param.copy_(trained)
        expected = huggingface_loss(model, [held_out[i] for i in range(12)]).item()
    [evaluation] = result.summary["eval"]
    assert abs(evaluation["loss"] - expected) <= 1e-5 * expected



def test_an_error_in_the_users_loss_stops_the_run_with_it_and_its_frame_evicting_nobody(ray_cluster, tmp_path):
    from tests.test_train_step import broken_loss

    config = tiny_config(tmp_path, groups=2, min_groups=2, steps=4)
    result = ElasticTrainer(config, loss_fn=broken_loss).fit()
    where = f"{broken_loss.__code__.co_filename}:{broken_loss.__code__.co_firstlineno + 1} in broken_loss"
    assert result.exit.startswith("stopped: step 0 failed (own-error, ranks [0, 1]): ranks [0, 1] raised the same "
                                  "error: RuntimeError: Expected target size"), result.exit
    assert result.exit.endswith(f"(at {where}) (the code or the data, not the cluster; fix it and resume)"), result.exit
    kinds = [event["kind"] for event in result.summary["events"]]
    assert "rank-failed" not in kinds and kinds.count("group-built") == 2


def loss_the_ranks_cannot_import(logits, targets):
    """Defined in a module pytest imports as ``test_training``, a name the ranks cannot import:
    as a script's function is, when the job does not ship the script's directory."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")


def test_hooks_the_ranks_cannot_import_stop_the_run_in_seconds_saying_so(ray_cluster, tmp_path):
    config = tiny_config(tmp_path, groups=2, min_groups=2, steps=4)
    result = ElasticTrainer(config, loss_fn=loss_the_ranks_cannot_import).fit()
    # both groups fail together, or one first and the other on its fresh processes
    assert re.match(r"stopped: groups \[[0-1, ]+\] failed to start: (ranks \[0, 1\] raised the same error|the same "
                    r"error again on fresh processes): ImportError: No module named 'test_training': the ranks cannot "
                    r"import the code that defines the hooks; ship it with the job", result.exit), result.exit
    kinds = [event["kind"] for event in result.summary["events"]]
    assert kinds.count("group-start-failed") <= 3 and "group-built" not in kinds


@pytest.mark.parametrize("settings", [{"scaling__reshard_after_forward": "never"}, {"compute__offload": True}],
                         ids=["zero-2", "cpu-offload"])
def test_zero_2_and_cpu_offload_train_as_one_process_through_a_kill_and_its_heal(ray_cluster, tmp_path, settings):
    """FSDP2 holding the gathered blocks until backward (ZeRO-2), or the state in host memory
    with the optimizer step there (CPUOffloadPolicy), at 2 groups of shard 2: the losses of
    one process, through a rank killed and its group healed from its peer."""
    steps = 10
    config = tiny_config(tmp_path, groups=2, min_groups=2, shard=2, steps=steps,
                         fault_tolerance__inject="kill:rank=1,step=4", **settings)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert [e["rank"] for e in result.summary["events"] if e["kind"] == "rank-failed"] == [1]
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5


@pytest.mark.parametrize("layout", [{"groups": 2, "min_groups": 2, "shard": 2},
                                    {"groups": 1, "shard": 1, "scaling__pp": 2, "micro_batch": 1}],
                         ids=["2-groups-of-shard-2", "pp-2"])
def test_fp16_overflows_are_discarded_everywhere_halving_the_scale_without_a_fault_and_a_checkpoint_keeps_it(
        ray_cluster, tmp_path, reference, layout):
    """fp16 from a loss scale far too large (2^30), at 2 groups of shard 2 and in 2 pipeline
    stages (whose schedule runs the scaled backward): each step whose gradients overflow is
    discarded by every rank and the scale halves, no rank fails, nothing counts toward
    divergence (3 in a row would end it); the run then trains within fp16's distance of the
    fp32 losses, and its checkpoint records the scale it reached."""
    import json

    steps = 8
    config = tiny_config(tmp_path, steps=steps, compute__precision="fp16", compute__initial_loss_scale=2.0**30,
                         checkpoint__every=4, **layout)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    overflows = [e for e in events if e["kind"] == "nonfinite-step"]
    assert len(overflows) >= 3 and all(e["overflow"] for e in overflows)
    scales = [e["loss_scale"] for e in overflows]
    assert scales == [2.0 ** (29 - i) for i in range(len(scales))]  # halved once per overflow, in every group
    assert not [e for e in events if e["kind"] == "rank-failed"]
    assert result.summary["steps_committed"] == steps and len(result.losses) == steps
    assert 1e-5 < max_relative_difference(result.losses, reference[:steps]) < 0.05
    manifest = json.loads(next((tmp_path / "runs" / "test" / "checkpoints").glob("step-*8/manifest.json")).read_text())
    assert manifest["loss_scale"] == {"value": scales[-1], "good_steps": steps}

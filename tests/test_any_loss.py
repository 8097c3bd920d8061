"""Any model, any loss: ``batch_loss_fn(model, batch) -> (loss_sum, count)`` over what
``collate_fn`` makes of the samples (examples/image_classifier.py). The step is the summed
loss over the count summed across ranks and groups, so a run that loses a rank commits the
clean run's losses; padding never reaches the loss; a hook that returns the wrong form is
refused before any actor starts."""

import importlib.util
from pathlib import Path

import pytest
import torch

from elastic import ElasticTrainer
from elastic.core.data_plan import PADDING_INDEX
from elastic.setup.errors import ConfigError
from tests.tiny import tiny_config
from workers.train_step import SampleLoss, accumulate_counted, collate

EXAMPLE = Path(__file__).parent.parent / "examples" / "image_classifier.py"


def example():
    spec = importlib.util.spec_from_file_location("image_classifier_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_padding_rows_never_reach_the_loss_and_a_padding_only_micro_batch_counts_nothing():
    classifier = example()
    dataset, model = classifier.Shapes(samples=8), classifier.SmallConvNet()
    loss = SampleLoss(classifier.summed_cross_entropy)
    padded = collate(dataset, [0, 1, PADDING_INDEX], torch.device("cpu"), torch.utils.data.default_collate)
    assert padded.inputs["image"].shape[0] == 2  # the two real samples only
    share, counted = accumulate_counted(model, loss, [padded], global_tokens=1)
    expected, count = classifier.summed_cross_entropy(model, collate(dataset, [0, 1], torch.device("cpu"),
                                                                     torch.utils.data.default_collate).inputs)
    assert counted == count == 2 and share == pytest.approx(expected.item())
    model.zero_grad()
    only_padding = collate(dataset, [PADDING_INDEX, PADDING_INDEX], torch.device("cpu"), torch.utils.data.default_collate)
    share, counted = accumulate_counted(model, loss, [only_padding], global_tokens=1)
    assert (share, counted) == (0.0, 0.0)  # it ran (its group's collectives must), weighted 0
    assert all(param.grad is not None and not param.grad.any() for param in model.parameters())


def run(tmp_path, classifier, **overrides):
    config = tiny_config(tmp_path, groups=2, shard=2, steps=10, global_batch=32, micro_batch=4,
                         checkpoint__memory_every=1, **overrides)
    return ElasticTrainer(config, model_fn=classifier.SmallConvNet, batch_loss_fn=classifier.summed_cross_entropy,
                          dataset=classifier.Shapes(), optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2)
                          ).fit()


def test_an_image_classifier_with_a_rank_killed_commits_the_clean_runs_losses(ray_cluster, tmp_path):
    classifier = example()
    clean = run(tmp_path / "clean", classifier)
    assert clean.ok, clean.exit
    assert clean.losses[-1] < 0.85 * clean.losses[0]  # it learns the bands
    # Throughput counts what the loss counted: here samples, a global batch a step.
    for record in clean.summary["steps"]:
        assert record["tokens_per_s"] * record["step_s"] == pytest.approx(clean.summary["config"]["global_batch"],
                                                                          rel=1e-3)
    killed = run(tmp_path / "killed", classifier, fault_tolerance__inject="kill:rank=1,step=4")
    assert killed.ok, killed.exit
    assert any(event["kind"] == "rank-failed" for event in killed.summary["events"])
    assert len(killed.losses) == len(clean.losses)
    for step, (a, b) in enumerate(zip(killed.losses, clean.losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)


def test_a_batch_loss_fn_of_the_wrong_form_or_with_stages_is_refused_before_any_actor_starts(tmp_path):
    classifier = example()

    def mean_only(model, batch):
        return torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"])

    with pytest.raises(ConfigError, match=r"batch_loss_fn: on sample 0 it returned a Tensor; return \(loss_sum, count\)"):
        ElasticTrainer(tiny_config(tmp_path), model_fn=classifier.SmallConvNet, batch_loss_fn=mean_only,
                       dataset=classifier.Shapes()).fit()
    with pytest.raises(ConfigError, match="scaling.pp = 2: a batch_loss_fn trains without pipeline stages"):
        ElasticTrainer(tiny_config(tmp_path, scaling__pp=2), model_fn=classifier.SmallConvNet,
                       batch_loss_fn=classifier.summed_cross_entropy, dataset=classifier.Shapes(),
                       split_fn=lambda model, stage, stages: model).fit()

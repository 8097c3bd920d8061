"""The trainer's callbacks and the experiment trackers built on them. A tracker's test runs
only where its package (its extra) is installed."""

from __future__ import annotations

import math

import numpy as np

import pytest

from elastic import ElasticTrainer
from elastic.core.protocol import RankTimes
from elastic.driver.records import RankArrays, StepResult
from elastic.outputs.loggers import eval_scalars, step_scalars
from elastic.outputs.summary import StepEntry
from tests.tiny import tiny_config

RECORD = StepResult(step=7, t=1.5, loss=2.5, lr=3e-3, grad_norm=math.nan, grad_clip_scale=1.0, step_s=0.2,
                    live_groups=2, live_ranks=4, generation=1, tokens_per_s=9e4,
                    rank_arrays=RankArrays(ranks=np.array([0]), samples=np.array([4.0]), times=RankTimes(
                        *np.array([[0.01, 0.15, 0.03, 0.2, 0.0, 0.0]]).T)),
                    group_samples={0: 4, 1: 4})


def test_a_step_record_gives_its_finite_numbers_under_their_chart_names():
    assert step_scalars(RECORD) == {"train/loss": 2.5, "train/lr": 3e-3, "train/grad_clip_scale": 1.0,
                                    "throughput/tokens_per_s": 9e4, "throughput/step_s": 0.2,
                                    "elastic/live_groups": 2.0, "elastic/live_ranks": 4.0}
    assert eval_scalars({"kind": "evaluated", "step": 8, "loss": 1.5}) == {"eval/loss": 1.5}
    assert eval_scalars({"kind": "rank-failed", "step": 8}) == {}


def test_the_summary_keeps_every_field_of_a_step_record():
    entry = StepEntry.of(RECORD)
    assert entry.model_fields_set == set(StepEntry.model_fields)  # none left to its default
    assert (entry.rank_data_s, entry.rank_step_s, entry.group_samples) == ({0: 0.01}, {0: 0.2}, {0: 4, 1: 4})


def test_the_custom_model_example_trains_under_its_tp_plan_and_callbacks_see_every_step_and_event(
        ray_cluster, tmp_path):
    """examples/custom_model.py's hooks (tp_plan, bf16 from the config, its own AdamW at lr
    1e-2): each committed step reaches on_step with the rate the optimizer applied (not
    optimizer.lr), and every event reaches on_event, evaluations included."""
    import importlib.util
    from pathlib import Path

    import torch

    path = Path(__file__).parent.parent / "examples" / "custom_model.py"
    spec = importlib.util.spec_from_file_location("custom_model_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    steps, events = [], []
    config = tiny_config(tmp_path, tp=2, steps=12, eval__every=6, data__validation_fraction=0.1,
                         compute__precision="bf16")
    result = ElasticTrainer(config, model_fn=example.ByteMLP, tp_plan=example.tensor_parallel_plan,
                            loss_fn=example.smoothed_cross_entropy,
                            optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2),
                            on_step=[steps.append], on_event=[events.append]).fit()
    assert result.ok, result.exit
    assert result.losses[-1] < result.losses[0] - 0.5
    assert [record.step for record in steps] == list(range(12))
    assert [StepEntry.of(record) for record in steps] == result.record.steps
    assert [record.lr for record in steps] == [1e-2] * 12 and result.summary["final_lr"] == 1e-2
    assert [event["step"] for event in events if event["kind"] == "evaluated"] == [6, 12]
    assert events[-1]["kind"] == "run-finished"


def test_tensorboard_logger_writes_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from elastic.outputs.loggers import TensorBoardLogger

    logger = TensorBoardLogger(str(tmp_path))
    logger.on_step(RECORD)
    logger.on_event({"kind": "evaluated", "step": 8, "loss": 1.5})
    logger.writer.close()
    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert [(s.step, s.value) for s in accumulator.Scalars("train/loss")] == [(7, 2.5)]
    assert [(s.step, s.value) for s in accumulator.Scalars("eval/loss")] == [(8, 1.5)]


def test_wandb_logger_logs_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from elastic.outputs.loggers import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = WandbLogger("elastic-test", dir=str(tmp_path))
    logger.on_step(RECORD)
    assert logger.run.summary["train/loss"] == 2.5
    logger.run.finish()


def test_mlflow_logger_logs_to_a_local_store(tmp_path):
    mlflow = pytest.importorskip("mlflow")
    from elastic.outputs.loggers import MLflowLogger

    mlflow.set_tracking_uri(f"file://{tmp_path}")
    logger = MLflowLogger("elastic-test")
    logger.on_step(RECORD)
    mlflow.end_run()
    history = mlflow.tracking.MlflowClient().get_metric_history(logger.run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(7, 2.5)]

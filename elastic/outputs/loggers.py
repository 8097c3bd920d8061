"""Experiment trackers on the trainer's callbacks: TensorBoard, Weights & Biases, MLflow.

Each is an optional extra (``pip install 'elastic-trainer[tensorboard]'``, ``[wandb]``,
``[mlflow]``) and imports its package only when made. Each has ``on_step`` (a committed
step's ``StepResult``) and ``on_event`` (evaluations are logged; every other event is not a metric)::

    tracker = TensorBoardLogger("runs/tb")
    ElasticTrainer(config, on_step=[tracker.on_step], on_event=[tracker.on_event]).fit()

They run on the driver, once per committed step, never on a rank.
"""

from __future__ import annotations

import math
from typing import Any

from elastic.driver.records import StepResult


def step_scalars(result: StepResult) -> dict[str, float]:
    """A step's numbers worth a chart, the finite ones, under the names they are logged as."""
    values = {
        "train/loss": result.loss,
        "train/lr": result.lr,
        "train/grad_norm": result.grad_norm,
        "train/grad_clip_scale": result.grad_clip_scale,
        "throughput/tokens_per_s": result.tokens_per_s,
        "throughput/step_s": result.step_s,
        "elastic/live_groups": result.live_groups,
        "elastic/live_ranks": result.live_ranks,
    }
    return {name: float(value) for name, value in values.items() if math.isfinite(value)}


def eval_scalars(event: dict[str, Any]) -> dict[str, float]:
    return {"eval/loss": float(event["loss"])} if event.get("kind") == "evaluated" else {}


def _required(package: str, extra: str):
    try:
        return __import__(package, fromlist=["_"])
    except ImportError:
        raise ImportError(f"this logger needs {package}: pip install 'elastic-trainer[{extra}]'") from None


class TensorBoardLogger:
    def __init__(self, log_dir: str):
        self.writer = _required("torch.utils.tensorboard", "tensorboard").SummaryWriter(log_dir)

    def on_step(self, result: StepResult) -> None:
        for name, value in step_scalars(result).items():
            self.writer.add_scalar(name, value, result.step)
        self.writer.flush()

    def on_event(self, event: dict) -> None:
        for name, value in eval_scalars(event).items():
            self.writer.add_scalar(name, value, event["step"])


class WandbLogger:
    def __init__(self, project: str, **init_options):
        self.wandb = _required("wandb", "wandb")
        self.run = self.wandb.init(project=project, **init_options)

    def on_step(self, result: StepResult) -> None:
        self.run.log(step_scalars(result), step=result.step)

    def on_event(self, event: dict) -> None:
        if scalars := eval_scalars(event):
            self.run.log(scalars, step=event["step"])


class MLflowLogger:
    def __init__(self, experiment: str | None = None, **start_run_options):
        self.mlflow = _required("mlflow", "mlflow")
        if experiment:
            self.mlflow.set_experiment(experiment)
        self.run = self.mlflow.start_run(**start_run_options)

    def on_step(self, result: StepResult) -> None:
        self.mlflow.log_metrics(step_scalars(result), step=result.step)

    def on_event(self, event: dict) -> None:
        if scalars := eval_scalars(event):
            self.mlflow.log_metrics(scalars, step=event["step"])

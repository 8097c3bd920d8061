"""The reference job's steps as a Ray Train V2 worker takes them, for the benches that compare
against Ray Train (``recovery.py``, ``goodput.py``): the same data plan, loss and optimizer
as elastic's, one worker per rank, gradients summed over the workers, a checkpoint of rank
0's state in Ray Train's own storage, from which a restarted worker group resumes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import ray.train
from elastic.core.data_plan import DataCursor, plan_step
from workers.gradient_sum import local_gradient
from workers.train_step import accumulate_gradients, collate


def restore(model, optimizer) -> tuple[int, DataCursor, bool]:
    """The step and cursor to go on from: Ray Train's last checkpoint's, loaded into the
    model and optimizer, or the start; and whether there was one."""
    checkpoint = ray.train.get_checkpoint()
    if not checkpoint:
        return 0, DataCursor(), False
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / "state.pt", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], DataCursor(*state["cursor"]), True


def train_step(model, optimizer, hooks, config, step: int, cursor: DataCursor, rank: int,
               world: int) -> tuple[float, DataCursor]:
    """One step of this worker's share, its gradients summed with the others'; returns the
    step's loss and the cursor after it."""
    plan = plan_step(step, cursor, dataset_len=len(hooks.dataset), global_batch=config.global_batch,
                     seed=config.seed, group_weights={g: 1.0 for g in range(world)})
    micro = plan.groups[rank].micro_batches(0, 1, config.micro_batch)
    batches = [collate(hooks.dataset, mb, torch.device("cpu")) for mb in micro]
    loss_share = accumulate_gradients(model, hooks.loss_fn, batches, plan.global_samples * config.data.seq_len)
    grads = [local_gradient(param) for param in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads] + [torch.tensor([loss_share])])
    dist.all_reduce(flat)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset: offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    optimizer.step()
    optimizer.zero_grad()
    return flat[-1].item(), plan.next_cursor


def report(model, optimizer, steps_done: int, cursor: DataCursor, checkpoint_every: int, rank: int,
           metrics: dict) -> None:
    """Report the step to Ray Train, with a checkpoint of rank 0's state every ``checkpoint_every`` steps."""
    saved = None
    if steps_done % checkpoint_every == 0 and rank == 0:
        saved = tempfile.mkdtemp()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": steps_done,
                    "cursor": (cursor.epoch, cursor.position)}, Path(saved) / "state.pt")
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(saved) if saved else None)


def fit(loop, loop_config: dict, workers: int, name: str, storage: str, max_failures: int) -> None:
    """Train ``loop`` on ``workers`` Ray Train V2 workers (0.25 CPU each), which restart
    together from their last checkpoint after each of up to ``max_failures`` failures."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker={"CPU": 0.25}),
        run_config=RunConfig(name=name, storage_path=str(Path(storage) / "ray_train"),
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    ).fit()

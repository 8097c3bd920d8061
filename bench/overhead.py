"""Driver + actor overhead: the same model, batch and layout trained (A) by elastic and (B) by
a plain torch.distributed script with no Ray and no driver. Prints both median step times and
A/B, measured in one run. Target: A/B <= 1.05 at step times of 100 ms or more.

    python bench/overhead.py [--steps 30] [--shard 2] [--tp 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.config import build_config  # noqa: E402
from elastic.core.data_plan import DataCursor, plan_step  # noqa: E402
from elastic.hooks import resolve_hooks  # noqa: E402
from workers.train_step import accumulate_gradients, collate  # noqa: E402


def job(args, storage: str):
    return build_config({
        "run_name": "overhead", "storage": storage, "steps": args.steps, "global_batch": args.global_batch,
        "micro_batch": args.micro_batch, "seed": 0,
        "scaling": {"min_groups": 1, "max_groups": 1, "shard": args.shard, "tp": args.tp, "cpus_per_rank": 0.5},
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, "ffn_hidden": args.dim * 3},
        "data": {"seq_len": args.seq_len, "corpus_tokens": 2_000_000},
        "stragglers": {"enabled": False},
    })


def plain_rank(rank: int, world: int, port: int, config, queue) -> None:
    """What a hand-written torchrun script does: same model, parallelize, data and step math."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    shard, tp = config.scaling.shard, config.scaling.tp
    mesh = init_device_mesh("cpu", (shard, tp), mesh_dim_names=("shard", "tp"))
    hooks = resolve_hooks(config)
    torch.manual_seed(config.seed)
    model = hooks.parallelize_fn(hooks.model_fn(), mesh)
    optimizer = hooks.optimizer_fn(model.parameters())
    shard_index = mesh["shard"].get_local_rank()
    cursor, times = DataCursor(), []
    for step in range(config.steps):
        started = time.perf_counter()
        plan = plan_step(step, cursor, dataset_len=len(hooks.dataset), global_batch=config.global_batch,
                         seed=config.seed, group_weights={0: 1.0})
        cursor = plan.next_cursor
        micro = plan.groups[0].micro_batches(shard_index, shard, config.micro_batch)
        batches = [collate(hooks.dataset, mb, torch.device("cpu")) for mb in micro]
        accumulate_gradients(model, hooks.loss_fn, batches, plan.global_samples * config.data.seq_len)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        dist.barrier()
        times.append(time.perf_counter() - started)
    if rank == 0:
        queue.put(times)
    dist.destroy_process_group()


def run_plain(config) -> list[float]:
    world = config.scaling.shard * config.scaling.tp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=plain_rank, args=(r, world, port, config, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    times = queue.get(timeout=1200)
    for proc in procs:
        proc.join()
    return times


def run_elastic(config) -> list[float]:
    from elastic import ElasticTrainer

    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    return [record["step_s"] for record in result.summary["steps"]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--shard", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as storage:
        config = job(args, storage)
        plain = run_plain(config)[args.warmup:]
        elastic = run_elastic(config)[args.warmup:]
    a, b = statistics.median(elastic), statistics.median(plain)
    print(f"layout: 1 group x shard {args.shard} x tp {args.tp}, dim {args.dim}, {args.layers} layers, "
          f"seq {args.seq_len}, global batch {args.global_batch}, {args.steps - args.warmup} timed steps")
    print(f"(A) elastic, driver + actors : median step {a * 1e3:8.1f} ms")
    print(f"(B) plain torch.distributed  : median step {b * 1e3:8.1f} ms")
    verdict = "PASS" if a / b <= 1.05 and b >= 0.1 else "FAIL"
    print(f"A/B = {a / b:.3f} (target <= 1.05 at B >= 100 ms): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The product against the same math by hand: (A) elastic (driver, actors, runs) and (B) a
plain torch.distributed script with no Ray and no driver, doing what A's ranks do each step:
FSDP2 inside each replica group, the cross-group gradient sum in buckets started inside
backward, the gradient norm, the summed loss, the AdamW update. Same model, data, batch and
layout, measured in one run, at a short step (about 50 ms here) and a long one (about 500 ms).

Prints each side's median step time and the throughput ratio B/A per size (A's step is its
ranks' whole loop period, as B's is; the driver is not on it). Target: >= 0.97 at both.
Then the exposed share of the cross-group sum (from backward's end to the last bucket
summed, over the step) before the overlap (B run again with one flat all-reduce after
backward, as the product did), after it (B), and in the product (A, from its step records).
A runs with the product's defaults: the in-memory tier every step and the integrity check
every 10. ``--tiers`` also runs (A0) the product with both off and prints what they cost,
A0/A on the median and on the mean step (the check runs one step in ten: the mean shows it).
Target: the memory tier at most 3 %, the check at most 1 %.

    python bench/overhead.py [--sizes short,long] [--steps 60] [--groups 2] [--tiers] [--memory-every N]
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

from elastic.setup.preflight import build_config  # noqa: E402
from elastic.core.data_plan import DataCursor, plan_step  # noqa: E402
from elastic.setup.hooks import resolve_hooks  # noqa: E402
from workers.gradient_sum import GradientSum, trained  # noqa: E402
from workers.train_step import accumulate_gradients, collate, squared_gradient_norm  # noqa: E402

SIZES = {  # about 50 ms and 500 ms per step on one core of the CI machine
    "short": {"dim": 128, "layers": 2, "seq_len": 96, "global_batch": 8, "micro_batch": 4},
    "long": {"dim": 256, "layers": 4, "seq_len": 192, "global_batch": 16, "micro_batch": 4},
}


def job(size: dict, groups: int, steps: int, storage: str, tiers: bool = True, memory_every: int | None = None):
    memory = {"memory_every": 0} if not tiers else {} if memory_every is None else {"memory_every": memory_every}
    return build_config({
        "run_name": "overhead", "storage": storage, "steps": steps, "global_batch": size["global_batch"],
        "micro_batch": size["micro_batch"], "seed": 0,
        "scaling": {"min_groups": groups, "max_groups": groups, "shard": 1, "tp": 1, "cpus_per_rank": 1},
        "model": {"dim": size["dim"], "n_layers": size["layers"], "n_heads": 8, "ffn_hidden": size["dim"] * 3},
        "data": {"seq_len": size["seq_len"], "corpus_tokens": 2_000_000},
        "checkpoint": {"every": 0, **memory},
        "integrity": {} if tiers else {"every": 0},
        "stragglers": {"enabled": False},
    })


def plain_rank(rank: int, world: int, port: int, config, result_path: str, overlap: bool) -> None:
    """What a hand-written torchrun script does with one rank per replica group; without
    ``overlap``, the gradients' cross-group sum is one flat all-reduce after backward."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("replicate", "shard", "tp"))
    group_mesh, replicate = mesh["shard", "tp"], mesh["replicate"].get_group()
    hooks = resolve_hooks(config)
    torch.manual_seed(config.seed)
    model = hooks.parallelize_fn(hooks.model_fn(), group_mesh)
    optimizer = hooks.optimizer_fn(model.parameters())
    gradient_sum = GradientSum(trained(model), torch.float32, overlap=overlap,
                               **({} if overlap else {"bucket_bytes": float("inf")}))
    weights = dict.fromkeys(range(world), 1.0)
    cursor, times = DataCursor(), []
    for step in range(config.steps):
        started = time.perf_counter()
        plan = plan_step(step, cursor, dataset_len=len(hooks.dataset), global_batch=config.global_batch,
                         seed=config.seed, group_weights=weights)
        cursor = plan.next_cursor
        micro = plan.groups[rank].micro_batches(0, 1, config.micro_batch)
        batches = [collate(hooks.dataset, mb, torch.device("cpu")) for mb in micro]
        loss = accumulate_gradients(model, hooks.loss_fn, batches, plan.global_samples * config.data.seq_len,
                                    lambda index: gradient_sum.before_micro_batch(index, len(batches), replicate))
        exposed_s = gradient_sum.finish(lambda work: work.wait()).exposed_s
        scalars = torch.tensor([loss, squared_gradient_norm(model, {"shard": 0, "tp": 0})], dtype=torch.float64)
        dist.all_reduce(scalars, group=replicate)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(f"{time.perf_counter() - started} {exposed_s}")
    if rank == 0:
        Path(result_path).write_text("\n".join(times))
    dist.destroy_process_group()


def run_plain(config, groups: int, storage: str, overlap: bool = True) -> list[tuple[float, float]]:
    """Rank 0's (step seconds, exposed seconds of the cross-group sum) per step."""
    ctx = mp.get_context("spawn")
    port = 29000 + os.getpid() % 1000 + (0 if overlap else 500)
    result_path = str(Path(storage) / "plain-times")
    procs = [ctx.Process(target=plain_rank, args=(r, groups, port, config, result_path, overlap))
             for r in range(groups)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0, f"a plain rank exited {proc.exitcode}"
    return [tuple(map(float, line.split())) for line in Path(result_path).read_text().splitlines()]


def exposed_share(steps: list[tuple[float, float]]) -> float:
    """The cross-group sum's exposed seconds over the step's, on the medians."""
    return statistics.median(exposed for _, exposed in steps) / statistics.median(step for step, _ in steps)


def run_elastic(config) -> tuple[list[float], dict]:
    from elastic import ElasticTrainer

    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    return [record["step_s"] for record in result.summary["steps"]], result.summary


def elastic_exposed(summary: dict, warmup: int) -> list[tuple[float, float]]:
    """The product's (step seconds, rank 0's exposed seconds of the cross-group sum) per step."""
    return [(record["step_s"], record["rank_grad_sum_exposed_s"]["0"]) for record in summary["steps"][warmup:]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="short,long")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--groups", type=int, default=2, help="replica groups of one rank each (one per core)")
    parser.add_argument("--tiers", action="store_true", help="also the product with the memory tier and check off")
    parser.add_argument("--memory-every", type=int, help="A's checkpoint.memory_every (default: the product's)")
    args = parser.parse_args()
    from elastic.fleet.ray_connection import start_local_ray

    import ray

    verdicts = []
    for name in args.sizes.split(","):
        size = SIZES[name]
        with tempfile.TemporaryDirectory() as storage:
            config = job(size, args.groups, args.steps, storage, memory_every=args.memory_every)
            plain_steps = run_plain(config, args.groups, storage)[args.warmup:]
            flat_steps = run_plain(config, args.groups, storage, overlap=False)[args.warmup:]
            start_local_ray(log_to_driver=False)
            try:
                elastic_steps, summary = run_elastic(config)
                # its own storage: under the same run name it would resume the run above, at its end
                bare = job(size, args.groups, args.steps, os.path.join(storage, "bare"), tiers=False)
                bare_steps = run_elastic(bare)[0] if args.tiers else []
            finally:
                ray.shutdown()
        a, b = statistics.median(elastic_steps[args.warmup:]), statistics.median(step for step, _ in plain_steps)
        ratio = b / a
        verdicts.append(ratio >= 0.97)
        print(f"{name}: {args.groups} groups x shard 1, dim {size['dim']}, {size['layers']} layers, "
              f"seq {size['seq_len']}, global batch {size['global_batch']}, {args.steps - args.warmup} timed steps")
        print(f"  (A) elastic, driver + actors : median step {a * 1e3:8.1f} ms")
        print(f"  (B) plain torch.distributed  : median step {b * 1e3:8.1f} ms")
        print(f"  throughput B/A... A at {ratio:.3f} of B (target >= 0.97): {'PASS' if ratio >= 0.97 else 'FAIL'}")
        print(f"  cross-group sum exposed after backward, share of the step: one flat all-reduce after backward "
              f"{exposed_share(flat_steps) * 100:.1f} %, buckets from inside backward (B) "
              f"{exposed_share(plain_steps) * 100:.1f} %, the product (A) "
              f"{exposed_share(elastic_exposed(summary, args.warmup)) * 100:.1f} %")
        if bare_steps:
            timed, bare = elastic_steps[args.warmup:], bare_steps[args.warmup:]
            median_cost = statistics.median(timed) / statistics.median(bare) - 1
            mean_cost = statistics.mean(timed) / statistics.mean(bare) - 1
            print(f"  (A0) elastic, memory tier and integrity check off: median step "
                  f"{statistics.median(bare) * 1e3:8.1f} ms; their cost (A/A0 - 1): median {median_cost * 100:+.2f} %, "
                  f"mean {mean_cost * 100:+.2f} % (target memory tier <= 3 %, check <= 1 %: "
                  f"{'PASS' if mean_cost <= 0.04 else 'FAIL'} on the sum)")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

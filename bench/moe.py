"""The mixture of experts on one process (no Ray, no group): what an expert layer costs, and
what the routing bias does to the experts' load.

1. Tokens/s of a training step (forward, backward, AdamW) of the reference model with
   ``--experts`` experts, ``--top-k`` a token, against the dense model of the same *active*
   parameters (its feed-forward ``top_k`` experts wide), at the same width, depth and batch.
   The ratio MoE/dense is what the routing, the sort and the grouped GEMMs cost over the same
   arithmetic.
2. The expert layer's forward and backward with one grouped GEMM (``torch._grouped_mm``)
   against a matmul per expert (the fallback where the grouped GEMM does not run).
3. The load imbalance over a run, with DeepSeek-V3's routing bias off and on: each layer's
   most loaded expert's tokens over the mean, per step, its median over the run's second half.

Measured on the 2-core CI machine (2026-11-27, defaults): the MoE at 0.77 of the dense
model's tokens/s; the grouped GEMM at 0.99 of a matmul per expert's time; the imbalance 3.38
without the bias and 2.48 with it; on two ranks ep 2 at 1.28x the tokens/s of ep 1, the
all-to-all 14 % of an ep 2 step.

4. Expert parallelism on two gloo processes (one CPU thread each): tokens/s of a training
   step at ep 1 (FSDP2 shards the experts over both ranks and gathers them) and at ep 2 (each
   rank holds half the experts whole; tokens travel by all-to-all), and the all-to-all's
   share of the ep 2 step: the time torch's profiler records in gloo's all-to-all (the
   counts' exchange, the rows' dispatch and return, forward and backward) over the step's.

A GPU's figures are bench/gpu_check.py's.

    python bench/moe.py [--dim 256] [--layers 4] [--experts 8] [--top-k 2] [--steps 40] [--bias-rate 0.01]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.core.data_plan import DataCursor, take_global_batch  # noqa: E402
from elastic.setup.hooks import resolve_hooks  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402
from elastic.testing.gloo_ranks import gloo_ranks  # noqa: E402
from workers.experts import (  # noqa: E402
    GROUP_ROWS_CUDA, RoutedLayout, balance_experts, expert_layers, expert_load, grouped_mm, looped_mm,
)
from workers.train_step import accumulate_gradients, collate  # noqa: E402


def config(args, storage: str, **model):
    return build_config({
        "storage": storage, "steps": args.steps, "global_batch": args.batch, "micro_batch": args.batch, "seed": 0,
        "scaling": {"min_groups": 1, "max_groups": 1, "shard": 1, "tp": 1},
        "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 8, **model},
        "data": {"seq_len": args.seq_len, "corpus_tokens": 2_000_000},
    })


def train(job, steps: int, loads: list[dict[int, float]] | None = None,
          device: torch.device = torch.device("cpu")) -> list[float]:
    """Seconds of each of ``steps`` training steps of ``job``'s model on its data; ``loads``
    gets each step's expert load, as the step records hold it. On a GPU the step runs in
    bf16 autocast, as a group of one bf16 rank runs it."""
    hooks = resolve_hooks(job)
    torch.manual_seed(job.seed)
    with device:
        model = hooks.model_fn()
    experts, layout = expert_layers(model), RoutedLayout.of(model.args)
    optimizer = hooks.optimizer_fn(model.parameters())
    cursor, seconds = DataCursor(), []
    for _ in range(steps):
        indices, cursor = take_global_batch(cursor, len(hooks.dataset), job.global_batch, job.seed)
        batch = collate(hooks.dataset, indices.tolist(), device)
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            accumulate_gradients(model, hooks.loss_fn, [batch], batch.counted_tokens)
        optimizer.step()
        optimizer.zero_grad()
        routed = layout.routed_tokens(experts)
        balance_experts(experts, layout, routed)
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        if loads is not None:
            loads.append(expert_load(layout, routed))
    return seconds


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def expert_kernels(args, device: torch.device = torch.device("cpu")) -> tuple[float, float]:
    """Median seconds of the expert layer's three products, forward and backward: grouped, looped.
    On a GPU in bf16, the one dtype its grouped GEMM takes."""
    hidden, tokens = args.dim * 2, args.batch * args.seq_len * args.top_k
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with device:
        rows = torch.randn(tokens, args.dim, dtype=dtype, requires_grad=True)
        weights = [torch.randn(args.experts, hidden, args.dim, dtype=dtype, requires_grad=True) for _ in range(3)]
        counts = torch.bincount(torch.randint(args.experts, (tokens,)), minlength=args.experts)
        upstream = torch.randn(tokens, hidden, dtype=dtype)  # a gradient of the products' shape, as the layer's are
    align = GROUP_ROWS_CUDA if device.type == "cuda" else 1
    results = []
    for product in (lambda w: grouped_mm(rows, w, counts, align), lambda w: looped_mm(rows, w, counts)):
        seconds = []
        for _ in range(10):
            synchronize(device)
            started = time.perf_counter()
            sum((product(w) * upstream).sum() for w in weights).backward()
            synchronize(device)
            seconds.append(time.perf_counter() - started)
        results.append(statistics.median(seconds[2:]))
    return results[0], results[1]


def imbalance(job, steps: int) -> float:
    """The median over the run's second half of each step's mean over layers of max/mean load."""
    loads: list[dict[int, float]] = []
    train(job, steps, loads)
    return statistics.median(statistics.mean(step.values()) for step in loads[steps // 2:])


def expert_parallel_rank(rank: int, args, ep: int) -> tuple[float, float]:
    """One of two gloo ranks training the MoE at ``ep``: its median step seconds, and the
    seconds of gloo's all-to-all in the profiled steps over those steps' seconds."""
    from torch.profiler import ProfilerActivity, profile

    from elastic.core.topology import Topology
    from workers.parallelize import Parallelize
    from workers.world import group_mesh

    job = config(args, tempfile.mkdtemp(), ffn_hidden=args.dim * 2, experts=args.experts,
                 experts_per_token=args.top_k, expert_hidden=args.dim * 2)
    hooks = resolve_hooks(job)
    torch.manual_seed(job.seed)
    model = Parallelize(precision="fp32")(hooks.model_fn(), group_mesh("cpu", Topology(shard=2, tp=1, ep=ep)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cursor, seconds, profiled = DataCursor(), [], 4
    step_count = args.steps // 4 + 3 + profiled
    with profile(activities=[ProfilerActivity.CPU], schedule=torch.profiler.schedule(
            wait=step_count - profiled - 1, warmup=1, active=profiled)) as profiler:
        for _ in range(step_count):
            indices, cursor = take_global_batch(cursor, len(hooks.dataset), job.global_batch, job.seed)
            own = indices.tolist()[rank::2]
            batch = collate(hooks.dataset, own, torch.device("cpu"))
            started = time.perf_counter()
            accumulate_gradients(model, hooks.loss_fn, [batch], batch.counted_tokens * 2)
            optimizer.step()
            optimizer.zero_grad()
            seconds.append(time.perf_counter() - started)
            profiler.step()
    all_to_all_us = sum(event.cpu_time_total for event in profiler.key_averages() if event.key == "gloo:all_to_all")
    return statistics.median(seconds[3:-profiled]), all_to_all_us / 1e6 / sum(seconds[-profiled:])


def expert_parallel(args, ep: int) -> tuple[float, float]:
    """Median step seconds at ``ep`` on two gloo ranks, and the all-to-all's share of a step
    (rank 0's)."""
    return gloo_ranks(expert_parallel_rank, 2, os.path.join(tempfile.mkdtemp(), "init"), args, ep)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    # DeepSeek-V3's 0.001 acts over thousands of steps; a run of tens needs a faster bias
    parser.add_argument("--bias-rate", type=float, default=0.01)
    args = parser.parse_args()
    torch.set_num_threads(1)
    storage = tempfile.mkdtemp()
    hidden = args.dim * 2
    moe = config(args, storage, ffn_hidden=hidden, experts=args.experts, experts_per_token=args.top_k,
                 expert_hidden=hidden)
    dense = config(args, storage, ffn_hidden=hidden * args.top_k)
    tokens = args.batch * args.seq_len
    timed = args.steps // 4 + 3
    moe_s, dense_s = (statistics.median(train(job, timed)[3:]) for job in (moe, dense))
    print(f"training step, {args.layers} layers of width {args.dim}, {tokens} tokens, one CPU thread:")
    print(f"  dense (feed-forward {hidden * args.top_k} wide): {tokens / dense_s:,.0f} tokens/s")
    print(f"  {args.experts} experts of {hidden}, {args.top_k} a token (the same active parameters): "
          f"{tokens / moe_s:,.0f} tokens/s, {dense_s / moe_s:.2f} of the dense model's")
    grouped, looped = expert_kernels(args)
    print(f"the experts' products, forward and backward: grouped GEMM {grouped * 1e3:.1f} ms, a matmul per expert "
          f"{looped * 1e3:.1f} ms (grouped/looped {grouped / looped:.2f})")
    for rate in (0.0, args.bias_rate):
        balanced = config(args, storage, ffn_hidden=hidden, experts=args.experts, experts_per_token=args.top_k,
                          expert_hidden=hidden, expert_bias_rate=rate)
        print(f"load imbalance (the most loaded expert's tokens over the mean), routing bias rate {rate:g}: "
              f"{imbalance(balanced, args.steps):.2f}")
    (ep1_s, _), (ep2_s, all_to_all_share) = expert_parallel(args, 1), expert_parallel(args, 2)
    print(f"two gloo ranks, {tokens // 2} tokens each: ep 1 (FSDP2 gathers the experts) {tokens / ep1_s:,.0f} "
          f"tokens/s, ep 2 (all-to-all) {tokens / ep2_s:,.0f} tokens/s (ep 2/ep 1 {ep1_s / ep2_s:.2f}); the "
          f"all-to-all {all_to_all_share:.0%} of an ep 2 step")


if __name__ == "__main__":
    main()

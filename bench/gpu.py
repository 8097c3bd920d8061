"""The GPU path against a plain PyTorch script, side by side in one run on one device:

- (A) elastic: 1 replica group x shard 1 x tp 1, through ``ElasticTrainer``, with the
  configured precision, compile and activation checkpointing, async checkpoints after each
  third of the run (the last mid-run one's stall is the steady one where there are two: the
  first also allocates and pins the staging arena);
- (B) a plain single-process PyTorch script: the same model, data, batch and micro-batches,
  bf16 autocast when A trains in bf16, ``torch.compile`` per block when A compiles, fused
  AdamW on CUDA, then a synchronous ``dcp.save`` of its state (parameters + AdamW).

Prints tokens/s of each and A/B, the MFU of A (6N + 12 x layers x dim x seq flops per
token, against the device's dense bf16 peak), the group build time, the checkpoint stall
against the synchronous save of the same state, and the upload during training against that
save. Targets on one H100: A/B >= 0.95; MFU >= 45 % for the 1.23 B shape; group built in
<= 15 s; stall / sync <= 0.05; upload / sync <= 1.5. On CPU it runs a tiny model and only
the ratios mean anything.

    python bench/gpu.py                                   # CPU: tiny model, fp32
    python bench/gpu.py --preset 206m --compile           # the issue's 206 M shape
    python bench/gpu.py --preset 1b --compile --activation-checkpointing full
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.setup.preflight import build_config  # noqa: E402
from elastic.core.data_plan import DataCursor, take_global_batch  # noqa: E402
from elastic.core.events import EventKind  # noqa: E402
from elastic.setup.hooks import resolve_hooks  # noqa: E402
from workers.parallelize import fully_shard_model, mixed_precision_policy, wrap_blocks  # noqa: E402
from workers.train_step import accumulate_gradients, collate  # noqa: E402

PRESETS = {
    "tiny": {"dim": 128, "n_layers": 2, "n_heads": 4, "ffn_hidden": 384, "seq_len": 128, "global_batch": 8,
             "micro_batch": 2},
    "206m": {"dim": 1024, "n_layers": 16, "n_heads": 16, "ffn_hidden": 2816, "seq_len": 1024, "global_batch": 32,
             "micro_batch": 8},
    "1b": {"dim": 2048, "n_layers": 24, "n_heads": 16, "ffn_hidden": 5632, "seq_len": 2048, "global_batch": 16,
           "micro_batch": 4},
}
# Dense bf16 tensor-core peaks, by device name.
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def job(args, storage: str, memory_every: int | None = None, float8: bool = False, compute_only: bool = False):
    """The run A trains; ``memory_every`` overrides the in-memory tier's interval (default: the
    product's); ``float8`` trains its linear layers in float8 (``compute.float8``);
    ``compute_only`` leaves out the mid-run checkpoints and the memory tier, and gives the
    final save the time it needs (a 1.23 B state is 14.7 GB): for figures of compute alone."""
    shape = PRESETS[args.preset]
    memory = {} if memory_every is None else {"memory_every": memory_every}
    checkpoint = ({"every": 0, "memory_every": 0, "grace_s": 600.0} if compute_only
                  else {"every": args.steps // 3} | memory)
    return build_config({
        "run_name": f"gpu-{args.preset}", "storage": storage, "steps": args.steps,
        "global_batch": shape["global_batch"], "micro_batch": shape["micro_batch"], "seed": 0,
        "scaling": {"min_groups": 1, "max_groups": 1, "shard": 1, "tp": 1, "cpus_per_rank": 1,
                    "device": "cuda" if torch.cuda.is_available() else "cpu"},
        "model": {k: shape[k] for k in ("dim", "n_layers", "n_heads", "ffn_hidden")} | {"vocab_size": 256},
        "data": {"seq_len": shape["seq_len"], "corpus_tokens": max(2_000_000, 4 * shape["global_batch"] * shape["seq_len"])},
        "compute": {"precision": args.precision, "compile": args.compile,
                    "activation_checkpointing": args.activation_checkpointing, "float8": float8},
        "checkpoint": checkpoint,
        "stragglers": {"enabled": False},
        "fault_tolerance": {"first_step_deadline_s": 900},
    })


def flops_per_token(config, parameters: int) -> float:
    model = config.model
    return 6 * parameters + 12 * model.n_layers * model.dim * config.data.seq_len


def tokens_per_second(config, step_times: list[float], warmup: int) -> float:
    return config.global_batch * config.data.seq_len / statistics.median(step_times[warmup:])


def run_elastic(config) -> dict:
    from elastic import ElasticTrainer

    summary = ElasticTrainer(config).fit().summary
    assert summary["exit"] == "completed", summary["exit"]
    events = summary["events"]
    [built] = [e for e in events if e["kind"] == EventKind.GROUP_BUILT]
    result = {
        "step_s": [r["step_s"] for r in summary["steps"]],
        "rank_step_s": [r["rank_step_s"]["0"] for r in summary["steps"]],  # until its vote
        "compute_s": [r["rank_compute_s"]["0"] for r in summary["steps"]],
        "losses": summary["losses"],
        "build_s": built["seconds"],
    }
    if config.checkpoint.every == 0:  # a compute-only job
        return result
    mid_run = [e for e in events if e["kind"] == EventKind.CHECKPOINT_COMMITTED and e["step"] < config.steps]
    assert mid_run, "no mid-run checkpoint committed"
    # The first save also allocates and pins the staging arena (once per run): a later one's is the steady stall.
    return result | {"first_stall_s": mid_run[0]["stall_s"], "stall_s": mid_run[-1]["stall_s"],
                     "upload_s": mid_run[-1]["upload_s"]}


def run_plain(config, storage: str, under_fsdp2: bool = False) -> dict:
    """What a user writes by hand for one device. ``under_fsdp2``: the compiled blocks and
    the root under FSDP2 with the bf16 policy on a mesh of one rank, as a group of several
    ranks wraps them (a group of one is not wrapped): FSDP2's own cost, without communication."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as a CPU rank of A runs
    hooks = resolve_hooks(config)
    torch.manual_seed(config.seed)
    with device:
        model = hooks.model_fn()
    bf16 = config.compute.precision == "bf16" or (config.compute.precision == "auto" and device.type == "cuda")
    blocks = wrap_blocks(model, config.compute.activation_checkpointing, config.compute.compile,
                         config.compute.selective_checkpointing)
    if under_fsdp2:
        from torch._dynamo.utils import counters
        from torch.distributed.device_mesh import init_device_mesh

        counters.clear()  # what dynamo did for this run alone, not for an earlier one in the process
        dist.init_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(),
                                rank=0, world_size=1)
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("shard",))
        fully_shard_model(model, mesh, blocks, mixed_precision_policy(torch.bfloat16 if bf16 else torch.float32))
        bf16 = False  # the precision policy casts
    optimizer = hooks.optimizer_fn(model.parameters())
    dataset, cursor, times, losses = hooks.dataset, DataCursor(), [], []
    for _ in range(config.steps):
        started = time.perf_counter()
        indices, cursor = take_global_batch(cursor, len(dataset), config.global_batch, config.seed)
        batches = [collate(dataset, indices[i : i + config.micro_batch].tolist(), device)
                   for i in range(0, len(indices), config.micro_batch)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            losses.append(accumulate_gradients(model, hooks.loss_fn, batches, len(indices) * config.data.seq_len))
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - started)
    if under_fsdp2:
        dist.destroy_process_group()
        return {"step_s": times, "losses": losses, "dynamo": {key: dict(value) for key, value in counters.items()
                                                             if key in ("stats", "recompiles", "graph_break")}}
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    started = time.perf_counter()
    dcp.save(state, checkpoint_id=str(Path(storage) / "plain-sync"), no_dist=True)
    sync_s = time.perf_counter() - started
    return {"step_s": times, "losses": losses, "sync_save_s": sync_s,
            "parameters": sum(p.numel() for p in model.parameters())}


def peak_tflops(override: float | None) -> float | None:
    if override:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="206m" if torch.cuda.is_available() else "tiny")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of tokens/s (compile, allocator)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--activation-checkpointing", choices=["none", "full", "selective"], default="none")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense peak, for MFU (default: by name)")
    args = parser.parse_args()
    from elastic.fleet.ray_connection import start_local_ray

    import ray

    with tempfile.TemporaryDirectory() as storage:
        config = job(args, storage)
        start_local_ray(log_to_driver=False)
        a = run_elastic(config)
        ray.shutdown()  # B is a script without Ray
        b = run_plain(config, storage)
    a_tps = tokens_per_second(config, a["step_s"], args.warmup)
    b_tps = tokens_per_second(config, b["step_s"], args.warmup)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"{device}; preset {args.preset}: {b['parameters'] / 1e6:.1f} M parameters, seq {config.data.seq_len}, "
          f"global batch {config.global_batch}, micro batch {config.micro_batch}; precision {args.precision}, "
          f"compile {args.compile}, activation checkpointing {args.activation_checkpointing}; "
          f"{args.steps} steps, first {args.warmup} left out")
    print(f"(A) elastic  {a_tps:>12,.0f} tokens/s   median step {statistics.median(a['step_s'][args.warmup:]):.4f} s")
    print(f"(B) plain    {b_tps:>12,.0f} tokens/s   median step {statistics.median(b['step_s'][args.warmup:]):.4f} s")
    peak = peak_tflops(args.peak_tflops)
    mfu = a_tps * flops_per_token(config, b["parameters"]) / (peak * 1e12) if peak else None
    print(f"A/B = {a_tps / b_tps:.3f}   MFU of A = {f'{mfu:.1%}' if mfu is not None else 'n/a (no known peak)'}")
    print(f"group built in {a['build_s']:.2f} s")
    print(f"checkpoint: stall {a['stall_s']:.4f} s, synchronous save of the same state {b['sync_save_s']:.3f} s, "
          f"stall/sync = {a['stall_s'] / b['sync_save_s']:.3f}; upload during training {a['upload_s']:.3f} s, "
          f"upload/sync = {a['upload_s'] / b['sync_save_s']:.2f}")
    print(f"first losses A {a['losses'][:3]}  B {b['losses'][:3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every GPU figure in one command, for the minutes a GPU machine is lent: each part below is a
figure (or a few measured together) against its goal, run in a process of its own under a
time limit, so one part that fails or hangs costs only its own time. Writes ``gpu_check.md``
(figure, goal, measured, verdict, device, torch, the command that reproduces it) and one log
per part into ``--out``, and prints what it skipped and why.

Parts, in the order they run (``--only NAME[,NAME]`` runs some alone):

- ``throughput``: the 206 M shape (``--preset``), bf16 + compile, through the product (A,
  the product's defaults), the product with the in-memory tier every step (A1) and a plain
  single-process script (B), one after the other on the device (``bench/gpu.py``). Figures:
  A/B tokens/s (>= 0.95), A's MFU, the memory tier's cost at ``memory_every = 1`` (A1's
  median step over A's: <= 3 %; A's median step has no tier copy in it, the tier's default
  interval being 10), the checkpoint stall with the pinned staging arena against a
  synchronous save of the same state (<= 0.05); where A's step goes, and the plain script
  under FSDP2 on one rank (FSDP2's own cost, which groups of several ranks pay).
- ``experts``: the mixture of experts on the device in one process (``bench/moe.py``): tokens/s
  against the dense model of the same active parameters, the grouped GEMM against a matmul
  per expert; and the product's ep 2 over two ranks of one GPU (all-to-all over gloo) against
  one rank of the same device, losses equal to 1e-4.
- ``context``: the product's cp 2 over two ranks of one GPU against one rank, losses equal to 1e-4.
- ``precision``: fp16 with its loss scale against bf16 on one rank (tokens/s, losses within
  5 %); CPU offload at shard 2 over two ranks of one GPU (its step, the GPU's peak memory in use).
- ``heal_transport``: the heal's copy of a rank's state between two actors on one GPU: rank to
  rank over gloo (the product's road, its buckets through host memory), through the object
  store (its fallback) and over Ray Direct Transport's CUDA IPC (``bench/heal_transport.py``).
- ``torchtitan``: TorchTitan's own trainer at the float8 part's 1.23 B shape
  (``bench/torchtitan_job.py``; its wheels travel through ``shared/gpu/bundle.sh``): tokens/s
  and peak memory, beside the float8 part's bf16 run of ours.
- ``integrity``: the fingerprint of the whole state (parameters + AdamW) against a step,
  in one process (``bench/integrity.py``): at ``integrity.every = 10``, <= 1 %.
- ``gloo_ops``: which collectives gloo carries on CUDA tensors, two processes on one GPU:
  the finding, op by op, with the error where one fails.
- ``shared_gpu``: several ranks on one GPU, gloo carrying CUDA tensors
  (``scaling.gpu_collectives = gloo``, ``gpus_per_rank = 0.2``): 2 groups x shard 2 and a
  warm spare, the in-memory tier every step, steps paced to ``--step-s`` (``elastic/testing/paced.py``),
  one rank killed mid-run (``bench/goodput.py``'s job). Figures: the kill to the whole group
  again with the spare's CUDA context made ahead (<= 2 step times), and the committed losses
  against the same job trained on CPU ranks with no kill (equal to 1e-4). Where FSDP2's
  collectives fail on gloo with CUDA tensors it says so with the error and runs shard 1
  (the cross-group sum, the heal, the memory tier and the kill without FSDP2's collectives).
- ``control_plane``: the driver's CPU per steady-state step at 128 null ranks on real Ray
  actors (``bench/null_ranks.py``): <= 1 ms. Needs the GPU machine's 16 cores, not its GPU.
- ``stragglers``: ``bench/stragglers.py`` with a warm spare on cores of its own: the share of
  a slow rank's slowdown the mitigation recovers (>= 60 %), the steps from the slowdown's
  onset to its detection (<= 10), and mitigations under noise alone (none). Cores, not the GPU.
- ``float8``: the product at the 1.23 B shape, bf16 + compile, then the same with
  ``compute.float8`` (torchao's float8 linear layers), both compute alone (no mid-run
  checkpoint, no memory tier): tokens/s side by side (>= 1.2x) and the losses of the two
  runs. Needs a GPU of compute capability 8.9 or later; on CPU it is skipped (the product
  refuses float8 on CPU ranks; ``tests/test_float8.py`` holds the conversion and its
  composition with TP and FSDP2 there).

With ``--device cpu --quick`` every part runs its smallest form on CPU in seconds (the
suite's test), so the script does not rot between GPU machines; only the figures of a run
on ``--device cuda`` mean anything.

    python bench/gpu_check.py --device cuda --out OUT [--only throughput,integrity]
    python bench/gpu_check.py --device cpu --quick --out /tmp/gpu-check
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Row:
    figure: str
    goal: str
    measured: str
    verdict: str  # "pass", "fail", or "info" (a figure with no goal of its own)


@dataclass(frozen=True)
class Part:
    name: str
    measure: Callable[[argparse.Namespace], list[Row]]
    # On the GPU machine, and for --quick on CPU too: shared_gpu's two Ray runs take 28 s alone on
    # 2 cores and overran 60 s beside a busy neighbour; the suite runs them beside its other lane.
    time_limit_s: float
    skip_reason: Callable[[argparse.Namespace], str | None] = lambda args: None


def verdict(ok: bool) -> str:
    return "pass" if ok else "fail"


def gpu_args(args: argparse.Namespace, preset: str) -> argparse.Namespace:
    """bench/gpu.py's arguments for one of its shapes, as this check runs it."""
    cuda = args.device == "cuda"
    return argparse.Namespace(preset=preset, steps=8 if args.quick else args.steps, warmup=3 if args.quick else 5,
                              precision="bf16" if cuda else "fp32", compile=cuda, activation_checkpointing="none",
                              peak_tflops=None)


def start_ray(args: argparse.Namespace, **options) -> None:
    """A local Ray for a part. On CPU it advertises one GPU all the same, as the GPU machine's
    does: a part whose ranks should stay on CPU and leave ``device = auto`` asks for it
    there, and fails here too, not only in the minutes a GPU machine is lent. On the GPU
    machine the ranks' output goes into the part's log: a rank that dies there says why."""
    from elastic.fleet.ray_connection import start_local_ray

    start_local_ray(log_to_driver=args.device == "cuda", **({"num_gpus": 1} if args.device == "cpu" else {}),
                    **options)


# the parts


def throughput(args: argparse.Namespace) -> list[Row]:
    import statistics

    import ray
    from bench import gpu

    shape = gpu_args(args, "tiny" if args.quick else args.preset)
    with tempfile.TemporaryDirectory() as storage:
        start_ray(args)
        # Each run in storage of its own: a run resumes from the last checkpoint of its name.
        a = gpu.run_elastic(gpu.job(shape, f"{storage}/a"))
        a1 = gpu.run_elastic(gpu.job(shape, f"{storage}/a1", memory_every=1))
        ray.shutdown()
        config = gpu.job(shape, f"{storage}/b")
        b = gpu.run_plain(config, storage)
        fsdp2 = gpu.run_plain(config, storage, under_fsdp2=True)
    a_tps = gpu.tokens_per_second(config, a["step_s"], shape.warmup)
    b_tps = gpu.tokens_per_second(config, b["step_s"], shape.warmup)
    peak = gpu.peak_tflops(None)
    mfu = a_tps * gpu.flops_per_token(config, b["parameters"]) / (peak * 1e12) if peak else None

    def median(values: list[float]) -> float:
        return statistics.median(values[shape.warmup:])

    a_step = median(a["step_s"])
    a1_step = median(a1["step_s"])
    tier_cost = a1_step / a_step - 1
    stall = a["stall_s"] / b["sync_save_s"]
    what = f"{b['parameters'] / 1e6:.0f} M params, seq {config.data.seq_len}, {shape.precision}" + (
        " + compile" if shape.compile else "")
    return [
        Row(f"tokens/s, product / plain script ({what})", ">= 0.95",
            f"{a_tps:,.0f} / {b_tps:,.0f} = {a_tps / b_tps:.3f}", verdict(a_tps / b_tps >= 0.95)),
        Row("MFU of the product (6N + 12·layers·dim·seq flops per token)", "plain script on an H100: 34.9 %",
            f"{mfu:.1%}" if mfu is not None else "no known peak for this device", "info"),
        Row("in-memory tier every step: median step over the product's default", "<= 3 %",
            f"{a1_step * 1e3:.1f} ms / {a_step * 1e3:.1f} ms = {tier_cost:+.1%}", verdict(tier_cost <= 0.03)),
        Row("checkpoint stall (pinned staging arena, its second save) / synchronous save", "<= 0.05",
            f"{a['stall_s'] * 1e3:.1f} ms / {b['sync_save_s'] * 1e3:.0f} ms = {stall:.3f} (the first save, which "
            f"also pins the arena: {a['first_stall_s'] * 1e3:.0f} ms)", verdict(stall <= 0.05)),
        Row("group build (one rank)", "<= 15 s", f"{a['build_s']:.1f} s", verdict(a["build_s"] <= 15)),
        Row("where the product's step goes: loop period / the rank's step until its vote / forward and backward",
            "tells a gap's cause", f"{a_step * 1e3:.1f} / {median(a['rank_step_s']) * 1e3:.1f} / "
            f"{median(a['compute_s']) * 1e3:.1f} ms; plain script {median(b['step_s']) * 1e3:.1f} ms", "info"),
        Row("FSDP2 as groups of several ranks wrap the model, on one rank (no communication): step / plain step",
            "FSDP2's own cost", f"{median(fsdp2['step_s']) * 1e3:.1f} / {median(b['step_s']) * 1e3:.1f} ms = "
            f"{median(fsdp2['step_s']) / median(b['step_s']):.2f}x (dynamo: {fsdp2['dynamo']})", "info"),
    ]


def integrity(args: argparse.Namespace) -> list[Row]:
    from bench import gpu
    from bench.integrity import EVERY, TARGET, in_process_cost

    shape = gpu_args(args, "tiny" if args.quick else args.preset)
    with tempfile.TemporaryDirectory() as storage:
        config = gpu.job(shape, storage)
    step_s, check_s, size = in_process_cost(config, torch.device(args.device), repeats=3 if args.quick else 20)
    cost = check_s / (EVERY * step_s)
    same, flip_seen = fingerprint_agreement(torch.device(args.device))
    return [Row(f"integrity fingerprint at every = {EVERY} ({size / 2**30:.2f} GiB of state; the step "
                f"{'bf16 + compile' if args.device == 'cuda' else 'fp32'})", f"<= {TARGET:.0%}",
                f"{check_s * 1e3:.2f} ms per check, {step_s * 1e3:.1f} ms per step: {cost:.2%}", verdict(cost <= TARGET)),
            Row("the device's fingerprints equal the host's for the same tensors (fp32, bf16 in whole and in "
                "part words, a host step count); one flipped bit changes its tensor's", "both",
                f"equal: {same}; flip seen: {flip_seen}", verdict(same and flip_seen))]


def fingerprint_agreement(device: torch.device) -> tuple[bool, bool]:
    from workers.integrity import fingerprints

    torch.manual_seed(0)
    host = [torch.randn(1 << 20), torch.randn(4096).bfloat16(), torch.randn(1001).bfloat16(), torch.tensor(3.0)]
    on_device = [tensor.to(device) for tensor in host[:3]] + host[3:]  # AdamW keeps its step count on the host
    clean = fingerprints(on_device, device).tolist()
    flipped = on_device[0].clone()
    flipped.view(-1)[5:6].view(torch.int32).bitwise_xor_(1 << 30)
    after = fingerprints([flipped] + on_device[1:], device).tolist()
    return clean == fingerprints(host, torch.device("cpu")).tolist(), [a != b for a, b in zip(clean, after)] == [
        True, False, False, False]


# The last, context parallelism's all-gather with its backward (functional collectives, the
# backward's reduce-scatter issued from autograd's device thread): cp 2 died of SIGSEGV on an H200.
GLOO_OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
            "context_all_gather_and_backward")


def context_all_gather_and_backward(x: torch.Tensor) -> None:
    import torch.distributed as dist

    from workers.context_parallel import _all_gather_autograd

    leaf = x.clone().requires_grad_()
    _all_gather_autograd(leaf, gather_dim=0, group=dist.group.WORLD).sum().backward()
    if leaf.grad is None or not torch.equal(leaf.grad.cpu(), torch.full((4,), 2.0)):
        raise AssertionError(f"gradient {leaf.grad}, not the peers' count of ones")


def gloo_op(rank: int, port: int, device: str, answers) -> None:
    """One of two processes on one device: each collective FSDP2, TP, CP and the sums use, over gloo."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for name in GLOO_OPS:
        x = torch.full((4,), float(rank + 1), device=device)
        wide = torch.empty(8, device=device)
        try:
            {"all_reduce": lambda: dist.all_reduce(x),
             "broadcast": lambda: dist.broadcast(x, 0),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(wide, x),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x[:2], x),
             "all_to_all_single": lambda: dist.all_to_all_single(wide[:4], x),
             "context_all_gather_and_backward": lambda: context_all_gather_and_backward(x)}[name]()
            answers.put((rank, name, "works"))
        except Exception as error:  # noqa: BLE001 - the error is the finding
            answers.put((rank, name, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"))
    dist.destroy_process_group()


def gloo_ops(args: argparse.Namespace) -> list[Row]:
    import multiprocessing

    from elastic.testing.loopback import free_port

    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    port = free_port()
    processes = [context.Process(target=gloo_op, args=(rank, port, args.device, answers)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    found: dict[str, str] = {}
    while not answers.empty():
        rank, name, answer = answers.get()
        if rank == 0 or answer != "works":
            found[name] = answer
    return [Row(f"gloo {name} on {args.device} tensors, 2 processes on one device", "finds out",
                found.get(name, "no answer"), "info") for name in GLOO_OPS]


def shared_gpu(args: argparse.Namespace) -> list[Row]:
    from bench import goodput

    step_s = 0.2 if args.quick else args.step_s
    interval = 3 * step_s if args.quick else 8 * step_s
    steps = goodput.steps_for(interval, 1, step_s)
    on_device = ({"device": "cuda", "gpus_per_rank": 0.2, "gpu_collectives": "gloo"} if args.device == "cuda"
                 else {"device": "cpu"})
    rows = []
    start_ray(args, num_cpus=8)
    for shard in (2, 1):  # shard 1 where FSDP2's collectives fail on gloo with CUDA tensors
        layout = on_device | {"shard": shard}
        figure = f"ranks sharing one GPU over gloo: 2 groups x shard {shard} + a warm spare, memory tier every step"
        with tempfile.TemporaryDirectory() as storage:
            try:
                run = goodput.run_elastic(storage, interval, 1, step_s, 1, 1, 0, layout, steps)
                clean = goodput.run_elastic(storage, interval, 0, step_s / 20, 0, 1, 0, layout, steps)
            except Exception as error:  # noqa: BLE001 - the failure is the finding
                rows.append(Row(figure, "completes", f"failed: {type(error).__name__}: {str(error)[:300]}", "fail"))
                continue
        difference = max(abs(x - y) / abs(y) for x, y in zip(run["losses"], clean["losses"]))
        same = len(run["losses"]) == len(clean["losses"]) == steps and difference <= 1e-5
        rows.append(Row(figure + ", one rank killed: committed losses against the clean run",
                        "equal to 1e-5", f"{len(run['losses'])} steps, largest difference {difference:.1e}",
                        verdict(same)))
        whole = max(run["whole_steps"])
        rows.append(Row("kill to the whole group again, warm spare (CUDA context made ahead)", "<= 2 step times",
                        f"{whole:.2f} step times (step {run['healthy_s']:.2f} s; spares taken {run['spares_taken']}; "
                        f"by phase, s: {'; '.join(map(goodput.phase_line, run['whole_phases']))})",
                        verdict(whole <= 2)))
        break
    return rows


def control_plane(args: argparse.Namespace) -> list[Row]:
    import ray
    from bench import null_ranks

    ranks = 4 if args.quick else 128  # quick: one group of null ranks, the suite's (the figure is the GPU host's)
    steps = 45 if args.quick else 150
    ray.cloudpickle.register_pickle_by_value(null_ranks)
    start_ray(args, num_cpus=ranks + 2)
    with tempfile.TemporaryDirectory() as tmp:
        cpu_s, wait_s = null_ranks.measure_runs(ranks, steps, 0.05, tmp)
    return [Row(f"driver CPU per steady-state step, {ranks} null ranks on Ray actors ({os.cpu_count()} cores)",
                "<= 1 ms", f"{cpu_s * 1e3:.3f} ms (ranks' wait {wait_s * 1e3:+.2f} ms per step)",
                verdict(cpu_s <= 1e-3))]


class Tee(io.StringIO):
    """Keeps what is written and passes it on as it comes: a part that runs out of time
    leaves in its log what it had printed."""

    def __init__(self, sink):
        super().__init__()
        self.sink = sink

    def write(self, text: str) -> int:
        self.sink.write(text)
        self.sink.flush()
        return super().write(text)


def stragglers(args: argparse.Namespace) -> list[Row]:
    import contextlib

    from bench import stragglers as bench

    argv = ["--sim-steps", "50", "--noise-steps", "4", "--steps", "24", "--onset-s", "0.5"] if args.quick else []
    output = Tee(sys.stdout)
    with contextlib.redirect_stdout(output):
        status = bench.main(argv)
    text = output.getvalue()
    recovered = re.search(r"slowdown recovered by the mitigation: (\S+)%", text)
    refilled = re.search(r"once the spare taken is replaced .*; recovered (\S+)%", text)
    detection = re.search(r"onset to detection: (\d+) steps", text)
    if not (recovered and detection):  # no figures, whatever the bench's exit: a fail, with its last words
        return [Row(f"a slow rank detected and its slowdown recovered ({os.cpu_count()} cores)", "its figures",
                    f"none (exit {status}): " + text.strip()[-200:], "fail")]
    measured = f"{recovered.group(1)} % of the slowdown"
    if refilled:
        measured += f" ({refilled.group(1)} % once the spare taken was replaced)"
    steps = int(detection.group(1))
    noise = re.findall(r"(?:simulated|real): [^\n]*mitigations", text)
    return [Row(f"slow rank's slowdown recovered, spare on cores of its own ({os.cpu_count()} cores)", ">= 60 %",
                measured, verdict(float(recovered.group(1)) >= 60)),
            Row(f"a slow rank's onset to its detection ({os.cpu_count()} cores)", "<= 10 steps", f"{steps} steps",
                verdict(steps <= 10)),
            Row("noise alone (+/-15 % on every rank), simulated and real: mitigations", "none",
                "; ".join(noise), verdict(bool(noise) and all(line.endswith(" 0 mitigations") for line in noise)))]


def float8(args: argparse.Namespace) -> list[Row]:
    import ray
    from bench import gpu

    shape = gpu_args(args, "1b")
    start_ray(args)
    # Compute alone, a storage folder each, removed after its run: at this shape the state is
    # 14.7 GB; three saves a run outlasted the final save's default grace (the H100 run of
    # 2026-11-26), and two runs' kept checkpoints would outgrow the GPU machine's 64 GiB disk.
    with tempfile.TemporaryDirectory() as storage:
        config = gpu.job(shape, storage, compute_only=True)
        bf16 = gpu.run_elastic(config)
    bf16_tps = gpu.tokens_per_second(config, bf16["step_s"], shape.warmup)
    print(f"bf16: {bf16_tps:,.0f} tokens/s, last loss {bf16['losses'][-1]:.4f}", flush=True)  # kept should float8 time out
    with tempfile.TemporaryDirectory() as storage:
        fp8 = gpu.run_elastic(gpu.job(shape, storage, float8=True, compute_only=True))
    ray.shutdown()
    fp8_tps = gpu.tokens_per_second(config, fp8["step_s"], shape.warmup)
    drift = max(abs(a - b) / a for a, b in zip(bf16["losses"], fp8["losses"]))
    return [Row("tokens/s, float8 / bf16, both with compile (1.23 B: dim 2048, 24 layers, ffn 5632, seq 2048)",
                ">= 1.2x", f"{fp8_tps:,.0f} / {bf16_tps:,.0f} = {fp8_tps / bf16_tps:.2f}x",
                verdict(fp8_tps / bf16_tps >= 1.2)),
            Row("float8's losses against bf16's, the same steps", "tells float8's drift",
                f"largest relative difference {drift:.2%} over {len(fp8['losses'])} steps "
                f"(last: {fp8['losses'][-1]:.4f} / {bf16['losses'][-1]:.4f})", "info")]


# the new paths on CUDA


def product_job(storage: str, name: str, device: str, ranks: int, scaling: dict, model: dict,
                compute: dict | None = None, steps: int = 10, seq_len: int = 256):
    """A small job of ``ranks`` ranks in one group on ``device``: on a GPU every rank shares it
    over gloo, as ``shared_gpu``'s do. Compute alone (no mid-run checkpoint, no memory tier)."""
    from elastic.setup.preflight import build_config

    place = ({"device": "cuda", "gpus_per_rank": 1 / ranks, "gpu_collectives": "gloo"} if device == "cuda"
             else {"device": "cpu"})
    return build_config({
        "run_name": name, "storage": storage, "steps": steps, "global_batch": 8, "micro_batch": 4, "seed": 0,
        "scaling": {"min_groups": 1, "max_groups": 1, "shard": 1, "tp": 1} | place | scaling,
        "model": {"vocab_size": 256, "n_heads": 8} | model,
        "data": {"seq_len": seq_len, "corpus_tokens": 2_000_000},
        "compute": compute or {},
        "checkpoint": {"every": 0, "memory_every": 0},
        "stragglers": {"enabled": False},
        "fault_tolerance": {"first_step_deadline_s": 900},
    })


def run_product(config) -> dict:
    """The run's committed losses, its median step (the first two left out: compile, allocator)
    and the peak of the GPU's memory in use over the run (every rank's, the driver's context
    included), where a GPU is the run's."""
    import statistics
    import threading

    from elastic import ElasticTrainer
    from elastic.core.events import EventKind

    peak, done = [0], threading.Event()

    def watch() -> None:  # the ranks are other processes: the device's own count sees them all
        while not done.wait(0.05):
            free, total = torch.cuda.mem_get_info()
            peak[0] = max(peak[0], total - free)

    watcher = threading.Thread(target=watch, daemon=True)
    if config.scaling.device == "cuda":
        watcher.start()
    try:
        result = ElasticTrainer(config).fit()
    finally:
        done.set()
    if not result.ok:
        failures = [event for event in result.summary["events"] if event["kind"] == EventKind.FAILURE_DIAGNOSED]
        raise RuntimeError(f"{config.run_name}: {result.exit}; failures: {failures[:3]}")
    step_s = [record["step_s"] for record in result.summary["steps"]]
    return {"losses": result.losses, "step_s": statistics.median(step_s[2:]), "peak_bytes": peak[0]}


def largest_difference(losses: list[float], reference: list[float]) -> float:
    """The runs' largest relative loss difference; inf where they committed different numbers of
    steps (a failed row, not a failed part)."""
    from elastic.testing.losses import max_relative_difference

    return max_relative_difference(losses, reference) if len(losses) == len(reference) else math.inf


def against_one_rank(args: argparse.Namespace, figure: str, ranks: int, scaling: dict, model: dict,
                     seq_len: int = 256, tolerance: float = 1e-4) -> list[Row]:
    """The same fp32 job at a layout of ``ranks`` ranks and on one rank, both on the device. A
    seed's first weights are drawn from the device's own generator, so a device's runs compare
    with each other, not with CPU ranks' (the GPU run of 2026-11-28: step 0's loss 5.494 on
    CUDA, 5.551 on CPU, for the same seed)."""
    import ray

    if not ray.is_initialized():
        start_ray(args)
    runs = {}
    for name, count, layout in (("split", ranks, scaling), ("one-rank", 1, {})):
        with tempfile.TemporaryDirectory() as storage:
            runs[name] = run_product(product_job(storage, name, args.device, count, layout, model,
                                                 {"precision": "fp32"}, steps=4 if args.quick else 10, seq_len=seq_len))
    split, alone = runs["split"], runs["one-rank"]
    difference = largest_difference(split["losses"], alone["losses"])
    print(f"{figure}: losses {split['losses']}; on one rank {alone['losses']}", flush=True)
    return [Row(f"{figure}, fp32, on {args.device}: committed losses against one rank's", f"equal to {tolerance:g}",
                f"{len(split['losses'])} steps, largest relative difference {difference:.1e}; median step "
                f"{split['step_s'] * 1e3:.1f} ms ({alone['step_s'] * 1e3:.1f} ms on one rank)",
                verdict(difference <= tolerance))]


def failure(error: Exception) -> str:
    """An error and where it was raised: the row is all a GPU run may leave of it."""
    import traceback

    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"{type(error).__name__}: {str(error)[:240]} (at {Path(frame.filename).name}:{frame.lineno}, {frame.name})"


def experts(args: argparse.Namespace) -> list[Row]:
    """The mixture of experts in one process on the device (bench/moe.py's figures), and the
    product's ep 2 over two ranks of one GPU against the same on CPU ranks."""
    device = torch.device(args.device)
    shape = argparse.Namespace(dim=128 if args.quick else 1024, layers=2 if args.quick else 8, experts=8, top_k=2,
                               seq_len=128 if args.quick else 1024, batch=4 if args.quick else 8,
                               steps=8 if args.quick else 40, bias_rate=0.01)
    try:
        rows = experts_in_process(device, shape)
    except Exception as error:  # noqa: BLE001 - the failure is the finding; the product's run below still runs
        rows = [Row("MoE and its grouped GEMM in one process", "runs", f"failed: {failure(error)}", "fail")]
    return rows + against_one_rank(args, "1 group x shard 2 x ep 2, 8 experts (all-to-all over gloo)", 2,
                                   {"shard": 2, "ep": 2},
                                   {"dim": 128, "n_layers": 2, "ffn_hidden": 256, "experts": 8, "experts_per_token": 2,
                                    "expert_hidden": 256})


def experts_in_process(device: torch.device, shape: argparse.Namespace) -> list[Row]:
    import statistics

    from bench import moe
    from workers import experts as experts_code

    hidden = shape.dim * 2
    looped_calls = [0]
    looped = experts_code.looped_mm

    def counting_looped(*arguments):
        looped_calls[0] += 1
        return looped(*arguments)

    with tempfile.TemporaryDirectory() as storage:
        mixture = moe.config(shape, storage, ffn_hidden=hidden, experts=shape.experts, experts_per_token=shape.top_k,
                             expert_hidden=hidden)
        dense = moe.config(shape, storage, ffn_hidden=hidden * shape.top_k)
        timed = 6 if device.type == "cpu" else 20
        experts_code.looped_mm = counting_looped
        try:
            mixture_s = statistics.median(moe.train(mixture, timed, device=device)[3:])
        finally:
            experts_code.looped_mm = looped
        dense_s = statistics.median(moe.train(dense, timed, device=device)[3:])
    grouped_s, looped_s = moe.expert_kernels(shape, device)
    tokens = shape.batch * shape.seq_len
    where = "bf16 autocast" if device.type == "cuda" else "fp32"
    return [
        Row(f"MoE tokens/s over the dense model of the same active parameters ({shape.layers} layers of width "
            f"{shape.dim}, {shape.experts} experts of {hidden}, {shape.top_k} a token, {tokens} tokens a step, {where})",
            "CPU: 0.77", f"{tokens / mixture_s:,.0f} / {tokens / dense_s:,.0f} = {dense_s / mixture_s:.2f} (the "
            f"experts' products went a matmul per expert {looped_calls[0]} times over {timed} steps)", "info"),
        Row("one grouped GEMM over a matmul per expert, the experts' three products forward and backward", "CPU: 0.99",
            f"{grouped_s * 1e3:.2f} / {looped_s * 1e3:.2f} ms = {grouped_s / looped_s:.2f}", "info"),
    ]


def context(args: argparse.Namespace) -> list[Row]:
    """Context parallelism at cp 2 on one GPU's two ranks (gloo carries the keys and values),
    against cp 1 on the device."""
    return against_one_rank(args, "1 group x cp 2, seq 1024", 2, {"cp": 2},
                            {"dim": 256, "n_layers": 2, "ffn_hidden": 768}, 1024)


def precision(args: argparse.Namespace) -> list[Row]:
    """fp16 with its loss scale against bf16 on one rank (the throughput part's shape, with
    compile); then CPU offload's cost at shard 2 on one GPU's two ranks: step and memory."""
    from bench import gpu

    shape = gpu_args(args, "tiny" if args.quick else args.preset)
    shape.steps, shape.compile = 8 if args.quick else 30, False  # compile's minutes go to the other parts
    runs = {}
    start_ray(args)
    for name in ("bf16", "fp16"):
        shape.precision = name if args.device == "cuda" else "fp32"
        with tempfile.TemporaryDirectory() as storage:
            runs[name] = run_product(gpu.job(shape, storage, compute_only=True))
        print(f"{name} losses: {runs[name]['losses']}", flush=True)  # the log says where the two part
    between = largest_difference(runs["fp16"]["losses"], runs["bf16"]["losses"])
    rows = [Row(f"fp16 (dynamic loss scale) against bf16, one rank, {shape.preset}, no compile: tokens/s ratio and "
                "committed losses", "losses within 5 % at every step",
                f"step {runs['fp16']['step_s'] * 1e3:.1f} / {runs['bf16']['step_s'] * 1e3:.1f} ms = "
                f"{runs['bf16']['step_s'] / runs['fp16']['step_s']:.2f}x the tokens/s; largest relative loss "
                f"difference {between:.2%} over {len(runs['fp16']['losses'])} steps", verdict(between <= 0.05))]
    model = {"dim": 256 if args.quick else 2048, "n_layers": 2 if args.quick else 4,
             "ffn_hidden": 768 if args.quick else 5632, "n_heads": 16}
    offload = {}
    for setting in (False, True):
        with tempfile.TemporaryDirectory() as storage:
            offload[setting] = run_product(product_job(
                storage, f"offload-{setting}", args.device, 2, {"shard": 2}, model,
                {"precision": "bf16" if args.device == "cuda" else "fp32", "offload": setting},
                steps=4 if args.quick else 8, seq_len=1024))
    same = largest_difference(offload[True]["losses"], offload[False]["losses"])
    memory = (f"; the GPU's peak in use {offload[True]['peak_bytes'] / 2**30:.2f} / "
              f"{offload[False]['peak_bytes'] / 2**30:.2f} GiB" if args.device == "cuda" else "")
    return rows + [Row(f"CPU offload at shard 2 over gloo ({model['dim']} wide, {model['n_layers']} layers): step with "
                       "offload / without", "its cost, and the same losses (1e-3)",
                       f"{offload[True]['step_s'] * 1e3:.0f} / {offload[False]['step_s'] * 1e3:.0f} ms = "
                       f"{offload[True]['step_s'] / offload[False]['step_s']:.2f}x{memory}; largest loss difference "
                       f"{same:.1e}", verdict(same <= 1e-3))]


def heal_transport(args: argparse.Namespace) -> list[Row]:
    """The heal's copy between two actors on one GPU: rank to rank over gloo (the product's
    road), the object store (its fallback) and Ray Direct Transport's CUDA IPC
    (``bench/heal_transport.py``)."""
    from bench import heal_transport as bench

    start_ray(args)
    dim, layers = (128, 2) if args.quick else (1024, 16)
    result = bench.measure(dim, layers, args.device, 2)
    medians = {road: min(seconds) for road, seconds in result["seconds"].items()}
    rates = "; ".join(f"{road} {seconds:.2f} s, {result['bytes'] / seconds / 1e9:.2f} GB/s"
                      for road, seconds in medians.items())
    rows = [Row(f"the heal's copy of a rank's state ({result['bytes'] / 1e9:.1f} GB: dim {dim}, {layers} layers, "
                "AdamW) between two actors on one device, best of the copies", "device transport faster",
                rates, verdict(result["whole"] and ("CUDA IPC" not in medians
                                                    or medians["CUDA IPC"] < medians["object store"])))]
    if "CUDA IPC" in medians:
        rows.append(Row("CUDA IPC over the object store, the same state", "ratio",
                        f"{medians['object store'] / medians['CUDA IPC']:.1f}x faster", "info"))
    return rows


def torchtitan(args: argparse.Namespace) -> list[Row]:
    """TorchTitan's own trainer on the float8 part's 1.23 B shape, on this device (``bench/torchtitan_job.py``)."""
    argv = [sys.executable, str(ROOT / "bench" / "torchtitan_job.py"), "--device", args.device, "--timeout", "220"]
    argv += ["--quick"] if args.quick else ["--steps", "20"]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    sys.stdout.write(done.stdout + done.stderr)
    found = re.search(r"^TORCHTITAN_RESULT (.+)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or not found:
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        return [Row("TorchTitan's trainer, 1.23 B shape", "runs", f"failed (exit {done.returncode}): {last[0][:300]}",
                    "fail")]
    result = json.loads(found.group(1))
    peak = result["peak_mem_allocated_gib"]
    return [Row(f"TorchTitan {result['torchtitan_version']}'s trainer at the 1.23 B shape, bf16 + compile, one rank: "
                "tokens/s and peak memory", "ours beside it (the float8 part's bf16 run)",
                f"{result['tokens_per_s']:,.0f} tokens/s, peak allocated "
                + (f"{peak:.1f} GiB" if peak is not None else "not measured (no CUDA)"), "info")]


def supports_float8(args: argparse.Namespace) -> str | None:
    if args.device == "cpu":
        return "float8 is refused on CPU ranks; tests/test_float8.py holds its conversion, TP and FSDP2 on CPU"
    if not torch.cuda.is_available():
        return "--device cuda, but torch sees no GPU"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"{torch.cuda.get_device_name()} has compute capability {torch.cuda.get_device_capability()}, under 8.9"
    return None


def needs_torchtitan(args: argparse.Namespace) -> str | None:
    import importlib.util

    return None if importlib.util.find_spec("torchtitan") else "torchtitan is not installed (bundle.sh carries it)"


def needs_cuda(args: argparse.Namespace) -> str | None:
    return None if args.device == "cpu" or torch.cuda.is_available() else "--device cuda, but torch sees no GPU"


PARTS = [
    Part("throughput", throughput, 330, needs_cuda),
    Part("experts", experts, 150),
    Part("context", context, 90),
    Part("precision", precision, 200),
    Part("heal_transport", heal_transport, 120),
    Part("torchtitan", torchtitan, 240, needs_torchtitan),
    Part("integrity", integrity, 90, needs_cuda),
    Part("gloo_ops", gloo_ops, 60, needs_cuda),
    Part("shared_gpu", shared_gpu, 180, needs_cuda),
    Part("control_plane", control_plane, 150),
    Part("stragglers", stragglers, 300),
    Part("float8", float8, 420, supports_float8),
]


# running the parts


def command_of(args: argparse.Namespace, part: str) -> str:
    words = ["python", "bench/gpu_check.py", "--device", args.device, "--only", part, "--out", "OUT"]
    if args.quick:
        words.append("--quick")
    return " ".join(words)


def run_part(args: argparse.Namespace, part: Part, out: Path, limit: float) -> tuple[list[Row], float]:
    """The part in a child process under ``limit`` seconds: its rows, or one row saying how it failed."""
    with tempfile.TemporaryDirectory() as scratch:  # out of --out: a GPU machine sends back few files
        result = Path(scratch) / f"{part.name}.json"
        argv = [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--only", part.name,
                "--out", str(out), "--preset", args.preset, "--steps", str(args.steps), "--step-s", str(args.step_s),
                "--result", str(result)] + (["--quick"] if args.quick else [])
        started = time.perf_counter()
        with open(out / f"{part.name}.log", "w") as log:
            # A session of its own, so a part's leftovers (Ray, ranks) go with it on a timeout.
            child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            try:
                code = child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, 9)
                child.wait()
                code = None
        seconds = time.perf_counter() - started
        rows = [Row(**row) for row in json.loads(result.read_text())] if code == 0 and result.exists() else None
    if rows is not None:
        return rows, seconds
    tail = (out / f"{part.name}.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
    why = f"timed out after {limit:.0f} s" if code is None else f"exit {code}: {tail[0][:300]}"
    return [Row(part.name, "completes", f"failed ({why}); see {part.name}.log", "fail")], seconds


def device_name(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU ({os.cpu_count()} cores)"


def host_cpu() -> str:
    """The host's CPU model: the CPU-bound parts (control_plane, stragglers) differ by machine."""
    try:
        models = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.MULTILINE)
    except OSError:
        models = []
    return f"{models[0] if models else platform.processor() or 'unknown CPU'} x {os.cpu_count()}"


def table(args: argparse.Namespace, rows: list[tuple[str, Row]], skipped: list[tuple[str, str]]) -> str:
    device = device_name(args.device)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# GPU check, {when}", "",
             f"{device}; host {host_cpu()}; torch {torch.__version__}; Python {platform.python_version()}"
             + ("; --quick (smallest forms: only whether each part runs means anything)" if args.quick else ""), "",
             "| figure | goal | measured | verdict | device | torch | command |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for part, row in rows:
        cells = [row.figure, row.goal, row.measured, row.verdict, device, torch.__version__,
                 f"`{command_of(args, part)}`"]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    if skipped:
        lines += ["", "Skipped:"] + [f"- {name}: {why}" for name, why in skipped]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", required=True, help="the directory for gpu_check.md and the parts' logs")
    parser.add_argument("--only", help="comma-separated parts: " + ", ".join(part.name for part in PARTS))
    parser.add_argument("--quick", action="store_true", help="each part's smallest form (for CPU, in the suite)")
    parser.add_argument("--preset", default="206m", help="bench/gpu.py's shape for throughput and integrity")
    parser.add_argument("--steps", type=int, default=90, help="steps of each throughput run, a checkpoint "
                        "after each third of them: apart enough for an upload to end before the next save")
    parser.add_argument("--step-s", type=float, default=1.0, help="shared_gpu's paced step time")
    parser.add_argument("--budget-s", type=float, help="seconds for all the parts: a part gets what is left, "
                                                        "up to its own limit; none is started with under 30 s")
    parser.add_argument("--result", help=argparse.SUPPRESS)  # a child's: where it writes its part's rows
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    by_name = {part.name: part for part in PARTS}
    names = args.only.split(",") if args.only else list(by_name)
    unknown = [name for name in names if name not in by_name]
    if unknown:
        parser.error(f"--only: unknown part {unknown[0]!r}; use {', '.join(by_name)}")
    if args.result:
        [name] = names
        rows = by_name[name].measure(args)
        Path(args.result).write_text(json.dumps([asdict(row) for row in rows]))
        return 0
    rows, skipped = [], []
    deadline = time.monotonic() + (args.budget_s or math.inf)
    for name in names:
        part = by_name[name]
        left = deadline - time.monotonic()
        limit = min(part.time_limit_s, left)
        why = part.skip_reason(args) or (f"{left:.0f} s left of --budget-s" if left < 30 else None)
        if why:
            skipped.append((name, why))
            print(f"skipped {name}: {why}", flush=True)
            continue
        part_rows, seconds = run_part(args, part, out, limit)
        rows += [(name, row) for row in part_rows]
        for row in part_rows:
            print(f"{name} ({seconds:.0f} s): {row.figure}: {row.measured} [{row.verdict}; goal {row.goal}]", flush=True)
    (out / "gpu_check.md").write_text(table(args, rows, skipped))
    print(f"table: {out / 'gpu_check.md'}")
    return 0 if all(row.verdict != "fail" for _, row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

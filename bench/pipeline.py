"""What the large-model layouts cost and save, measured on the reference model:

- sequence parallelism at tp 2: each rank's peak memory over one forward and backward, with
  it on and off (two spawned gloo ranks, the product's TP plan), beside the activation
  memory the estimate (``elastic.setup.memory_estimate``) predicts for each;
- activation checkpointing: peak memory and step time of ``none``, ``full``, ``selective``
  per op and ``selective`` every 2nd block, one process each;
- the pipeline bubble against the schedule's theory, ``(p - 1) / (m + p - 1)`` for 1F1B: two
  spawned gloo ranks, each one stage of the reference model (``workers.pipeline``), at m = 4
  and 8 micro-batches. The bubble is the share of a step a rank spends outside its stage's
  forward and backward chunks (waiting on the other stage, and the sends and receives). The
  theory assumes stages of equal cost: the model has a small vocabulary (``BUBBLE_VOCAB``) so
  that the last stage's head and loss cost little; what imbalance is left makes the first
  stage wait longer than the theory says and the last less.

Peak memory: torch's ``MemTracker`` over one forward and backward (the peak of the tensors
alive, by kind: parameters, gradients, activations, temporaries), then the median of
``--steps`` passes untracked for the step time.

    python bench/pipeline.py [--dim 256] [--layers 4] [--seq 512] [--batch 2] [--steps 5] [--only NAME]
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
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.setup.memory_estimate import activation_bytes  # noqa: E402
from workers.model import ModelArgs, Transformer  # noqa: E402
from workers.parallelize import tensor_parallelize_transformer, wrap_blocks  # noqa: E402
from workers.pipeline import Pipeline, PipelineLayout, cut_stages, split_transformer  # noqa: E402
from workers.train_step import Batch, token_cross_entropy  # noqa: E402

MIB = 2**20
VOCAB = 4096
# The bubble's model: a small vocabulary keeps the last stage's head and loss cheap, so the
# two stages cost about the same, as the schedule's theory assumes.
BUBBLE_VOCAB = 256


def model_args(args, vocab: int = VOCAB) -> ModelArgs:
    return ModelArgs(vocab_size=vocab, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4,
                     ffn_hidden=args.dim * 8 // 3 // 64 * 64, max_seq_len=args.seq)


def measure(model: torch.nn.Module, args, steps: int) -> tuple[int, int, float]:
    """(peak bytes of all tensors, of activations, over one forward and backward; median step s)."""
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    [peak] = tracker.get_tracker_snapshot("peak").values()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return peak["Total"], peak[_MemRefType.ACT], statistics.median(times)


def checkpointing_case(mode: str, selective, args, result_path: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(model_args(args))
    wrap_blocks(model, mode, compile_blocks=False, selective=selective)
    Path(result_path).write_text(" ".join(map(str, measure(model, args, args.steps))))


def sequence_parallel_rank(rank: int, init_file: str, sequence_parallel: bool, args, result_path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Transformer(model_args(args))
    tensor_parallelize_transformer(model, tp_mesh, sequence_parallel)
    Path(f"{result_path}.{rank}").write_text(" ".join(map(str, measure(model, args, args.steps))))
    dist.destroy_process_group()


def in_fresh_process(target, case_args: tuple, processes: int = 1) -> list[tuple[float, float, float]]:
    """Run ``target(*case_args, result_path)`` (with the rank first when ``processes`` > 1) in
    fresh spawned processes; what each measured."""
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as directory:
        path = str(Path(directory) / "result")
        if processes == 1:
            workers = [context.Process(target=target, args=(*case_args, path))]
            paths = [path]
        else:
            init_file = str(Path(directory) / "init")
            workers = [context.Process(target=target, args=(rank, init_file, *case_args, path))
                       for rank in range(processes)]
            paths = [f"{path}.{rank}" for rank in range(processes)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
            assert worker.exitcode == 0, f"a measuring process exited {worker.exitcode}"
        return [tuple(map(float, Path(each).read_text().split())) for each in paths]


class BusyClock:
    """Seconds a pipeline rank spends inside its stage's chunks (``workers.pipeline``'s watcher)."""

    def __init__(self):
        self.busy_s = 0.0
        self._started = 0.0

    def chunk_started(self) -> None:
        self._started = time.perf_counter()

    def chunk_ended(self) -> None:
        self.busy_s += time.perf_counter() - self._started


def bubble_rank(rank: int, init_file: str, micro_batches: int, args, result_path: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2, 1, 1), mesh_dim_names=("pp", "shard", "tp"))
    layout = PipelineLayout(pp=2, schedule="1F1B", micro_batch=1)
    torch.manual_seed(0)
    clock = BusyClock()
    model = Transformer(model_args(args, BUBBLE_VOCAB))
    [stage] = cut_stages(model, split_transformer, layout.stages_of(rank), layout.n_stages)
    pipeline = Pipeline(layout, rank, [stage], mesh["pp"].get_group(), torch.device("cpu"), token_cross_entropy,
                        clock)
    tokens = torch.randint(0, BUBBLE_VOCAB, (micro_batches, args.seq + 1), generator=torch.Generator().manual_seed(0))
    batches = [Batch(row[None, :-1], row[None, 1:], torch.ones(1, args.seq), args.seq) for row in tokens]
    shares = []
    for step in range(args.steps + 1):  # the first step infers the stages' shapes: not timed
        dist.barrier()
        clock.busy_s = 0.0
        started = time.perf_counter()
        pipeline.loss_share(batches, micro_batches * args.seq)
        wall_s = time.perf_counter() - started
        stage.zero_grad()
        if step:
            shares.append(1.0 - clock.busy_s / wall_s)
    Path(f"{result_path}.{rank}").write_text(f"{statistics.median(shares)}")
    dist.destroy_process_group()


def estimated_activations(args, sequence_parallel: bool) -> float:
    # ModelArgs is the model's shape (elastic.core.model_shape), which the estimate reads
    return activation_bytes(model_args(args), tp=2, tokens=args.batch * args.seq, compute=4,
                            activation_checkpointing=False,
                            sequence_parallel=sequence_parallel)


def sequence_parallelism(args) -> None:
    print(f"reference model: dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, fp32, CPU")
    print("sequence parallelism, tp 2 (per rank: peak of all tensors and of activations over one step, "
          "the estimate's activations, median step)")
    activations = {}
    for sequence_parallel in (False, True):
        ranks = in_fresh_process(sequence_parallel_rank, (sequence_parallel, args), processes=2)
        total, activations[sequence_parallel], step_s = (max(column) for column in zip(*ranks))
        print(f"  {'on ' if sequence_parallel else 'off'}: peak {total / MIB:7.1f} MiB, activations "
              f"{activations[sequence_parallel] / MIB:7.1f} MiB (estimate "
              f"{estimated_activations(args, sequence_parallel) / MIB:7.1f}), step {step_s * 1e3:7.1f} ms")
    print(f"  on/off activations: {activations[True] / activations[False]:.3f} measured, "
          f"{estimated_activations(args, True) / estimated_activations(args, False):.3f} estimated")


def activation_checkpointing(args) -> None:
    print(f"reference model: dim {args.dim}, {args.layers} layers, seq {args.seq}, batch {args.batch}, fp32, CPU")
    print("activation checkpointing (one process: peak of all tensors and of activations over one step, "
          "median step)")
    cases = {"none": ("none", "op"), "full": ("full", "op"), "selective per op": ("selective", "op"),
             "selective every 2nd block": ("selective", 2)}
    measured = {name: in_fresh_process(checkpointing_case, (*case, args))[0] for name, case in cases.items()}
    none, full = measured["none"], measured["full"]
    for name, (total, acts, step_s) in measured.items():
        print(f"  {name:26s}: peak {total / MIB:7.1f} MiB ({total / none[0]:.3f} of none, {total / full[0]:.3f} "
              f"of full), activations {acts / MIB:7.1f} MiB, step {step_s * 1e3:7.1f} ms ({step_s / none[2]:.3f} "
              f"of none, {step_s / full[2]:.3f} of full)")


def bubble(args) -> None:
    print(f"reference model: dim {args.dim}, {args.layers} layers, vocab {BUBBLE_VOCAB}, seq {args.seq}, one sample "
          "per micro-batch, fp32, CPU")
    print("pipeline bubble, 1F1B, p = 2 (per rank: median share of a step outside its stage's chunks)")
    for micro_batches in (4, 8):
        measured = [share for (share,) in in_fresh_process(bubble_rank, (micro_batches, args), processes=2)]
        theory = 1 / (micro_batches + 1)
        print(f"  m = {micro_batches}: stage 0 {measured[0]:.3f}, stage 1 {measured[1]:.3f}; theory {theory:.3f} "
              f"(measured / theory: {measured[0] / theory:.2f}, {measured[1] / theory:.2f})")


PARTS = {"sequence_parallelism": sequence_parallelism, "activation_checkpointing": activation_checkpointing,
         "bubble": bubble}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", choices=PARTS, help="run one part")
    args = parser.parse_args()
    for part in [args.only] if args.only else PARTS:
        PARTS[part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

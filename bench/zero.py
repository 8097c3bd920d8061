"""ZeRO-3 against ZeRO-2 (``scaling.reshard_after_forward``) and CPU offload
(``compute.offload``): a rank's step time and its peak memory over a step, at shard 2.

Two gloo processes form one group and train the reference model under the default
parallelize hook, as a rank does, once per setting: a few steps to warm up, then the
measured ones. The peak is the process's resident high-water mark over the measured steps
(``VmHWM``, reset before them), above the memory it held before them: on CPU ranks every
tensor is in host memory, so offload moves nothing and its row shows only its own cost (the
copies FSDP2 makes and the optimizer step's placement); on a GPU its device memory falls by
the parameters, gradients and optimizer state (the memory estimate: ``docs/presets.md``).

    python bench/zero.py                   # dim 768, 8 layers, seq 256, micro-batch 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from elastic.testing.gloo_ranks import gloo_ranks  # noqa: E402
from elastic.testing.memory import reset_peak_rss, rss_bytes  # noqa: E402
from workers.model import ModelArgs, Transformer  # noqa: E402
from workers.parallelize import Parallelize  # noqa: E402

SETTINGS = {"ZeRO-3 (always)": {}, "ZeRO-2 (never)": {"reshard_after_forward": False},
            "ZeRO-3 + offload": {"offload": True}}


def rank(rank_index: int, args: argparse.Namespace, options: dict) -> tuple[float, float]:
    """(median step seconds, peak MiB above the memory held once the model was built)."""
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("shard", "tp"))
    torch.manual_seed(0)
    model = Parallelize(**options)(Transformer(ModelArgs(
        vocab_size=4096, dim=args.dim, n_layers=args.layers, n_heads=16, n_kv_heads=16, ffn_hidden=4 * args.dim,
        max_seq_len=args.seq)), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 4096, (args.micro_batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    field = reset_peak_rss()
    before = rss_bytes("VmRSS")
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:]), (rss_bytes(field) - before) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    results = {}
    for name, options in SETTINGS.items():  # each in fresh processes: a clean baseline
        with tempfile.TemporaryDirectory() as directory:
            ranks = gloo_ranks(rank, 2, f"{directory}/init", args, options, wait_s=1800)
        results[name] = tuple(max(result[i] for result in ranks) for i in (0, 1))
    print(f"shard 2 on CPU (gloo), dim {args.dim}, {args.layers} layers, seq {args.seq} x {args.micro_batch}: the "
          "slower rank's median step, and the larger peak above the memory held once the model was built "
          "(first step included: the optimizer's state appears in it)")
    base_time, base_peak = results[next(iter(SETTINGS))]
    print(f"{'setting':<20} {'step s':>8} {'x ZeRO-3':>9} {'peak MiB':>9} {'x ZeRO-3':>9}")
    for name, (step_s, peak) in results.items():
        print(f"{name:<20} {step_s:8.3f} {step_s / base_time:9.2f} {peak:9.0f} {peak / base_peak:9.2f}")


if __name__ == "__main__":
    main()

"""Context parallelism (``scaling.cp``) at a fixed sequence: a rank's activation memory and
its step time against ``cp``, as ratios to ``cp = 1``.

``cp`` gloo processes form one group of ``shard 1 x cp`` and train the reference model
under the default parallelize hook, as ranks do (FSDP2 over the cp ranks, attention over the
gathered keys and values). A rank's activation memory is what autograd saves for backward
over one forward of the model split over the sequence alone, without FSDP2, whose gathered
weights autograd would count too (``elastic.testing.memory.SavedBytes``: each storage once,
the parameters not). On CPU torch materialises the lower-right causal bias of each chunk whose keys
outnumber its queries (fp32, ``chunk x keys``; the fused CUDA kernels take the bias as it
is): its bytes, computed from the chunks' shapes, are shown apart and taken out of the
ratio, which the memory estimate's (``elastic.setup.memory_estimate.activation_bytes``)
stands beside. The step is forward, backward and the optimizer's step, the median of the
measured ones, the slower rank's. On this machine's two cores, ``cp`` processes share them: past
``cp = 2`` the step time measures the contention too, not only the split.

    python bench/context.py                   # dim 512, 4 layers, seq 4096, cp 1, 2, 4
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

from elastic.core.topology import Topology  # noqa: E402
from elastic.setup.config import ModelConfig  # noqa: E402
from elastic.setup.memory_estimate import activation_bytes  # noqa: E402
from elastic.testing.gloo_ranks import gloo_ranks  # noqa: E402
from elastic.testing.memory import SavedBytes, held_storages  # noqa: E402
from workers.context_parallel import ContextShare  # noqa: E402
from workers.model import ModelArgs, Transformer  # noqa: E402
from workers.parallelize import Parallelize, split_sequences  # noqa: E402
from workers.world import group_mesh  # noqa: E402


def rank(rank_index: int, args: argparse.Namespace, cp: int) -> tuple[float, int, int]:
    """(median step seconds, activation bytes saved by one forward, of which CPU biases)."""
    mesh = group_mesh("cpu", Topology(shard=1, tp=1, cp=cp))
    shape = ModelArgs(vocab_size=4096, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=8,
                      ffn_hidden=4 * args.dim, max_seq_len=args.seq)
    tokens = torch.randint(0, 4096, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if cp > 1:
        share = ContextShare(cp, rank_index, args.seq)
        inputs, targets = share.split(inputs), share.split(targets)
    # The activations of the model split over the sequence alone: FSDP2's gathered weights,
    # which autograd also saves (and FSDP2 frees after the forward), would count.
    alone = Transformer(shape)
    if cp > 1:
        split_sequences(alone, mesh["cp"])
    with SavedBytes(held_storages(alone), floating_only=True) as saved:
        alone(inputs)
    del alone
    torch.manual_seed(0)
    model = Parallelize()(Transformer(shape), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum").backward()  # warm up
    optimizer.zero_grad()
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="sum").backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    return statistics.median(times), saved.total, cpu_bias_bytes(args, cp, rank_index)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = {}
    for cp in args.cp:  # each in fresh processes
        with tempfile.TemporaryDirectory() as directory:
            ranks = gloo_ranks(rank, cp, f"{directory}/init", args, cp, wait_s=1800)
        largest = max(ranks, key=lambda result: result[1] - result[2])  # the most saved, biases aside
        results[cp] = max(step for step, _, _ in ranks), largest[1], largest[2]
    print(f"one sequence of {args.seq} tokens on CPU (gloo), dim {args.dim}, {args.layers} layers, fp32: a rank's "
          "activations saved for backward (the larger rank's) and its median step (the slower rank's)")
    model = ModelConfig(vocab_size=4096, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=8,
                        ffn_hidden=4 * args.dim)
    rows = {}
    for cp, (step_s, saved, bias) in results.items():
        rows[cp] = step_s, saved, bias, activation_bytes(
            model, tp=1, tokens=args.seq // cp, compute=4, activation_checkpointing=False,
            gathered_tokens=args.seq - args.seq // cp)
    base_time, base_saved, base_bias, base_estimate = rows[args.cp[0]]
    print(f"{'cp':>4} {'saved MiB':>10} {'CPU bias MiB':>13} {'without it':>11} {'x cp 1':>7} {'estimate':>9} "
          f"{'x cp 1':>7} {'step s':>8} {'x cp 1':>7}")
    for cp, (step_s, saved, bias, estimate) in rows.items():
        print(f"{cp:>4} {saved / 2**20:10.1f} {bias / 2**20:13.1f} {(saved - bias) / 2**20:11.1f} "
              f"{(saved - bias) / (base_saved - base_bias):7.2f} {estimate / 2**20:9.1f} {estimate / base_estimate:7.2f} "
              f"{step_s:8.3f} {step_s / base_time:7.2f}")


def cpu_bias_bytes(args: argparse.Namespace, cp: int, rank_index: int) -> int:
    """The fp32 causal biases torch materialises on CPU for a rank: in every layer, one for each
    of its chunks whose keys outnumber its queries."""
    if cp == 1:
        return 0
    share = ContextShare(cp, rank_index, args.seq)
    ends = [(chunk + 1) * share.chunk_len for chunk in share.chunks]
    return args.layers * sum(4 * share.chunk_len * end for end in ends if end > share.chunk_len)

if __name__ == "__main__":
    main()

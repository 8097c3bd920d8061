"""Checkpoint cost for a model of >= 50 M parameters (CPU is fine), in one run, against local
disk and against a loopback S3 server (moto):

- sync:     a synchronous DCP save of the full training state (parameters + AdamW), the
            median of two;
- stall:    the training stall per async checkpoint (the copy into the staging arena),
            through the same ``RankCheckpointIO`` the rank actors use; the first save of a
            run also allocates the arena and is shown apart;
- upload:   how long an async upload takes while training runs beside it, with the files
            written by the rank's upload process and, side by side, by a thread of the
            training process (``checkpoint.upload``);
- slowdown: median step time while an upload is in flight over the median step time with
            none.

Targets: stall / sync <= 0.05, upload / sync <= 1.5 and slowdown <= 5 %.

    python bench/checkpoint.py [--dim 768] [--layers 8] [--checkpoints 3]
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpointing.rank_io import RankCheckpointIO, training_state  # noqa: E402
from checkpointing.storage import StorageOptions  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402
from elastic.core.data_plan import DataCursor, take_global_batch  # noqa: E402
from elastic.setup.hooks import resolve_hooks  # noqa: E402
from elastic.testing.s3 import MotoServer, set_test_credentials  # noqa: E402
from workers.train_step import accumulate_gradients, collate  # noqa: E402


class Trainer:
    """One rank, one group: the reference model under the product's FSDP2 wrapping."""

    def __init__(self, args):
        config = build_config({
            "global_batch": args.batch, "micro_batch": args.batch, "seed": 0,
            "scaling": {"shard": 1, "tp": 1},
            "model": {"dim": args.dim, "n_layers": args.layers, "n_heads": 12, "ffn_hidden": args.dim * 8 // 3},
            "data": {"seq_len": args.seq_len, "corpus_tokens": 200_000},
        })
        self.config = config
        self.hooks = resolve_hooks(config)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "tp"))
        torch.manual_seed(0)
        self.model = self.hooks.parallelize_fn(self.hooks.model_fn(), mesh)
        self.optimizer = self.hooks.optimizer_fn(self.model.parameters())
        self.cursor = DataCursor()
        self.parameters = sum(p.numel() for p in self.model.parameters())

    def step(self) -> float:
        started = time.perf_counter()
        indices, self.cursor = take_global_batch(
            self.cursor, len(self.hooks.dataset), self.config.global_batch, self.config.seed
        )
        batch = collate(self.hooks.dataset, indices.tolist(), torch.device("cpu"))
        accumulate_gradients(self.model, self.hooks.loss_fn, [batch], len(indices) * self.config.data.seq_len)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return time.perf_counter() - started


def measure(trainer: Trainer, url: str, options: StorageOptions, upload_in_process: bool, checkpoints: int,
            baseline_steps: int) -> dict:
    syncs = []
    for index in range(2):
        target = f"{url}/sync-{index}"
        started = time.perf_counter()
        dcp.save(training_state(trainer.model, trainer.optimizer),
                 storage_writer=FsspecWriter(target, **options.writer_options(target)))
        syncs.append(time.perf_counter() - started)

    idle = [trainer.step() for _ in range(baseline_steps)]
    checkpoint_io = RankCheckpointIO(options, global_rank=0, upload_in_process=upload_in_process)
    checkpoint_io.attach(dist.new_group(backend="gloo"))
    try:
        first_stall, _, _ = checkpoint(checkpoint_io, trainer, f"{url}/async-first")
        stalls, during, uploads = [], [], []
        for index in range(checkpoints):
            stall, upload_s, steps = checkpoint(checkpoint_io, trainer, f"{url}/async-{index}")
            stalls.append(stall)
            uploads.append(upload_s)
            during += steps
            idle.append(trainer.step())
    finally:
        checkpoint_io.close()
    return {
        "sync_s": statistics.median(syncs),
        "first_stall_s": first_stall,
        "stall_s": statistics.median(stalls),
        "upload_s": statistics.median(uploads),
        "idle_step_s": statistics.median(idle),
        "upload_step_s": statistics.median(during) if during else float("nan"),
        "steps_during_upload": len(during),
    }


def checkpoint(checkpoint_io: RankCheckpointIO, trainer: Trainer, url: str) -> tuple[float, float, list[float]]:
    """One async checkpoint, training while it uploads: (stall, upload seconds, step times)."""
    stall = checkpoint_io.save(trainer.model, trainer.optimizer, url)
    steps = []
    while checkpoint_io.uploading:
        steps.append(trainer.step())
    result = checkpoint_io.wait()
    if not result.ok:
        raise RuntimeError(result.error)
    return stall, result.upload_s, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--baseline-steps", type=int, default=4)
    args = parser.parse_args()

    # As on a rank actor: one compute thread per CPU slot; the upload runs beside it.
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    trainer = Trainer(args)
    trainer.step()  # AdamW state exists from here on
    state_bytes = sum(
        t.numel() * t.element_size() for t in _flatten(training_state(trainer.model, trainer.optimizer))
    )
    print(f"model: {trainer.parameters / 1e6:.1f} M parameters; training state {state_bytes / 2**20:.0f} MiB")

    set_test_credentials()
    s3 = MotoServer(bucket="bench-checkpoints").start()
    try:
        with tempfile.TemporaryDirectory() as local:
            targets = {
                "local disk": (local, StorageOptions()),
                "loopback S3": (s3.url("bench"), StorageOptions(endpoint_url=s3.endpoint_url)),
            }
            rows = {
                f"{name}, {mode}": measure(trainer, f"{url}/{mode}", options, mode == "process", args.checkpoints,
                                           args.baseline_steps)
                for name, (url, options) in targets.items() for mode in ("process", "thread")
            }
    finally:
        s3.stop()
        dist.destroy_process_group()

    print(f"{'target, upload':<22} {'sync save':>10} {'1st stall':>10} {'stall':>8} {'stall/sync':>11} {'upload':>8} "
          f"{'upload/sync':>12} {'step idle':>10} {'step upload':>12} {'n':>3} {'slowdown':>9}")
    verdicts = []
    for name, row in rows.items():
        stall_ratio = row["stall_s"] / row["sync_s"]
        upload_ratio = row["upload_s"] / row["sync_s"]
        slowdown = row["upload_step_s"] / row["idle_step_s"] - 1.0
        if name.endswith("process"):  # the upload the targets are for (the default on CUDA)
            verdicts += [stall_ratio <= 0.05, upload_ratio <= 1.5, slowdown <= 0.05]
        print(f"{name:<22} {row['sync_s']:>9.3f}s {row['first_stall_s']:>9.3f}s {row['stall_s']:>7.3f}s "
              f"{stall_ratio:>11.3f} {row['upload_s']:>7.3f}s {upload_ratio:>12.2f} {row['idle_step_s']:>9.3f}s "
              f"{row['upload_step_s']:>11.3f}s {row['steps_during_upload']:>3} {slowdown:>8.1%}")
    print("targets, process upload: stall/sync <= 0.05, upload/sync <= 1.5, slowdown <= 5%: "
          f"{'PASS' if all(verdicts) else 'FAIL'}")


def _flatten(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _flatten(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _flatten(value)
    elif isinstance(tree, torch.Tensor):
        yield tree.to_local() if hasattr(tree, "to_local") else tree


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()

"""A rank's peak memory while it starts from pretrained weights, for a checkpoint and one twice
as large: it grows with the rank's shards, not with the checkpoint.

Four processes form one group (``--shard`` x ``--tp``, gloo) and build the reference model
as a rank does (``workers.model_build.first_model``): from a HuggingFace Llama directory
(meta device, sharded, allocated, read slice by slice), and from the seed for comparison
(the whole model built, then sharded). Each process samples its private memory
(``RssAnon``) and the file pages it maps (``RssFile``) through the build; the table prints
the largest rank's peaks over their values before it, beside its shards' bytes and the
checkpoint's. Private memory is what a rank holds; the mapped pages are the page cache that
safetensors' mmap reads through, shared and reclaimable.

    python bench/pretrained_memory.py            # 2 layers then 4, dim 1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from checkpointing.huggingface import layout_of  # noqa: E402
from checkpointing.pretrained import PretrainedSource, load_pretrained  # noqa: E402
from checkpointing.storage import StorageOptions  # noqa: E402
from elastic.export import huggingface_model  # noqa: E402
from elastic.testing.gloo_ranks import gloo_ranks  # noqa: E402
from elastic.testing.memory import rss_bytes  # noqa: E402
from workers.model import ModelArgs, Transformer  # noqa: E402
from workers.model_build import first_model  # noqa: E402
from workers.parallelize import Parallelize  # noqa: E402


class PeakMemory:
    """The peak of the process's private memory (``RssAnon``) and of the file pages it maps
    (``RssFile``: safetensors reads through mmap; page cache, shared and reclaimable) over
    their values at the start, sampled every half millisecond on a thread."""

    def __init__(self):
        self.private = self.mapped = 0
        self._done = threading.Event()

    def _sample(self, private0: int, mapped0: int) -> None:
        while not self._done.is_set():
            self.private = max(self.private, rss_bytes("RssAnon") - private0)
            self.mapped = max(self.mapped, rss_bytes("RssFile") - mapped0)
            time.sleep(0.0005)

    def __enter__(self) -> PeakMemory:
        self._thread = threading.Thread(target=self._sample, args=(rss_bytes("RssAnon"), rss_bytes("RssFile")))
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def model_args(n_layers: int, dim: int) -> ModelArgs:
    return ModelArgs(vocab_size=8192, dim=dim, n_layers=n_layers, n_heads=16, n_kv_heads=8, ffn_hidden=dim * 11 // 4,
                     max_seq_len=256)


def write_checkpoint(directory: Path, args: ModelArgs) -> int:
    """A HuggingFace directory of ``args``'s model; returns its weights' bytes."""
    torch.manual_seed(0)
    weights, config = huggingface_model(Transformer(args).state_dict(), args)
    directory.mkdir(parents=True)
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))
    return sum(tensor.nbytes for tensor in weights.values())


def rank(index: int, world: tuple[int, int], directory: str | None, args: ModelArgs) -> tuple[int, int, int]:
    """One rank's peak private memory and mapped file pages over its build's start, and its
    shards' bytes."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", world, mesh_dim_names=("shard", "tp"))
    torch.manual_seed(0)

    def build(args: ModelArgs, directory: str | None):
        load = None
        if directory is not None:
            source = PretrainedSource(directory, layout_of(args))
            load = lambda model: load_pretrained(model, source, StorageOptions(), dist.group.WORLD)  # noqa: E731
        return first_model(lambda: Transformer(args), lambda model: (Parallelize()(model, mesh), []),
                           torch.device("cpu"), load)[0]

    # What any first build costs once (the code FSDP2, DTensor and DCP bring in) is not the model's.
    import torch.distributed.checkpoint as dcp  # noqa: F401
    build(model_args(1, 64), None)
    with PeakMemory() as peak:
        model = build(args, directory)
    held = sum(tensor.to_local().nbytes if hasattr(tensor, "to_local") else tensor.nbytes
               for tensor in model.parameters())
    dist.barrier()
    return peak.private, peak.mapped, held


def peak_growth(world: tuple[int, int], scratch: Path, directory: Path | None,
                args: ModelArgs) -> tuple[int, int, int]:
    """The largest rank's peak private memory and mapped file pages over its build's start, and
    its shards' bytes."""
    answers = gloo_ranks(rank, world[0] * world[1], str(scratch / f"init-{os.urandom(4).hex()}"), world,
                         str(directory) if directory else None, args, wait_s=600)
    return tuple(max(answer[index] for answer in answers) for index in range(3))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="the smaller checkpoint's layers; the larger has twice")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--shard", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    options = parser.parse_args(argv)
    world = (options.shard, options.tp)
    print(f"{world[0] * world[1]} ranks (shard {world[0]} x tp {world[1]}), fp32; the largest rank's peak over its "
          "build's start: private memory, and (from the checkpoint) the file pages safetensors maps")
    print(f"{'checkpoint':>12} {'its shards':>11} {'from it: private':>17} {'mapped':>8} {'from the seed':>14}")
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        for layers in (options.layers, 2 * options.layers):
            args = model_args(layers, options.dim)
            directory = scratch / f"llama-{layers}"
            size = write_checkpoint(directory, args)
            private, mapped, held = peak_growth(world, scratch, directory, args)
            seeded, _, _ = peak_growth(world, scratch, None, args)
            print(f"{size / 2**20:>8.0f} MiB {held / 2**20:>7.0f} MiB {private / 2**20:>13.0f} MiB "
                  f"{mapped / 2**20:>4.0f} MiB {seeded / 2**20:>10.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

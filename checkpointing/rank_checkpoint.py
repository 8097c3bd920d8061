"""One rank's side of a distributed checkpoint: DCP ``async_save`` and ``load`` through fsspec.

The state dict is DCP's (fully-qualified names, DTensor shards), so a checkpoint saved by a
group of one (shard, tp) layout loads into any other: DCP reshards on load.

Saving blocks only while the state is copied to CPU; the upload runs on DCP's thread. That
thread coordinates the group's ranks over a gloo process group of its own: sharing the
training collectives' group from a second thread would interleave two streams of collectives.
The CPU copy goes into buffers kept from one save to the next (one more copy of the rank's
state in host memory): allocating and faulting in fresh pages each time would double the
stall. Only one upload is in flight, so a save never overwrites buffers still being read.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from checkpointing.storage import StorageOptions, file_digest


@dataclass
class UploadResult:
    """What a rank reports once its part of a save finished (or failed)."""

    global_rank: int
    ok: bool
    upload_s: float = 0.0
    files: dict[str, tuple[int, str]] = field(default_factory=dict)
    error: str | None = None


def training_state(model: nn.Module, optimizer) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


class RankCheckpointer:
    def __init__(self, options: StorageOptions, global_rank: int):
        self.options = options
        self.global_rank = global_rank
        self.process_group = None
        self.upload: Future | None = None
        self.upload_url = ""
        self.upload_started = 0.0
        on_gpu = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=on_gpu, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False,
        ))

    def attach(self, process_group) -> None:
        """Use this world's checkpoint process group (made by every rank of the world)."""
        self.process_group = process_group

    def save(self, model: nn.Module, optimizer, url: str) -> float:
        """Stage the committed state to CPU and start its upload; returns the stall in seconds."""
        started = time.perf_counter()
        writer = FsspecWriter(url, **self.options.for_url(url))
        self.upload = dcp.async_save(
            training_state(model, optimizer), storage_writer=writer, process_group=self.process_group,
            async_stager=self.stager,
        )
        self.upload_url = url
        self.upload_started = time.perf_counter()
        return self.upload_started - started

    def wait(self) -> UploadResult:
        """Block until this rank's upload is done; then size and checksum the files it wrote."""
        if self.upload is None:
            return UploadResult(self.global_rank, ok=False, error="no upload in flight")
        try:
            self.upload.result()
            upload_s = time.perf_counter() - self.upload_started
            files = self._written_files()
        except Exception as error:  # the driver decides; a failed upload is just not committed
            return UploadResult(self.global_rank, ok=False, error=f"{type(error).__name__}: {error}"[:1000])
        finally:
            self.upload = None
        return UploadResult(self.global_rank, ok=True, upload_s=upload_s, files=files)

    def _written_files(self) -> dict[str, tuple[int, str]]:
        """The files this rank wrote: DCP names them ``__<rank>_<n>``; rank 0 adds ``.metadata``."""
        fs, path = self.options.filesystem(self.upload_url)
        rank = dist.get_rank(self.process_group)
        mine = f"__{rank}_"
        digests = {}
        for entry in fs.ls(path, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.startswith(mine) or (rank == 0 and name == ".metadata"):
                digests[name] = file_digest(fs, f"{path}/{name}")
        return digests

    def settle(self, timeout_s: float) -> None:
        """Let an upload in flight end before the world it uses is torn down."""
        if self.upload is not None:
            try:
                self.upload.result(timeout=timeout_s)
            except Exception:  # abandoned: the driver never commits it
                pass
            self.upload = None

    def load(self, model: nn.Module, optimizer, url: str) -> float:
        started = time.perf_counter()
        state = training_state(model, optimizer)
        dcp.load(state, storage_reader=FsspecReader(url, **self.options.for_url(url)), process_group=self.process_group)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return time.perf_counter() - started

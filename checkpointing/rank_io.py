"""One rank's side of a distributed checkpoint: DCP ``save`` and ``load`` through fsspec.

The state dict is DCP's (fully-qualified names, DTensor shards), so a checkpoint saved by a
group of one (pp, shard, tp) layout loads into any other: DCP reshards on load.

A save blocks only while the state is copied into the rank's staging arena (host memory
kept from one save to the next, pinned on CUDA). The upload then runs beside training, as
DCP's ``save`` on a thread with two of its extension points filled in:

- a planner that plans from the live state (only shapes and placements are read, so
  training may change the values meanwhile) and takes the data from the staged copy;
- a storage writer that hashes each file's bytes on their way out, so the manifest's
  digests cost no second read of what was just written (on S3, no second download).

With ``upload_in_process`` the data files are serialised, hashed and written by the rank's
upload process, from the arena it shares, so the upload does not compete with training for
the GIL; the thread keeps only the plan, DCP's collectives and rank 0's ``.metadata``.
DCP's collectives run over a gloo process group of their own: sharing the training
collectives' group from a second thread would interleave two streams of collectives. Only
one upload is in flight, so a save never refills slots still being written out.
"""

from __future__ import annotations

import copy
import io
import pickle
import re
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

from checkpointing.digests import DigestingFileSystem
from checkpointing.manifest import CorruptCheckpoint, UnloadableCheckpoint
from checkpointing.safe_loading import UnsafeCheckpoint, load_metadata
from checkpointing.staging_arena import StagingArena
from checkpointing.storage import StorageOptions
from checkpointing.upload_process import UploadProcess, WriteRequest


@dataclass
class UploadResult:
    """What a rank reports once its part of a save finished (or failed)."""

    global_rank: int
    ok: bool
    upload_s: float = 0.0
    files: dict[str, tuple[int, str]] = field(default_factory=dict)
    error: str | None = None
    rng: dict[str, bytes] | None = None  # the rank's generator states at the save (see workers.rng)


class SafeReader(FsspecReader):
    """DCP's fsspec reader with ``.metadata`` read by ``safe_loading.load_metadata``: no
    class but DCP's metadata classes is unpickled. Each metadata file is read once: a load
    reads it, and so does the look at its optimizer's form before (``saved_flat``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._metadata: dict[str, Metadata] = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs["rank"]) if "rank" in kwargs else self._get_metadata_path()
        if path not in self._metadata:
            with self.fs.create_stream(path, "rb") as stream:
                metadata = load_metadata(stream)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            self._metadata[path] = metadata
        metadata = self._metadata[path]
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner with its non-tensor items (the optimizer's hyperparameters)
    loaded as weights only: plain values and containers, nothing that runs code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpoint(f"the checkpoint item {read_item.dest_index.fqn} is not plain data: refused "
                                   f"({error})") from error
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def training_state(model: nn.Module, optimizer, flat_optimizer: bool = True) -> dict:
    """The rank's model and optimizer state by fully qualified name. The optimizer's
    hyperparameters are kept per parameter (``flat_optimizer``, as TorchTitan keeps them): as
    one list of groups, DCP would keep a single rank's copy, and the ranks of different
    pipeline stages hold groups of different parameters."""
    model_state, optimizer_state = get_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat_optimizer))
    return {"model": model_state, "optimizer": optimizer_state}


def load_weights(model: nn.Module, url: str, options: StorageOptions, process_group) -> None:
    """Only the model's weights of the checkpoint at ``url`` (another run's, to start from)."""
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, storage_reader=SafeReader(url, **options.for_url(url)), planner=SafeLoadPlanner(),
             process_group=process_group)
    set_model_state_dict(model, state["model"])


def saved_flat(metadata: Metadata) -> bool:
    """Whether a checkpoint keeps the optimizer's hyperparameters per parameter: those saved
    before pipeline stages kept one list of groups, which still loads where it is the same
    for every rank."""
    return not any(GROUPED_OPTIMIZER.fullmatch(key) for key in metadata.state_dict_metadata)


# DCP flattens a list of groups into keys by group index; per parameter, groups have no "params".
GROUPED_OPTIMIZER = re.compile(r"optimizer\.param_groups\.\d+\.params")


class RankCheckpointIO:
    def __init__(self, options: StorageOptions, global_rank: int, upload_in_process: bool = False):
        self.options = options
        self.global_rank = global_rank
        self.upload_in_process = upload_in_process
        self.process_group = None
        self.arena: StagingArena | None = None
        self.uploader: UploadProcess | None = None
        self.upload: Future | None = None
        self.rng: dict[str, bytes] | None = None

    def attach(self, process_group) -> None:
        """Use this world's checkpoint process group (made by every rank of the world)."""
        self.process_group = process_group
        if self.upload_in_process:
            # Started now, its start-up (importing torch) overlaps the build, not an upload.
            self._uploader()

    @property
    def uploading(self) -> bool:
        return self.upload is not None and not self.upload.done()

    def save(self, model: nn.Module, optimizer, url: str, rng: dict[str, bytes] | None = None) -> float:
        """Stage the committed state to host memory and start its upload; returns the stall
        in seconds. Raises if staging fails: the next save stages into fresh buffers. ``rng``
        travels back to the driver with the upload's result, for the manifest."""
        started = time.perf_counter()
        if self.uploading:  # only an abandoned upload that is stuck on this rank's thread
            raise RuntimeError(
                "the upload of an earlier save is still stuck in storage; this rank saves again once it ends")
        state = training_state(model, optimizer)
        leaves = _flat_state(state)
        with torch.no_grad():  # a parameter's local shard, not an autograd view of it
            tensors = {fqn: _local(leaf) for fqn, leaf in leaves.items() if isinstance(leaf, torch.Tensor)}
        try:
            if self.arena is None or not self.arena.fits(tensors):
                self._drop_arena()
                self.arena = StagingArena(tensors)
            staged = self.arena.stage(tensors)
        except BaseException:
            self._drop_arena()
            raise
        snapshot = {fqn: staged[fqn] if fqn in staged else copy.deepcopy(leaf) for fqn, leaf in leaves.items()}
        if self.upload_in_process:
            writer = _ProcessWriter(url, self.options, self._uploader(), self.arena)
        else:
            writer = _DigestingWriter(url, self.options)
        self.upload = _in_thread(_upload, state, _StagedPlanner(snapshot), writer, self.process_group)
        self.rng = rng
        return time.perf_counter() - started

    def wait(self) -> UploadResult:
        """Block until this rank's upload is done; report the files it wrote, with digests."""
        upload = self.upload
        if upload is None:
            return UploadResult(self.global_rank, ok=False, error="no upload in flight")
        try:
            files, upload_s = upload.result()
        except (Exception, CheckpointException) as error:  # the driver decides: a failed upload is not committed
            return UploadResult(self.global_rank, ok=False, error=_describe(error)[:1000])
        finally:
            # An abandoned upload may end long after its save, when the next one is in flight.
            if self.upload is upload:
                self.upload = None
        return UploadResult(self.global_rank, ok=True, upload_s=upload_s, files=files, rng=self.rng)

    def settle(self, timeout_s: float) -> None:
        """Let an upload in flight end before the world it uses is torn down. One still
        running after ``timeout_s`` is abandoned (its collectives fail with that world), with
        its upload process; the next save stages into a fresh arena, not one it may read."""
        if self.upload is None:
            return
        try:
            self.upload.result(timeout=timeout_s)
        except TimeoutError:
            self.abandon()
        except (Exception, CheckpointException):  # failed: the driver never commits it
            pass
        self.upload = None

    def abandon(self) -> None:
        """Give up on the upload in flight (the driver's deadline for it passed). Its upload
        process is killed, which fails a write stuck in storage and so ends the upload; the
        next save starts another process and stages into a fresh arena, not one the stuck
        upload may still read. A write stuck on this process's own thread cannot be stopped:
        the upload stays in flight, and this rank refuses to save until it ends."""
        if not self.uploading:
            return
        self._stop_uploader(timeout_s=0.0)
        self.arena = None

    def close(self) -> None:
        """Stop the upload process (abandoning an upload in flight) and free the staging memory."""
        self._stop_uploader()
        self.upload = None
        self._drop_arena()

    def load(self, model: nn.Module, optimizer, url: str) -> float:
        started = time.perf_counter()
        reader = SafeReader(url, **self.options.for_url(url))
        try:
            flat = saved_flat(reader.read_metadata())
            state = training_state(model, optimizer, flat)
            # DCP gathers a read's failure on any rank into every rank's CheckpointException;
            # a peer lost mid-load raises a collective's error instead, and is no fault of the files.
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self.process_group)
        except (CheckpointException, CorruptCheckpoint) as error:
            raise UnloadableCheckpoint(f"{url} does not load: {' '.join(str(error).split())[:400]}") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                       options=StateDictOptions(flatten_optimizer_state_dict=flat))
        return time.perf_counter() - started

    def _uploader(self) -> UploadProcess:
        if self.uploader is None or not self.uploader.alive:
            self._stop_uploader()
            self.uploader = UploadProcess()
        return self.uploader

    def _stop_uploader(self, timeout_s: float = 10.0) -> None:
        if self.uploader is not None:
            self.uploader.close(timeout_s)
            self.uploader = None

    def _drop_arena(self) -> None:
        if self.arena is not None:
            self.arena.release()
            self.arena = None
            if self.uploader is not None:
                self.uploader.unmap()


def _describe(error: BaseException) -> str:
    if isinstance(error, CheckpointException):
        # DCP gathers every rank's failure with its traceback; the causes would be cut off.
        return "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in error.failures.items())
    return f"{type(error).__name__}: {error}"


def _flat_state(state: dict) -> dict:
    """The state as DCP flattens it, ``{fqn: leaf}``, so staged leaves line up with its plan."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict=state, is_coordinator=False)
    return planner.state_dict


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's part of a tensor: a DTensor's local shard (DCP writes exactly that)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _StagedPlanner(DefaultSavePlanner):
    """DCP's default plan, over the live state; the data comes from ``snapshot``, the copy
    taken at save time (``{fqn: staged tensor or copied non-tensor leaf}``)."""

    def __init__(self, snapshot: dict):
        super().__init__()
        self.snapshot = snapshot

    def lookup_object(self, index):
        return self.snapshot[index.fqn]


class _DigestingWriter(FsspecWriter):
    """DCP's fsspec writer, recording each written file's size and sha256."""

    def __init__(self, url: str, options: StorageOptions):
        # The data is in host memory already: no device copy-ahead.
        super().__init__(url, per_thread_copy_ahead=0, **options.writer_options(url))
        self.fs = DigestingFileSystem(self.fs)

    @property
    def files(self) -> dict[str, tuple[int, str]]:
        return dict(self.fs.files)


class _ProcessWriter(_DigestingWriter):
    """The data files are written by the rank's upload process; ``.metadata`` (rank 0)
    here, through the digesting file system."""

    def __init__(self, url: str, options: StorageOptions, uploader: UploadProcess, arena: StagingArena):
        super().__init__(url, options)
        self.url = url
        self.storage_options = options
        self.uploader = uploader
        self.arena = arena
        self.data_files: dict[str, tuple[int, str]] = {}

    @property
    def files(self) -> dict[str, tuple[int, str]]:
        return {**self.data_files, **self.fs.files}

    def write_data(self, plan, planner) -> TorchFuture:
        items = {item.index: self._payload(planner.resolve_data(item)) for item in plan.items}
        reply = self.uploader.write(self.arena, WriteRequest(self.url, self.storage_options, plan, items))
        self.data_files = reply.files
        written: TorchFuture = TorchFuture()
        written.set_result(reply.results)
        return written

    def _payload(self, data):
        return data.getvalue() if isinstance(data, io.BytesIO) else self.arena.ref(data)


def _upload(state: dict, planner: _StagedPlanner, writer: _DigestingWriter, process_group) -> tuple[dict, float]:
    started = time.perf_counter()
    dcp.save(state, storage_writer=writer, planner=planner, process_group=process_group)
    return writer.files, time.perf_counter() - started


def _in_thread(function, *args) -> Future:
    # A thread per upload rather than a pool: an abandoned upload stuck in a collective of a
    # dead world would hold a pool's worker, and the next upload would queue behind it.
    future: Future = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(function(*args))
        except BaseException as error:
            future.set_exception(error)

    threading.Thread(target=run, name="rank-checkpoint-upload", daemon=True).start()
    return future

"""A rank's upload process: writes the rank's checkpoint data files from the staging arena.

Serialising, hashing and uploading gigabytes in the training process would compete with
training for the GIL; in a process of its own the upload costs training only a CPU core.
The process is not forked from the training process, which runs threads (NCCL, gloo, Ray)
that a fork would copy in unknown states: it is forked from a fork server, a process that runs
no threads and imported this module (and torch) once, as the first upload process started. A
replacement for a lost one then starts in milliseconds, not the seconds a fresh interpreter
takes to import torch, and one that ends skips a fresh interpreter's shutdown. The server
lives as long as the training process. It joins no process group: the training process
plans each save and runs DCP's collectives, so the upload process outlives world rebuilds
and needs no rendezvous of its own. It maps the staging arena (a memfd passed over its
pipe), so the staged state is not copied again to hand it over.
"""

from __future__ import annotations

import io
import mmap
import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass
from multiprocessing.reduction import recv_handle, send_handle

from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from checkpointing.digests import DigestingFileSystem
from checkpointing.staging_arena import StagingArena
from checkpointing.storage import StorageOptions

KILLED_EXIT_WAIT_S = 5.0


@dataclass
class MapArena:
    """Map this arena from now on (none: nbytes 0); its memfd follows over the pipe."""

    nbytes: int


@dataclass
class WriteRequest:
    """Write this rank's data files of a save: DCP's final local plan, and each item's data
    as serialised bytes or as the place of its tensor in the arena (a ``TensorRef``)."""

    url: str
    options: StorageOptions
    plan: SavePlan
    items: dict


@dataclass
class WriteReply:
    results: list[WriteResult]
    files: dict[str, tuple[int, str]]


class UploadProcess:
    """The training process's handle on its upload process."""

    def __init__(self):
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([__name__])  # applies when the first process starts the server
        self.connection, child_end = context.Pipe()
        # Never written: the process reads its end to learn that this one is gone.
        lifeline, self.lifeline = context.Pipe(duplex=False)
        # The environment of the moment, as a spawned process would get it: the server's is the
        # one it started with.
        self.process = context.Process(target=serve, args=(child_end, lifeline, dict(os.environ)),
                                       name="rank-checkpoint-upload", daemon=True)
        self.process.start()
        child_end.close()
        lifeline.close()
        self.mapped_arena: int | None = None
        # One exchange at a time; close() also tells a busy process from an idle one by it.
        self.lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    def write(self, arena: StagingArena, request: WriteRequest) -> WriteReply:
        with self.lock:
            try:
                if self.mapped_arena != arena.id:
                    self.connection.send(MapArena(arena.nbytes))
                    send_handle(self.connection, arena.fd, self.process.pid)
                    self.mapped_arena = arena.id
                self.connection.send(request)
                reply = self.connection.recv()
            except BaseException as error:
                # The pipe is in an unknown state: this process is not used again.
                self.process.kill()
                raise RuntimeError(f"upload process lost: {type(error).__name__}: {error}") from error
        if isinstance(reply, str):
            raise RuntimeError(reply)
        return reply

    def unmap(self) -> None:
        """Drop the process's mapping of the arena, so that its memory goes with the training
        process's: a new arena must not sit beside the old one until the next write."""
        with self.lock:
            if self.mapped_arena is None:
                return
            self.mapped_arena = None
            try:
                self.connection.send(MapArena(0))
            except OSError:
                self.process.kill()  # gone or broken: the next save starts another

    def close(self, timeout_s: float = 10.0) -> None:
        """End the process: asked to when idle, killed when busy (its write is abandoned)."""
        if self.lock.acquire(blocking=False):
            try:
                self.connection.send(None)
                self.process.join(timeout_s)
            except OSError:
                pass
            finally:
                self.lock.release()
        if self.process.is_alive():
            self.process.kill()
        # A process killed inside a write to a hung mount dies only once that write returns:
        # waiting for it longer would hang the caller too. The next process started reaps it.
        self.process.join(KILLED_EXIT_WAIT_S)
        self.lifeline.close()


def serve(connection, lifeline, environment: dict[str, str]) -> None:
    """The upload process: serves write requests until told to stop or the training process
    is gone."""
    os.environ.clear()
    os.environ.update(environment)
    # Nothing here touches a GPU; a CUDA context would cost device memory.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # An interrupt is the training process's to handle; it stops this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_training_process, args=(lifeline,), daemon=True).start()
    memory = None
    while True:
        try:
            message = connection.recv()
        except EOFError:
            return
        if message is None:
            return
        if isinstance(message, MapArena):
            memory = None
            if message.nbytes:
                fd = recv_handle(connection)
                memory = mmap.mmap(fd, message.nbytes)
                os.close(fd)
        else:
            connection.send(_write(memory, message))


def _write(memory: mmap.mmap, request: WriteRequest) -> WriteReply | str:
    try:
        # The data is in host memory already: no device copy-ahead.
        writer = FsspecWriter(request.url, per_thread_copy_ahead=0, **request.options.writer_options(request.url))
        writer.fs = DigestingFileSystem(writer.fs)
        results = writer.write_data(request.plan, _ArenaItems(memory, request.items)).wait()
        return WriteReply(results, writer.fs.files)
    except Exception as error:  # reported to the rank, which reports a failed upload
        return f"{type(error).__name__}: {error}"[:2000]


class _ArenaItems:
    """The one planner call DCP's writer makes (``resolve_data``), answered from the arena."""

    def __init__(self, memory: mmap.mmap, items: dict):
        self.memory = memory
        self.items = items

    def resolve_data(self, item):
        data = self.items[item.index]
        return io.BytesIO(data) if isinstance(data, bytes) else data.view(self.memory)


def _exit_with_training_process(lifeline) -> None:
    # A training process killed outright (SIGKILL, os._exit) cannot stop this process, which
    # would go on uploading a checkpoint that nobody will commit. Its parent is the fork server,
    # which outlives the training process while this process runs: the lifeline's other end,
    # held by the training process alone, is what closes.
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)

"""A rank's async checkpoints in a real single-rank gloo world, with the tiny FSDP2 model:
staging into a reused arena, the upload (on a thread, or in the rank's upload process),
digests, and loading back."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from checkpointing import rank_io, staging_arena
from checkpointing.rank_io import RankCheckpointIO, training_state
from checkpointing.storage import StorageOptions
from elastic.setup.preflight import build_config
from elastic.core.data_plan import DataCursor, take_global_batch
from elastic.setup.hooks import resolve_hooks
from elastic.testing.gloo_ranks import rank_processes
from elastic.testing.loopback import wait_for
from tests.processes import alive
from elastic.testing.s3 import TEST_CREDENTIALS
from workers.train_step import accumulate_gradients, collate

ROOT = Path(__file__).resolve().parents[1]
CONFIG = build_config({
    "global_batch": 2, "micro_batch": 2, "seed": 0,
    "scaling": {"shard": 1, "tp": 1},
    "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64},
    "data": {"seq_len": 16, "corpus_tokens": 20_000},
})


class Rank:
    """The rank's model and optimizer, trained a step at a time."""

    def __init__(self, seed: int, shard: int = 1):
        self.hooks = resolve_hooks(CONFIG)
        mesh = init_device_mesh("cpu", (shard, 1), mesh_dim_names=("shard", "tp"))
        torch.manual_seed(seed)
        self.model = self.hooks.parallelize_fn(self.hooks.model_fn(), mesh)
        self.optimizer = self.hooks.optimizer_fn(self.model.parameters())
        self.cursor = DataCursor()

    def step(self) -> None:
        indices, self.cursor = take_global_batch(self.cursor, len(self.hooks.dataset), CONFIG.global_batch, CONFIG.seed)
        batch = collate(self.hooks.dataset, indices.tolist(), torch.device("cpu"))
        accumulate_gradients(self.model, self.hooks.loss_fn, [batch], len(indices) * CONFIG.data.seq_len)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def snapshot(self) -> dict:
        return _detached(training_state(self.model, self.optimizer))


def _detached(tree, full: bool = False):
    """A copy of a state tree; DTensors become their local shard, or the full tensor."""
    if isinstance(tree, dict):
        return {key: _detached(value, full) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_detached(value, full) for value in tree]
    if isinstance(tree, DTensor):
        return (tree.full_tensor() if full else tree.to_local()).detach().clone()
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    return tree


def assert_same(actual, expected, path="state"):
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), path
    else:
        assert actual == expected, path


def loaded(checkpoint_io: RankCheckpointIO, url: str) -> dict:
    fresh = Rank(seed=1)
    fresh.step()  # optimizer state that the load must overwrite
    checkpoint_io.load(fresh.model, fresh.optimizer, url)
    return fresh.snapshot()


def staging_mappings(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum("rank-checkpoint-staging" in line for line in maps)


def stored_digests(fs, directory: str) -> dict:
    digests = {}
    for path in fs.ls(directory, detail=False):
        data = fs.cat_file(path)
        digests[path.rstrip("/").rsplit("/", 1)[-1]] = (len(data), hashlib.sha256(data).hexdigest())
    return digests


@pytest.fixture
def world():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def rank(world):
    rank = Rank(seed=0)
    rank.step()
    return rank


@pytest.fixture(params=["thread", "process"])
def checkpoint_io(world, request):
    checkpoint_io = RankCheckpointIO(StorageOptions(), global_rank=0, upload_in_process=request.param == "process")
    checkpoint_io.attach(dist.new_group(backend="gloo"))
    yield checkpoint_io
    checkpoint_io.close()
    assert multiprocessing.active_children() == []


@pytest.fixture
def in_process(world):
    checkpoint_io = RankCheckpointIO(StorageOptions(), global_rank=0, upload_in_process=True)
    checkpoint_io.attach(dist.new_group(backend="gloo"))
    yield checkpoint_io
    checkpoint_io.close()
    assert multiprocessing.active_children() == []


def test_consecutive_saves_load_back_the_state_at_save_time(rank, checkpoint_io, tmp_path):
    expected = {}
    for index in range(3):
        url = str(tmp_path / f"step-{index}")
        expected[url] = rank.snapshot()
        checkpoint_io.save(rank.model, rank.optimizer, url)
        rank.step()  # training goes on during the upload; the checkpoint keeps the staged state
        result = checkpoint_io.wait()
        assert result.ok, result.error
        assert result.upload_s > 0
    for url, state in expected.items():
        assert_same(loaded(checkpoint_io, url), state)


def test_a_checkpoint_with_the_optimizers_groups_in_one_list_still_loads(rank, world, tmp_path):
    """Checkpoints saved before pipeline stages kept the optimizer's hyperparameters as one
    list of groups, not per parameter; they load as they were saved."""
    url = str(tmp_path / "step-1")
    expected = rank.snapshot()
    state = training_state(rank.model, rank.optimizer, flat_optimizer=False)
    dcp.save(state, checkpoint_id=url)
    assert "param_groups" in state["optimizer"]
    checkpoint_io = RankCheckpointIO(StorageOptions(), global_rank=0)
    checkpoint_io.attach(dist.new_group(backend="gloo"))
    assert_same(loaded(checkpoint_io, url), expected)
    checkpoint_io.close()


def test_reported_files_match_what_storage_holds(rank, checkpoint_io, tmp_path):
    url = str(tmp_path / "ckpt")
    checkpoint_io.save(rank.model, rank.optimizer, url)
    result = checkpoint_io.wait()
    assert result.ok, result.error
    fs, directory = StorageOptions().filesystem(url)
    assert result.files == stored_digests(fs, directory)
    assert set(result.files) == {".metadata", "__0_0.distcp"}


def test_buffers_are_reused_across_saves(rank, checkpoint_io, tmp_path):
    pointers = []
    for index in range(2):
        checkpoint_io.save(rank.model, rank.optimizer, str(tmp_path / f"step-{index}"))
        assert checkpoint_io.wait().ok
        pointers.append({name: buffer.data_ptr() for name, buffer in checkpoint_io.arena.buffers.items()})
        rank.step()
    assert pointers[0] == pointers[1] and len(pointers[0]) > 10


def test_a_failed_staging_does_not_break_the_next_save(rank, checkpoint_io, tmp_path, monkeypatch):
    checkpoint_io.save(rank.model, rank.optimizer, str(tmp_path / "first"))
    assert checkpoint_io.wait().ok
    first_arena = checkpoint_io.arena

    def broken(self, tensors):
        raise RuntimeError("injected staging failure")

    with monkeypatch.context() as patch:
        patch.setattr(staging_arena.StagingArena, "stage", broken)
        with pytest.raises(RuntimeError, match="injected"):
            checkpoint_io.save(rank.model, rank.optimizer, str(tmp_path / "broken"))
    assert checkpoint_io.arena is None  # dropped: the next save stages into a fresh arena
    assert not checkpoint_io.wait().ok
    if checkpoint_io.uploader is not None:
        wait_for(lambda: staging_mappings(checkpoint_io.uploader.process.pid) == 0, 10,  # freed there too
                 "the upload process to free its staging", interval=0.05)

    rank.step()
    expected = rank.snapshot()
    url = str(tmp_path / "after")
    checkpoint_io.save(rank.model, rank.optimizer, url)
    assert checkpoint_io.wait().ok
    assert checkpoint_io.arena is not first_arena
    assert_same(loaded(checkpoint_io, url), expected)


def test_settle_abandons_an_upload_that_does_not_end(rank, checkpoint_io, tmp_path, monkeypatch):
    release = threading.Event()

    def stuck(*args):
        release.wait()
        raise RuntimeError("abandoned")

    monkeypatch.setattr(rank_io, "_upload", stuck)
    checkpoint_io.save(rank.model, rank.optimizer, str(tmp_path / "stuck"))
    abandoned = checkpoint_io.arena
    checkpoint_io.settle(timeout_s=0.5)
    assert checkpoint_io.upload is None and not checkpoint_io.uploading
    # The stuck upload may still read that arena: the next save must not refill it.
    assert checkpoint_io.arena is None and abandoned is not None
    release.set()


def test_the_upload_process_shares_the_arena_instead_of_a_copy(rank, in_process, tmp_path):
    in_process.save(rank.model, rank.optimizer, str(tmp_path / "ckpt"))
    assert in_process.wait().ok
    assert staging_mappings(in_process.uploader.process.pid) == 1


def assert_the_next_save_restarts_the_process(rank, in_process, lost_process, tmp_path) -> None:
    expected = rank.snapshot()
    url = str(tmp_path / "next")
    in_process.save(rank.model, rank.optimizer, url)
    assert in_process.wait().ok
    assert in_process.uploader.process is not lost_process
    assert_same(loaded(in_process, url), expected)


def test_a_lost_upload_process_fails_its_upload_and_the_next_save_restarts_it(rank, in_process, tmp_path):
    process = in_process.uploader.process
    os.kill(process.pid, signal.SIGSTOP)  # frozen, then killed mid-upload
    in_process.save(rank.model, rank.optimizer, str(tmp_path / "lost"))
    os.kill(process.pid, signal.SIGKILL)
    result = in_process.wait()
    assert not result.ok and "upload process lost" in result.error

    assert_the_next_save_restarts_the_process(rank, in_process, process, tmp_path)


def test_settle_stops_an_upload_process_that_does_not_answer(rank, in_process, tmp_path):
    process = in_process.uploader.process
    os.kill(process.pid, signal.SIGSTOP)
    in_process.save(rank.model, rank.optimizer, str(tmp_path / "stuck"))
    in_process.settle(timeout_s=0.5)
    assert not process.is_alive() and in_process.uploader is None and in_process.upload is None


TRAINING_PROCESS = """
import sys, time
import torch.distributed as dist
from checkpointing.rank_io import RankCheckpointIO
from checkpointing.storage import StorageOptions
from tests.test_rank_io import Rank, stalled_directory
from pathlib import Path
if __name__ == "__main__":
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank = Rank(seed=0)
    rank.step()
    checkpoint_io = RankCheckpointIO(StorageOptions(), global_rank=0, upload_in_process=True)
    checkpoint_io.attach(dist.new_group(backend="gloo"))
    checkpoint_io.save(rank.model, rank.optimizer, stalled_directory(Path(sys.argv[1])))
    print(checkpoint_io.uploader.process.pid, flush=True)
    time.sleep(300)
"""


@pytest.mark.waits  # an upload held in a FIFO
def test_an_upload_process_ends_when_its_training_process_is_killed_outright(tmp_path):
    """An upload stuck in storage, then its training process killed outright: the upload
    process ends too, instead of writing on a checkpoint nobody will commit. Its parent is
    the fork server, which outlives the training process while the upload runs."""
    script = tmp_path / "training.py"
    script.write_text(TRAINING_PROCESS)
    training = subprocess.Popen([sys.executable, str(script), str(tmp_path / "stalled")], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    upload_pid = None
    try:
        upload_pid = int(training.stdout.readline())
        # Linux's wait of a FIFO's open for its other end: the upload is stuck in storage.
        wait_for(lambda: Path(f"/proc/{upload_pid}/wchan").read_text() == "wait_for_partner", 60,
                 "the upload to block opening the FIFO", interval=0.05)
        training.kill()
        training.wait()
        wait_for(lambda: not alive(upload_pid), 30, "the upload process to end", interval=0.05)
    finally:
        training.kill()
        if upload_pid is not None and alive(upload_pid):  # its fork server then ends too
            os.kill(upload_pid, signal.SIGKILL)


def stalled_directory(path) -> str:
    """A save directory on a stalled mount: opening its data file for writing never returns
    (a FIFO no one reads)."""
    path.mkdir()
    os.mkfifo(path / "__0_0.distcp")
    return str(path)


def test_abandon_kills_an_upload_stuck_in_storage_and_the_next_save_goes_ahead(rank, in_process, tmp_path):
    in_process.save(rank.model, rank.optimizer, stalled_directory(tmp_path / "stalled"))
    process = in_process.uploader.process
    with pytest.raises(TimeoutError):
        in_process.upload.result(timeout=1.0)  # stuck, as it would be for good
    in_process.abandon()
    assert in_process.upload.exception(timeout=30) is not None  # the kill ended it
    result = in_process.wait()
    assert not result.ok and "upload process lost" in result.error
    assert not process.is_alive() and in_process.arena is None

    assert_the_next_save_restarts_the_process(rank, in_process, process, tmp_path)


def test_an_abandoned_upload_stuck_on_the_ranks_thread_refuses_saves_until_it_ends(rank, world, tmp_path):
    checkpoint_io = RankCheckpointIO(StorageOptions(), global_rank=0, upload_in_process=False)
    checkpoint_io.attach(dist.new_group(backend="gloo"))
    stalled = stalled_directory(tmp_path / "stalled")
    checkpoint_io.save(rank.model, rank.optimizer, stalled)
    checkpoint_io.abandon()  # no process to kill: the thread stays stuck
    with pytest.raises(RuntimeError, match="still stuck in storage"):
        checkpoint_io.save(rank.model, rank.optimizer, str(tmp_path / "refused"))

    with open(os.path.join(stalled, "__0_0.distcp"), "rb") as reader:  # the mount comes back
        reader.read()
    checkpoint_io.upload.exception(timeout=30)
    checkpoint_io.save(rank.model, rank.optimizer, str(tmp_path / "next"))
    assert checkpoint_io.wait().ok
    checkpoint_io.close()


@pytest.mark.parametrize("upload_in_process", [False, True])
def test_saves_to_s3(rank, world, s3_server, tmp_path, monkeypatch, upload_in_process):
    for key, value in TEST_CREDENTIALS.items():
        monkeypatch.setenv(key, value)  # before the upload process starts: it inherits them
    options = StorageOptions(endpoint_url=s3_server.endpoint_url)
    checkpoint_io = RankCheckpointIO(options, global_rank=0, upload_in_process=upload_in_process)
    checkpoint_io.attach(dist.new_group(backend="gloo"))
    try:
        expected = rank.snapshot()
        url = s3_server.url("run", "step-1")
        checkpoint_io.save(rank.model, rank.optimizer, url)
        result = checkpoint_io.wait()
        assert result.ok, result.error
        fs, directory = options.filesystem(url)
        assert result.files == stored_digests(fs, directory)
        assert_same(loaded(checkpoint_io, url), expected)
    finally:
        checkpoint_io.close()
    assert multiprocessing.active_children() == []


def save_as_rank(rank: int, store: str, url: str, out: str) -> None:
    """One rank of a two-rank (shard 2) world: train a step, save, report what it wrote."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        trainer = Rank(seed=0, shard=2)
        trainer.step()
        checkpoint_io = RankCheckpointIO(StorageOptions(), global_rank=rank, upload_in_process=True)
        checkpoint_io.attach(dist.new_group(backend="gloo"))
        try:
            checkpoint_io.save(trainer.model, trainer.optimizer, url)
            result = checkpoint_io.wait()
        finally:
            checkpoint_io.close()
        full = _detached(training_state(trainer.model, trainer.optimizer), full=True)
        torch.save({"result": result, "full": full}, f"{out}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_two_rank_save_loads_into_one_rank(world, tmp_path):
    url = str(tmp_path / "ckpt")
    context = rank_processes()
    ranks = [
        context.Process(target=save_as_rank, args=(rank, str(tmp_path / "store"), url, str(tmp_path)))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        assert process.exitcode == 0
    reports = [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=False) for rank in range(2)]
    results = [report["result"] for report in reports]
    assert all(result.ok for result in results), [result.error for result in results]
    assert set(results[0].files) == {".metadata", "__0_0.distcp"}
    assert set(results[1].files) == {"__1_0.distcp"}
    fs, directory = StorageOptions().filesystem(url)
    assert {**results[0].files, **results[1].files} == stored_digests(fs, directory)

    checkpoint_io = RankCheckpointIO(StorageOptions(), global_rank=0)
    assert_same(loaded(checkpoint_io, url), reports[0]["full"])

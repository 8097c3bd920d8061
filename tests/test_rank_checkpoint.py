"""A rank's async checkpoints in a real single-rank gloo world, with the tiny FSDP2 model:
staging into reused buffers, the upload thread, digests, and loading back."""

from __future__ import annotations

import hashlib
import multiprocessing
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from checkpointing import rank_checkpoint, staging_buffers
from checkpointing.rank_checkpoint import RankCheckpointer, training_state
from checkpointing.storage import StorageOptions
from elastic.config import build_config
from elastic.data_plan import DataCursor, take_global_batch
from elastic.hooks import resolve_hooks
from tests.s3 import TEST_CREDENTIALS
from workers.train_step import accumulate_gradients, collate

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


def loaded(checkpointer: RankCheckpointer, url: str) -> dict:
    fresh = Rank(seed=1)
    fresh.step()  # optimizer state that the load must overwrite
    checkpointer.load(fresh.model, fresh.optimizer, url)
    return fresh.snapshot()


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


@pytest.fixture
def checkpointer(world):
    checkpointer = RankCheckpointer(StorageOptions(), global_rank=0)
    checkpointer.attach(dist.new_group(backend="gloo"))
    yield checkpointer
    checkpointer.settle(timeout_s=10)


def test_consecutive_saves_load_back_the_state_at_save_time(rank, checkpointer, tmp_path):
    expected = {}
    for index in range(3):
        url = str(tmp_path / f"step-{index}")
        expected[url] = rank.snapshot()
        checkpointer.save(rank.model, rank.optimizer, url)
        rank.step()  # training goes on during the upload; the checkpoint keeps the staged state
        result = checkpointer.wait()
        assert result.ok, result.error
        assert result.upload_s > 0
    for url, state in expected.items():
        assert_same(loaded(checkpointer, url), state)


def test_reported_files_match_what_storage_holds(rank, checkpointer, tmp_path):
    url = str(tmp_path / "ckpt")
    checkpointer.save(rank.model, rank.optimizer, url)
    result = checkpointer.wait()
    assert result.ok, result.error
    fs, directory = StorageOptions().filesystem(url)
    assert result.files == stored_digests(fs, directory)
    assert set(result.files) == {".metadata", "__0_0.distcp"}


def test_buffers_are_reused_across_saves(rank, checkpointer, tmp_path):
    pointers = []
    for index in range(2):
        checkpointer.save(rank.model, rank.optimizer, str(tmp_path / f"step-{index}"))
        assert checkpointer.wait().ok
        pointers.append({name: buffer.data_ptr() for name, buffer in checkpointer.staging.buffers.items()})
        rank.step()
    assert pointers[0] == pointers[1] and len(pointers[0]) > 10


def test_a_failed_staging_does_not_break_the_next_save(rank, checkpointer, tmp_path, monkeypatch):
    checkpointer.save(rank.model, rank.optimizer, str(tmp_path / "first"))
    assert checkpointer.wait().ok
    first_buffers = checkpointer.staging

    def broken(self, tensors):
        raise RuntimeError("injected staging failure")

    with monkeypatch.context() as patch:
        patch.setattr(staging_buffers.StagingBuffers, "stage", broken)
        with pytest.raises(RuntimeError, match="injected"):
            checkpointer.save(rank.model, rank.optimizer, str(tmp_path / "broken"))
    assert checkpointer.staging is None  # dropped: the next save stages into fresh buffers
    assert not checkpointer.wait().ok

    rank.step()
    expected = rank.snapshot()
    url = str(tmp_path / "after")
    checkpointer.save(rank.model, rank.optimizer, url)
    assert checkpointer.wait().ok
    assert checkpointer.staging is not first_buffers
    assert_same(loaded(checkpointer, url), expected)


def test_settle_abandons_an_upload_that_does_not_end(rank, checkpointer, tmp_path, monkeypatch):
    release = threading.Event()

    def stuck(*args):
        release.wait()
        raise RuntimeError("abandoned")

    monkeypatch.setattr(rank_checkpoint, "_upload", stuck)
    checkpointer.save(rank.model, rank.optimizer, str(tmp_path / "stuck"))
    abandoned = checkpointer.staging
    checkpointer.settle(timeout_s=0.5)
    assert checkpointer.upload is None and not checkpointer.uploading
    # The stuck upload may still read those buffers: the next save must not refill them.
    assert checkpointer.staging is None and abandoned is not None
    release.set()


def test_saves_to_s3(rank, world, s3_server, tmp_path, monkeypatch):
    for key, value in TEST_CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    options = StorageOptions(endpoint_url=s3_server.endpoint_url)
    checkpointer = RankCheckpointer(options, global_rank=0)
    checkpointer.attach(dist.new_group(backend="gloo"))
    try:
        expected = rank.snapshot()
        url = s3_server.url("run", "step-1")
        checkpointer.save(rank.model, rank.optimizer, url)
        result = checkpointer.wait()
        assert result.ok, result.error
        fs, directory = options.filesystem(url)
        assert result.files == stored_digests(fs, directory)
        assert_same(loaded(checkpointer, url), expected)
    finally:
        checkpointer.settle(timeout_s=10)


def save_as_rank(rank: int, store: str, url: str, out: str) -> None:
    """One rank of a two-rank (shard 2) world: train a step, save, report what it wrote."""
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        trainer = Rank(seed=0, shard=2)
        trainer.step()
        checkpointer = RankCheckpointer(StorageOptions(), global_rank=rank)
        checkpointer.attach(dist.new_group(backend="gloo"))
        try:
            checkpointer.save(trainer.model, trainer.optimizer, url)
            result = checkpointer.wait()
        finally:
            checkpointer.settle(timeout_s=10)
        full = _detached(training_state(trainer.model, trainer.optimizer), full=True)
        torch.save({"result": result, "full": full}, f"{out}/rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_two_rank_save_loads_into_one_rank(world, tmp_path):
    url = str(tmp_path / "ckpt")
    context = multiprocessing.get_context("spawn")
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

    checkpointer = RankCheckpointer(StorageOptions(), global_rank=0)
    assert_same(loaded(checkpointer, url), reports[0]["full"])

"""The driver's checkpoint manager over a local directory: commit, verify, retention."""

import hashlib

from checkpointing.manager import CheckpointManager
from checkpointing.storage import StorageOptions


def save(manager, step, commit=True):
    directory = manager.root_url + f"/step-{step:08d}"
    files = {}
    for name, payload in ((".metadata", b"meta"), ("__0_0.distcp", bytes([step % 256]) * 1000)):
        path = f"{directory}/{name}"
        fs, _ = manager.options.filesystem(path)
        fs.makedirs(directory, exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(payload)
        files[name] = (len(payload), hashlib.sha256(payload).hexdigest())
    if commit:
        manager.commit(step, {"epoch": 0, "position": step * 8}, {"shard": 1, "tp": 1}, "hash", files, {})
    return directory


def test_latest_skips_partial_and_corrupt_checkpoints(tmp_path):
    manager = CheckpointManager(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    save(manager, 5)
    flipped = save(manager, 10)
    save(manager, 15, commit=False)
    shard = f"{flipped}/__0_0.distcp"
    data = bytearray(open(shard, "rb").read())
    data[3] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    skipped = []
    latest = manager.latest(on_skip=lambda step, reason: skipped.append((step, reason)))
    assert latest.step == 5 and latest.manifest.cursor == {"epoch": 0, "position": 40}
    assert skipped == [(15, "no manifest (the checkpoint was never committed)"), (10, "__0_0.distcp checksum mismatch")]


def test_prune_keeps_the_newest_committed_and_the_save_in_flight(tmp_path):
    manager = CheckpointManager(str(tmp_path / "run"), StorageOptions(), every=5, keep=2)
    for step in (5, 10, 15):
        save(manager, step)
    save(manager, 20, commit=False)
    save(manager, 25, commit=False)
    assert manager.prune(writing=25) == [5, 20]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-00000010", "step-00000015", "step-00000025",
    ]


def test_due_every_n_steps_and_never_at_zero(tmp_path):
    manager = CheckpointManager(str(tmp_path), StorageOptions(), every=5, keep=1)
    assert [s for s in range(12) if manager.is_due(s)] == [5, 10]
    assert not CheckpointManager(str(tmp_path), StorageOptions(), every=0, keep=1).is_due(5)

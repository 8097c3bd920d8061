"""The driver's checkpoint catalog over a local directory: commit, verify, retention."""

import hashlib

from checkpointing.catalog import CheckpointCatalog
from checkpointing.storage import StorageOptions


def save(catalog, step, commit=True):
    directory = catalog.root_url + f"/step-{step:08d}"
    files = {}
    for name, payload in ((".metadata", b"meta"), ("__0_0.distcp", bytes([step % 256]) * 1000)):
        path = f"{directory}/{name}"
        fs, _ = catalog.options.filesystem(path)
        fs.makedirs(directory, exist_ok=True)
        with open(path, "wb") as handle:
            handle.write(payload)
        files[name] = (len(payload), hashlib.sha256(payload).hexdigest())
    if commit:
        catalog.commit(step, {"epoch": 0, "position": step * 8}, {"shard": 1, "tp": 1}, "hash", files, {})
    return directory


def test_latest_skips_partial_and_corrupt_checkpoints(tmp_path):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    save(catalog, 5)
    flipped = save(catalog, 10)
    save(catalog, 15, commit=False)
    shard = f"{flipped}/__0_0.distcp"
    data = bytearray(open(shard, "rb").read())
    data[3] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    skipped = []
    latest = catalog.latest(on_skip=lambda step, reason: skipped.append((step, reason)))
    assert latest.step == 5 and latest.manifest.cursor == {"epoch": 0, "position": 40}
    assert skipped == [(15, "no manifest (the checkpoint was never committed)"), (10, "__0_0.distcp checksum mismatch")]


def test_prune_keeps_the_newest_committed_and_the_save_in_flight(tmp_path):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=2)
    for step in (5, 10, 15):
        save(catalog, step)
    save(catalog, 20, commit=False)
    save(catalog, 25, commit=False)
    assert catalog.prune(writing=25) == [5, 20]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        "step-00000010", "step-00000015", "step-00000025",
    ]


def test_due_every_n_steps_and_never_at_zero(tmp_path):
    catalog = CheckpointCatalog(str(tmp_path), StorageOptions(), every=5, keep=1)
    assert [s for s in range(12) if catalog.is_due(s)] == [5, 10]
    assert not CheckpointCatalog(str(tmp_path), StorageOptions(), every=0, keep=1).is_due(5)

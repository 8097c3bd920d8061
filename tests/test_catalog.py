"""The driver's checkpoint catalog over a local directory: commit, verify, retention."""

import hashlib
import json
import pickle

import pytest
from torch.distributed.checkpoint.metadata import Metadata

from checkpointing.catalog import CheckpointCatalog, NoUsableCheckpoint
from checkpointing.storage import StorageOptions
from tests.test_safe_loading import RunsCode

METADATA = pickle.dumps(Metadata(state_dict_metadata={}))


def save(catalog, step, commit=True, metadata=METADATA):
    directory = catalog.root_url + f"/step-{step:08d}"
    files = {}
    for name, payload in ((".metadata", metadata), ("__0_0.distcp", bytes([step % 256]) * 1000)):
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


def committed_dirs(catalog):
    fs, root = catalog.options.filesystem(catalog.root_url)
    return sorted(entry.rsplit("/", 1)[-1] for entry in fs.ls(root, detail=False))


@pytest.mark.parametrize("manifest", [b"null", b'"a string"', b"\xff\xfe not utf-8", b"{}"])
def test_a_manifest_that_does_not_parse_is_corrupt_and_the_previous_checkpoint_is_used(tmp_path, manifest):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    save(catalog, 5)
    broken = save(catalog, 10)
    with open(f"{broken}/manifest.json", "wb") as handle:
        handle.write(manifest)
    skipped = []
    assert catalog.latest(on_skip=lambda step, reason: skipped.append(step)).step == 5
    assert skipped == [10] and "corrupt-step-00000010" in committed_dirs(catalog)


def rewrite_manifest(directory, edit):
    path = f"{directory}/manifest.json"
    data = json.loads(open(path).read())
    edit(data)
    open(path, "w").write(json.dumps(data))


@pytest.mark.parametrize("edit, reason", [
    (lambda m: m["files"][0].update(name="../../../secret.txt"), "is not a file DCP writes"),
    (lambda m: m.update(step=7), "the manifest says step 7 inside step-00000010"),
    (lambda m: m.update(step="10"), "step"),
    (lambda m: m.update(unexpected=1), "Extra inputs are not permitted"),
])
def test_a_manifest_outside_the_schema_is_corrupt(tmp_path, edit, reason):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    save(catalog, 5)
    rewrite_manifest(save(catalog, 10), edit)
    skipped = []
    assert catalog.latest(on_skip=lambda step, why: skipped.append(why)).step == 5
    assert reason in skipped[0]


def test_when_every_checkpoint_is_corrupt_the_run_stops_unless_told_to_start_fresh(tmp_path):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    for step in (5, 10):
        rewrite_manifest(save(catalog, step), lambda m: m["files"][0].update(sha256="0" * 64))
    with pytest.raises(NoUsableCheckpoint, match=r"all 2 committed checkpoint\(s\) .* --start-fresh"):
        catalog.latest()
    assert committed_dirs(catalog) == ["step-00000005", "step-00000010"]  # nothing moved: the user decides
    assert catalog.latest(start_fresh=True) is None
    assert committed_dirs(catalog) == ["corrupt-step-00000005", "corrupt-step-00000010"]


def test_the_same_step_corrupted_again_and_again_is_moved_aside_each_time_under_a_name_of_its_own(tmp_path):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    save(catalog, 5)
    for _ in range(3):  # the step retrained from step 5 and its shard truncated again
        directory = save(catalog, 10)
        with open(f"{directory}/__0_0.distcp", "r+b") as shard:
            shard.truncate(100)
        assert catalog.latest().step == 5
    assert committed_dirs(catalog) == ["corrupt-step-00000010", "corrupt-step-00000010.1", "corrupt-step-00000010.2",
                                       "step-00000005"]
    fs, root = catalog.options.filesystem(catalog.root_url)
    assert fs.ls(f"{root}/corrupt-step-00000010.2", detail=False)  # whole, not nested in another


def test_retention_follows_commit_order_and_keeps_the_checkpoint_resumed_from(tmp_path):
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=2)
    for step in (5, 10, 15):
        save(catalog, step)
    assert catalog.prune() == [5]
    # The run resumed from step 10 (step 15's data went bad and was moved aside); its next
    # commits carry lower step numbers than the old newest, and are the newest all the same.
    catalog.move_aside(15)
    for step in (11, 12):
        save(catalog, step)
        catalog.prune(protect=(step, 10))
    assert [name for name in committed_dirs(catalog) if name.startswith("step-")] == [
        "step-00000010", "step-00000011", "step-00000012"
    ]
    assert catalog.latest().step == 12
    save(catalog, 13)
    assert catalog.prune(protect=(13, 12)) == [10, 11]


def test_with_a_signing_key_only_manifests_signed_with_it_are_loaded(tmp_path):
    key = b"a key kept outside the bucket"
    signed = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10, signing_key=key)
    save(signed, 5)
    save(signed, 10)
    forged = f"{save(signed, 15)}/manifest.json"  # a bucket writer swaps a shard and fixes its digest
    record = json.loads(open(forged).read())
    record["files"][1]["sha256"] = hashlib.sha256(b"evil").hexdigest()
    open(forged, "w").write(json.dumps(record))
    unsigned = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    save(unsigned, 20)  # written without the key (or by someone who lacks it)

    skipped = []
    assert signed.latest(on_skip=lambda step, reason: skipped.append((step, reason))).step == 10
    assert skipped == [(20, "the manifest is not signed, and ELASTIC_CHECKPOINT_KEY is set"),
                       (15, "the manifest's signature does not match ELASTIC_CHECKPOINT_KEY")]
    other_key = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10, signing_key=b"other")
    with pytest.raises(NoUsableCheckpoint, match="signature does not match"):
        other_key.latest()
    stored = b"".join(p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert key not in stored, "the key is never stored beside the checkpoints"


@pytest.mark.parametrize("payload", ["runs code", "not metadata"])
def test_a_checkpoint_whose_metadata_would_run_code_is_refused_and_moved_aside(tmp_path, payload):
    # what an attacker with write access to the bucket puts in .metadata
    payload = pickle.dumps(RunsCode(tmp_path / "ran") if payload == "runs code" else {"not": "metadata"})
    catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), every=5, keep=10)
    save(catalog, 5)
    save(catalog, 10, metadata=payload)  # digests recomputed: the manifest matches the poisoned file
    skipped = []
    found = catalog.latest(on_skip=lambda step, reason: skipped.append((step, reason)))
    assert found.step == 5
    [(step, reason)] = skipped
    assert step == 10 and "refused" in reason
    assert not (tmp_path / "ran").exists()
    with pytest.raises(NoUsableCheckpoint, match="refused"):
        only = CheckpointCatalog(str(tmp_path / "other"), StorageOptions(), every=5, keep=10)
        save(only, 5, metadata=payload)
        only.latest()

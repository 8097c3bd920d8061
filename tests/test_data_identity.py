"""What a run's data is, for a resume: every byte of every file (read once, kept with the run
under the file's stamp), every file of the tokenizer, and an index kept with the run that is
trusted only as the run signed it."""

from __future__ import annotations

import hashlib
import io
import json
import os

import fsspec
import numpy as np
import pytest

from checkpointing.catalog import Restorable
from checkpointing.manifest import FileRecord, Manifest
from checkpointing.signing import SIGNING_KEY_ENV
from elastic.core.events import EventKind, EventLog
from elastic.data import digests, packing
from elastic.data.kept import KeptFiles
from elastic.setup.dataset import data_identity, default_datasets, generate_corpus
from elastic.setup.errors import ConfigError
from elastic.setup.preflight import build_config
from elastic.setup.resume_checks import resume_over_data
from elastic.testing.tokenizer import make_tokenizer

SEQ_LEN = 16
VOCAB = 300
DOCUMENTS = generate_corpus(200_000, 3).decode().split(". ")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return str(make_tokenizer(tmp_path_factory.mktemp("tokenizer"), DOCUMENTS, VOCAB))


@pytest.fixture(autouse=True)
def a_new_process():
    """Each leg of a run is a process of its own: nothing it took is known to the next."""
    digests._TAKEN.clear()
    packing._BUILT.clear()
    yield
    digests._TAKEN.clear()
    packing._BUILT.clear()


def write_jsonl(path, count: int) -> str:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS[:count]))
    return str(path)


def train_set(data: dict, **values):
    config = build_config({"data": {"seq_len": SEQ_LEN, **data}, "model": {"vocab_size": VOCAB}, **values})
    return config, default_datasets(config, VOCAB)[0]


def checkpoint_over(identity: dict[str, str]) -> Restorable:
    manifest = Manifest(step=4, cursor={"epoch": 1, "position": 16}, topology={"shard": 1, "tp": 1},
                        config_hash="h", data=identity, files=(FileRecord(name=".metadata", size=1, sha256="0" * 64),))
    return Restorable("file:///run/checkpoints/step-00000004", manifest)


def change_the_middle(path) -> int:
    """Same-length replacements inside bytes 66,000-74,000 (beyond 64 KiB from either end of a
    140 KB file); how many."""
    data = bytearray(path.read_bytes())
    assert len(data) > 140_000
    changed = 0
    for at in range(66_000, 74_000):
        if data[at : at + 1] == b"a":
            data[at : at + 1], changed = b"o", changed + 1
    path.write_bytes(bytes(data))
    return changed


@pytest.mark.parametrize("form", ["jsonl", "tokens"])
def test_a_file_changed_in_its_middle_at_its_size_is_other_data_on_resume(tmp_path, tokenizer, form):
    if form == "jsonl":
        path = tmp_path / "train.jsonl"
        write_jsonl(path, 2_900)
        data = {"path": str(path), "tokenizer": tokenizer}
    else:
        path = tmp_path / "train.bin"
        np.frombuffer(generate_corpus(140_500, 5), np.uint8).astype("<u2").tofile(path)
        data = {"path": str(path), "format": "tokens"}
    named = {"storage": str(tmp_path / "runs"), "run_name": "r"}
    config, dataset = train_set(data, **named)
    trained_on = data_identity(dataset)
    [file] = [file for file in trained_on if file != "data.tokenizer"]
    size, whole = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()

    assert change_the_middle(path) > 0 and path.stat().st_size == size
    digests._TAKEN.clear()
    packing._BUILT.clear()  # the resume is a new process
    now = data_identity(train_set(data, **named)[1])
    assert now[file] != trained_on[file]
    assert trained_on[file] == f"{size} bytes, sha256 {whole}"
    checkpoint = checkpoint_over(trained_on)
    events = EventLog(lambda: 0.0)
    with pytest.raises(ConfigError, match=rf"its data changed since: {file}: {size} bytes, sha256 .* -> {size} bytes"):
        resume_over_data(config, "r", checkpoint, now, events)
    accepted, _ = train_set(data, checkpoint={"accept_changed_data": True}, **named)
    resume_over_data(accepted, "r", checkpoint, now, events)
    [event] = events.of_kind(EventKind.DATA_CHANGED)
    assert event["files"] == [file]


def test_a_later_leg_reads_an_unchanged_file_no_more_and_a_rewritten_one_again(tmp_path, monkeypatch):
    path = tmp_path / "train.bin"
    (np.arange(50_000) % 256).astype("<u2").tofile(path)
    data = {"path": str(path), "format": "tokens"}
    named = {"storage": str(tmp_path / "runs"), "run_name": "r"}
    first = data_identity(train_set(data, **named)[1])
    digests._TAKEN.clear()  # the next leg

    read = []
    real_digest = digests.file_digest
    monkeypatch.setattr(digests, "file_digest", lambda fs, file: read.append(file) or real_digest(fs, file))
    assert data_identity(train_set(data, **named)[1]) == first and read == []
    path.write_bytes(path.read_bytes())  # the same bytes, written again: another stamp, read once more
    digests._TAKEN.clear()
    assert data_identity(train_set(data, **named)[1]) == first and len(read) == 1


def test_a_tokenizer_changed_in_any_of_its_files_is_another_tokenizer(tmp_path, tokenizer):
    import shutil

    directory = tmp_path / "tokenizer"
    shutil.copytree(tokenizer, directory)
    data = {"path": write_jsonl(tmp_path / "train.jsonl", 300), "tokenizer": str(directory)}
    named = {"storage": str(tmp_path / "runs"), "run_name": "r"}
    _, before = train_set(data, **named)
    ends = before.tokenizer.eos_token_id

    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|system|>"  # another end-of-sequence token: documents end in another id
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    packing._BUILT.clear()
    _, after = train_set(data, **named)
    assert after.tokenizer.eos_token_id != ends
    assert data_identity(after)["data.tokenizer"] != data_identity(before)["data.tokenizer"]
    assert len(list((tmp_path / "runs" / "r" / "data" / "index").glob("*.npz"))) == 2  # indexed anew

    (directory / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|user|>"}))
    packing._BUILT.clear()
    assert data_identity(train_set(data, **named)[1])["data.tokenizer"] != data_identity(after)["data.tokenizer"]


def rewrite_index(path, change) -> None:
    with np.load(path, allow_pickle=False) as kept:
        arrays = {name: kept[name] for name in kept.files}
    change(arrays)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.write_bytes(buffer.getvalue())


def test_an_index_changed_by_whoever_lacks_the_runs_key_is_made_again(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv(SIGNING_KEY_ENV, "k" * 32)
    data = {"path": write_jsonl(tmp_path / "train.jsonl", 2_000), "tokenizer": tokenizer}
    named = {"storage": str(tmp_path / "runs"), "run_name": "r"}
    _, first = train_set(data, **named)
    samples, trained_on = [first[i].numpy() for i in range(len(first))], data_identity(first)
    [index] = (tmp_path / "runs" / "r" / "data" / "index").glob("*.npz")

    def every_document_at_the_first(arrays):  # 1,999 of 2,000 documents point at document 0's bytes
        arrays["0.spans"][:, 1:] = arrays["0.spans"][:, :1]
        arrays["0.lengths"][1:] = arrays["0.lengths"][0]

    rewrite_index(index, every_document_at_the_first)
    packing._BUILT.clear()
    _, again = train_set(data, **named)
    assert len(again) == len(samples) and all(np.array_equal(again[i].numpy(), sample)
                                              for i, sample in enumerate(samples))
    with np.load(index, allow_pickle=False) as kept:  # and kept again, signed, as it is
        assert not np.array_equal(kept["0.spans"][:, 1], kept["0.spans"][:, 0])

    # the digests kept with it likewise: one vouching for changed data is not taken
    (tmp_path / "train.jsonl").write_text((tmp_path / "train.jsonl").read_text().replace("a", "o", 1))
    record = tmp_path / "runs" / "r" / "data" / "index" / digests.DIGESTS_NAME
    trusted = json.loads(record.read_text())
    [entry] = trusted.values()
    entry["stamp"] = digests.stamp(fsspec.filesystem("file").info(str(tmp_path / "train.jsonl")))
    record.write_text(json.dumps(trusted))
    digests._TAKEN.clear()
    packing._BUILT.clear()
    assert data_identity(train_set(data, **named)[1]) != trained_on


def test_a_signed_file_moved_under_another_name_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv(SIGNING_KEY_ENV, "k" * 32)
    kept = KeptFiles(str(tmp_path))
    kept.write("a.npz", b"the index of some data")
    assert kept.read("a.npz") == b"the index of some data"
    for suffix in ("", ".hmac"):
        os.replace(tmp_path / f"a.npz{suffix}", tmp_path / f"b.npz{suffix}")
    assert kept.read("b.npz") is None
    monkeypatch.setenv(SIGNING_KEY_ENV, "another key")
    kept.write("a.npz", b"the index of some data")
    monkeypatch.setenv(SIGNING_KEY_ENV, "k" * 32)
    assert kept.read("a.npz") is None

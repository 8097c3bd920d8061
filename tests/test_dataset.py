"""Byte datasets: text files read lazily by byte range, locally and on a real S3 API server (moto)."""

import pickle
import random
import time

import fsspec
import pytest
import torch

from elastic.data.streams import TextFiles, resolve_text_files
from elastic.setup.dataset import GeneratedCorpus, generate_corpus
from elastic.testing.memory import reset_peak_rss, rss_bytes


def eager_samples(data: bytes, seq_len: int) -> list[torch.Tensor]:
    """The construction the datasets replaced: the whole stream widened to int64, then sliced."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return [tokens[i * seq_len : i * seq_len + seq_len + 1] for i in range((len(tokens) - 1) // seq_len)]


def eager_text_samples(path: str, seq_len: int) -> list[torch.Tensor]:
    chunks = []
    for url in resolve_text_files(path):
        with fsspec.open(url, "rb") as handle:
            chunks.append(handle.read())
    return eager_samples(b"\n".join(chunks), seq_len)


def write_files(directory, sizes, seed=0):
    """Random bytes (newlines included) in files whose names sort in the order given."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for n, size in enumerate(sizes):
        (directory / f"part-{n:02d}.txt").write_bytes(rng.randbytes(size))
    return str(directory / "*.txt")


def assert_same_samples(dataset, expected, order):
    assert len(dataset) == len(expected)
    for index in order:
        sample = dataset[index]
        assert sample.dtype == torch.int64 and sample.shape == (dataset.seq_len + 1,)
        assert torch.equal(sample, expected[index]), index


# More files than the handle cache holds, an empty file, files shorter than a sample (so some
# windows hold several separators) and longer ones; read in a shuffled order.
SIZES = [50, 0, 3, 129, 1, 64, 200, 17, 0, 90, 33, 250, 8]


@pytest.mark.parametrize("seq_len", [1, 7, 16, 64])
def test_text_files_samples_are_byte_identical_to_the_eager_stream(tmp_path, seq_len):
    path = write_files(tmp_path / "corpus", SIZES)
    expected = eager_text_samples(path, seq_len)
    dataset = TextFiles(path, seq_len)
    order = list(range(len(expected)))
    random.Random(seq_len).shuffle(order)
    assert_same_samples(dataset, expected, order)
    assert len(dataset._handles) <= 8
    assert dataset.n_tokens() == sum(SIZES) + len(SIZES) - 1
    # Among them, windows that hold a separator (a file boundary) and bytes on both sides of it.
    separators = [sum(SIZES[: n + 1]) + n for n in range(len(SIZES) - 1)]
    crossing = [i for i in order if any(i * seq_len < at < i * seq_len + seq_len for at in separators)]
    assert crossing or seq_len == 1
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_one_file_and_the_generated_corpus_match_the_eager_stream(tmp_path):
    single = tmp_path / "one.txt"
    single.write_bytes(b"hello world\nthe end")
    assert_same_samples(TextFiles(str(single), 4), eager_text_samples(str(single), 4), range(4))
    corpus = GeneratedCorpus(seq_len=16, n_bytes=5_000, seed=3)
    expected = eager_samples(generate_corpus(5_000, 3), 16)
    assert_same_samples(corpus, expected, range(len(expected)))
    assert "_data" not in pickle.loads(pickle.dumps(corpus)).__dict__


def test_a_corpus_shorter_than_one_sample_raises_value_error(tmp_path):
    path = write_files(tmp_path / "short", [3, 0, 2])  # 7 bytes with the separators
    dataset = TextFiles(path, seq_len=7)
    with pytest.raises(ValueError, match="holds 7 tokens, fewer than one sample"):
        len(dataset)
    with pytest.raises(ValueError, match="fewer than one sample"):
        dataset[0]
    assert len(TextFiles(path, seq_len=6)) == 1


def test_text_files_on_s3_read_the_same_samples_as_the_local_copy(tmp_path, s3_server, monkeypatch):
    local = write_files(tmp_path / "corpus", [300, 0, 45, 1000, 77], seed=5)
    s3 = s3_server.filesystem()
    for file in sorted((tmp_path / "corpus").iterdir()):
        s3.pipe(f"{s3_server.bucket}/corpus/{file.name}", file.read_bytes())
    s3.pipe(f"{s3_server.bucket}/corpus/notes.md", b"not matched by the glob")
    # data.path carries no storage options: the endpoint comes from fsspec's config, as it
    # could from a node's environment (FSSPEC_S3_*).
    monkeypatch.setitem(fsspec.config.conf, "s3", {
        "client_kwargs": {"endpoint_url": s3_server.endpoint_url}, "key": "testing", "secret": "testing",
    })
    remote = TextFiles(s3_server.url("corpus", "*.txt"), seq_len=16)
    expected = [TextFiles(local, 16)[i] for i in range(len(TextFiles(local, 16)))]
    assert_same_samples(remote, expected, range(len(expected)))
    # Shipped to a rank: no filesystem in the pickle, the driver's layout kept.
    shipped = pickle.loads(pickle.dumps(remote))
    assert "_fs" not in shipped.__dict__ and "_layout" in shipped.__dict__
    assert_same_samples(shipped, expected, [len(expected) - 1, 0, 20])


def test_memory_stays_flat_on_a_corpus_far_larger_than_the_allowance(tmp_path):
    big, small, seq_len = 256 << 20, 1000, 500  # a window straddles the files
    corpus = tmp_path / "big"
    corpus.mkdir()
    block = random.Random(0).randbytes(1 << 20)
    with open(corpus / "a.txt", "wb") as handle:
        for n in range(big >> 20):
            handle.write(n.to_bytes(8, "little") + block[8:])  # every MiB differs
    (corpus / "b.txt").write_bytes(block[:small])
    field = reset_peak_rss()
    before = rss_bytes(field)
    started = time.monotonic()

    dataset = TextFiles(str(corpus / "*.txt"), seq_len)
    assert len(dataset) == (big + 1 + small - 1) // seq_len
    indices = sorted(random.Random(1).sample(range(len(dataset)), 300)) + [big // seq_len, len(dataset) - 1]
    samples = {index: dataset[index] for index in indices}
    shipped = pickle.dumps(dataset)
    again = pickle.loads(shipped)
    assert torch.equal(again[indices[0]], samples[indices[0]])

    growth = rss_bytes(field) - before
    elapsed = time.monotonic() - started
    print(f"\n{field} growth {growth / 2**20:.1f} MiB over a {big >> 20} MiB corpus, {elapsed:.2f}s")
    assert growth < 64 << 20, f"{field} grew {growth / 2**20:.0f} MiB reading a {big >> 20} MiB corpus"
    assert len(shipped) < 4096
    # The samples are the stream's bytes, across the boundary and its separator too.
    with open(corpus / "a.txt", "rb") as a:
        for index in indices[:300:50]:  # within a.txt
            a.seek(index * seq_len)
            assert bytes(samples[index].to(torch.uint8)) == a.read(seq_len + 1)
    crossing, tail = bytes(samples[big // seq_len].to(torch.uint8)), big % seq_len
    assert 0 < tail < seq_len and crossing == block[-tail:] + b"\n" + block[: seq_len - tail]

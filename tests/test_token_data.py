"""Token files (read by memory map or byte range), ``elastic prepare``, and held-out splits."""

import functools
import http.server
import math
import pickle
import random
import threading
import time
import tomllib

import fsspec
import numpy as np
import pytest
import torch

import elastic.prepare
from checkpointing.storage import StorageOptions
from elastic.cli import main
from elastic.setup.config import ConfigError
from elastic.core.data_plan import DataCursor, take_global_batch
from elastic.data.streams import TextFiles, TokenFile
from elastic.setup.dataset import GeneratedCorpus, SampleRange, default_datasets, generate_corpus
from elastic.setup.hooks import resolve_hooks
from elastic.setup.preflight import build_config
from elastic.prepare import prepare_tokens
from elastic.trainer import ElasticTrainer
from elastic.testing.memory import reset_peak_rss, rss_bytes
from tests.test_dataset import assert_same_samples
from tests.tiny import tiny_config

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def write_tokens(path, tokens, dtype: str) -> str:
    np.asarray(tokens, dtype=DTYPES[dtype]).tofile(path)
    return str(path)


def random_tokens(n: int, dtype: str, seed: int = 0) -> np.ndarray:
    high = np.iinfo(DTYPES[dtype]).max
    return np.random.default_rng(seed).integers(0, high, size=n, endpoint=True)


def windows(tokens: np.ndarray, seq_len: int) -> list[torch.Tensor]:
    """The samples by definition: windows of seq_len + 1 tokens, one token shared between neighbours."""
    return [torch.from_numpy(tokens[i * seq_len : i * seq_len + seq_len + 1].astype(np.int64))
            for i in range((len(tokens) - 1) // seq_len)]


# --- TokenFile ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("n_tokens, seq_len", [(1000, 7), (1001, 8), (9, 8), (4096, 64)])
def test_token_file_samples_are_the_tokens_written(tmp_path, dtype, n_tokens, seq_len):
    tokens = random_tokens(n_tokens, dtype, seed=n_tokens)
    tokens[:2] = [0, np.iinfo(DTYPES[dtype]).max]  # both ends of the range survive the widening
    dataset = TokenFile(write_tokens(tmp_path / "t.bin", tokens, dtype), seq_len, dtype)
    expected = windows(tokens, seq_len)
    assert len(dataset) == (n_tokens - 1) // seq_len == len(expected)
    order = list(range(len(expected)))
    random.Random(seq_len).shuffle(order)
    assert_same_samples(dataset, expected, order)
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_a_token_file_pickles_as_a_recipe_and_reads_after_many_maps(tmp_path, monkeypatch):
    tokens = random_tokens(50_000, "uint16")
    dataset = TokenFile(write_tokens(tmp_path / "t.bin", tokens, "uint16"), 16)
    expected = windows(tokens, 16)
    monkeypatch.setattr(elastic.data.streams, "_WINDOWS_PER_MAP", 5)  # the file is mapped afresh every 5 windows
    assert_same_samples(dataset, expected, range(0, len(expected), 97))
    shipped = pickle.dumps(dataset)
    assert len(shipped) < 1024, len(shipped)
    arrived = pickle.loads(shipped)
    assert {"_map", "_filesystem", "_map_reads"}.isdisjoint(arrived.__dict__)
    assert_same_samples(arrived, expected, [len(expected) - 1, 0, 1234])


def test_a_token_file_of_a_partial_token_is_refused_naming_path_and_dtype(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(bytes(1001))
    with pytest.raises(ValueError, match=r"1001 bytes, not a whole number of uint16 tokens.*data\.token_dtype"):
        len(TokenFile(str(odd), 8, "uint16"))
    with pytest.raises(ConfigError) as caught:
        build_config({"data": {"path": str(odd)}})
    message = str(caught.value)
    assert "data.path:" in message and "data.token_dtype" in message and str(odd) in message
    (tmp_path / "six.bin").write_bytes(bytes(1002))
    with pytest.raises(ConfigError, match="validation_path: .* not a whole number of uint32"):
        build_config({"data": {"validation_path": str(tmp_path / "six.bin"), "token_dtype": "uint32"}})
    assert build_config({"data": {"path": str(tmp_path / "six.bin")}}).data.token_dtype == "uint16"


def test_format_auto_reads_bin_as_tokens_and_the_rest_as_text(tmp_path):
    write_tokens(tmp_path / "train.bin", range(100), "uint16")
    write_tokens(tmp_path / "train.tok", range(100), "uint16")
    (tmp_path / "notes.txt").write_text("some text\n" * 10)

    def train_dataset(**data):
        return default_datasets(build_config({"data": {"seq_len": 8, **data}}))[0]

    assert isinstance(train_dataset(path=str(tmp_path / "train.bin")), TokenFile)
    assert isinstance(train_dataset(path=str(tmp_path / "notes.txt")), TextFiles)
    assert isinstance(train_dataset(path=str(tmp_path / "train.tok")), TextFiles)
    explicit = train_dataset(path=str(tmp_path / "train.tok"), format="tokens")
    assert isinstance(explicit, TokenFile) and torch.equal(explicit[1], torch.arange(8, 17))
    assert isinstance(train_dataset(path=str(tmp_path / "train.bin"), format="text"), TextFiles)
    with pytest.raises(ConfigError, match="data.format"):
        build_config({"data": {"format": "csv"}})


# --- prepare ---------------------------------------------------------------------------------


def read_tokens(path, dtype="uint16") -> list[int]:
    return np.fromfile(path, dtype=DTYPES[dtype]).tolist()


def test_prepare_byte_level_round_trips_the_bytes(tmp_path):
    text = "Grüße, world.\n€ and 🙂 span bytes\n\nlast line, no newline".encode() + bytes(range(256))
    (tmp_path / "in.txt").write_bytes(text)
    result = prepare_tokens([str(tmp_path / "in.txt")], str(tmp_path / "out" / "train.bin"), progress=False)
    assert (result.tokens, result.dtype, result.max_token) == (len(text), "uint16", 255)
    assert result.output == str(tmp_path / "out" / "train.bin")
    assert bytes(read_tokens(result.output)) == text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.bin"]  # no partial file left


def test_prepare_appends_eos_after_each_file_in_input_order(tmp_path):
    for name, text in [("b.txt", "bb"), ("a.txt", "a"), ("c.md", "c\n")]:
        (tmp_path / name).write_text(text)
    out = str(tmp_path / "out.bin")
    result = prepare_tokens([str(tmp_path / "c.md"), str(tmp_path / "*.txt")], out, eos=256, progress=False)
    assert read_tokens(out) == [ord("c"), 10, 256, ord("a"), 256, ord("b"), ord("b"), 256]
    assert (result.tokens, result.max_token, result.dtype) == (8, 256, "uint16")
    # An eos past uint16 makes auto pick uint32.
    assert prepare_tokens([str(tmp_path / "a.txt")], out, eos=70_000, progress=False).dtype == "uint32"
    assert read_tokens(out, "uint32") == [ord("a"), 70_000]


def word_ids(text: str) -> list[int]:
    """A tokenizer that sees words: cutting a chunk inside a word would change its output."""
    return [sum(map(ord, word)) for word in text.split()]


class BigVocabulary:
    vocab_size = 70_000

    def encode(self, text: str) -> list[int]:
        return [69_990 + len(word) % 10 for word in text.split()]


def test_prepare_with_a_tokenizer_writes_its_ids_in_whole_line_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic.prepare, "CHUNK", 256)  # longer than any line
    words = [f"word{n}{'é' * (n % 3)}" for n in range(500)]
    text = "\n".join(" ".join(words[i : i + 7]) for i in range(0, 500, 7))
    (tmp_path / "in.txt").write_text(text)
    seen = []

    def tokenizer(chunk: str) -> list[int]:
        seen.append(chunk)
        return word_ids(chunk)

    out = str(tmp_path / "out.bin")
    result = prepare_tokens([str(tmp_path / "in.txt")], out, tokenizer=tokenizer, progress=False)
    assert len(seen) > 10 and "".join(seen) == text
    assert all(chunk.endswith("\n") for chunk in seen[:-1])
    assert read_tokens(out, result.dtype) == word_ids(text)
    assert result.dtype == "uint32"  # a tokenizer with no known vocabulary may use any id

    result = prepare_tokens([str(tmp_path / "in.txt")], out, tokenizer=BigVocabulary(), progress=False)
    assert result.dtype == "uint32" and result.max_token >= 65_536
    assert read_tokens(out, "uint32") == BigVocabulary().encode(text)


def test_prepare_cuts_a_line_longer_than_a_chunk_at_a_character(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic.prepare, "CHUNK", 100)
    text = "ü€🙂" * 500  # no newline; 4-byte characters straddle every read
    (tmp_path / "in.txt").write_text(text)
    seen = []

    def characters(chunk: str) -> list[int]:
        seen.append(len(chunk))
        return [ord(c) for c in chunk]

    out = str(tmp_path / "out.bin")
    result = prepare_tokens([str(tmp_path / "in.txt")], out, tokenizer=characters, progress=False)
    assert read_tokens(out, result.dtype) == [ord(c) for c in text]
    assert max(seen) < 2 * 100


def test_prepare_refuses_a_token_its_dtype_cannot_hold_and_leaves_no_file(tmp_path):
    (tmp_path / "in.txt").write_text("one two three\n" * 100)
    out = tmp_path / "out.bin"
    with pytest.raises(ConfigError, match=r"token 69995 does not fit uint16 \(0 to 65535\); use dtype='uint32'"):
        prepare_tokens([str(tmp_path / "in.txt")], str(out), tokenizer=BigVocabulary(), dtype="uint16", progress=False)
    with pytest.raises(ConfigError, match=r"token -1 does not fit uint32 \(0 to 4294967295\); check the tokenizer"):
        prepare_tokens([str(tmp_path / "in.txt")], str(out), tokenizer=lambda text: [5, -1], progress=False)
    with pytest.raises(ConfigError, match=r"eos: token 65536 does not fit uint16 \(0 to 65535\); use dtype='uint32'"):
        prepare_tokens([str(tmp_path / "in.txt")], str(out), dtype="uint16", eos=65_536, progress=False)
    with pytest.raises(ConfigError, match="'nothing-here/\\*.txt' matches no readable file"):
        prepare_tokens([str(tmp_path / "in.txt"), "nothing-here/*.txt"], str(out), progress=False)
    assert list(tmp_path.iterdir()) == [tmp_path / "in.txt"]


def test_prepare_shows_progress_in_bytes_on_large_input(tmp_path, monkeypatch, capsys):
    (tmp_path / "in.txt").write_bytes(b"x" * 5000)
    args = [str(tmp_path / "in.txt")], str(tmp_path / "out.bin")
    prepare_tokens(*args)
    assert capsys.readouterr().err == ""  # under the threshold: no bar
    monkeypatch.setattr(elastic.prepare, "PROGRESS_FROM_BYTES", 1000)
    prepare_tokens(*args)
    assert "4.88k" in capsys.readouterr().err  # 5000 bytes, in KiB
    prepare_tokens(*args, progress=False)
    assert capsys.readouterr().err == ""


def test_cli_prepare_writes_the_file_and_the_config_to_train_on_it(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hello\n" * 20)  # one sample of the default seq_len and more
    out = tmp_path / "data" / "train.bin"
    assert main(["prepare", str(tmp_path / "a.txt"), "--output", str(out), "--eos", "300", "--quiet"]) == 0
    assert read_tokens(out) == [*b"hello\n" * 20, 300]
    printed = capsys.readouterr().out
    assert f"wrote 121 uint16 tokens to {out}" in printed
    config = build_config(tomllib.loads(printed.split("in the config file:\n", 1)[1]))
    assert config.data.path == str(out) and config.data.format == "tokens" and config.data.token_dtype == "uint16"
    assert config.model.vocab_size == 320  # token 300 fits, and any tp up to 64 divides it

    assert main(["prepare", str(tmp_path / "missing*.txt"), "--output", str(tmp_path / "x.bin")]) == 2
    error = capsys.readouterr().err
    assert "missing*.txt' matches no readable file" in error and "give a readable file" in error
    assert not (tmp_path / "x.bin").exists()


# --- S3 ----------------------------------------------------------------------------------


def test_a_token_file_on_s3_is_read_by_byte_range(tmp_path, s3_server, monkeypatch):
    tokens = random_tokens(20_001, "uint32", seed=7)
    local = TokenFile(write_tokens(tmp_path / "t.bin", tokens, "uint32"), 100, "uint32")
    s3_server.filesystem().pipe(f"{s3_server.bucket}/data/t.bin", (tmp_path / "t.bin").read_bytes())
    url = s3_server.url("data", "t.bin")
    remote = TokenFile(url, 100, "uint32", StorageOptions(endpoint_url=s3_server.endpoint_url).for_url(url))
    ranges = []
    s3 = remote._filesystem[0]
    cat_file = s3.cat_file
    monkeypatch.setattr(s3, "cat_file", lambda path, start=None, end=None, **kw: (
        ranges.append((start, end)) or cat_file(path, start=start, end=end, **kw)))
    expected = [local[i] for i in range(len(local))]
    assert_same_samples(remote, expected, [0, 199, 57, 100])
    assert ranges == [(i * 400, (i * 100 + 101) * 4) for i in [0, 199, 57, 100]]  # one window a request
    shipped = pickle.loads(pickle.dumps(remote))
    assert "_filesystem" not in shipped.__dict__ and shipped._n_tokens == 20_001  # the driver's size travels
    assert_same_samples(shipped, expected, [3])


def test_data_on_a_server_that_ignores_byte_ranges_is_refused_in_one_line_before_training(tmp_path):
    # Python's own file server answers every GET with the whole file: a rank would pull the
    # whole file for each sample, and the windows would be wrong.
    write_tokens(tmp_path / "t.bin", random_tokens(5_000, "uint16", seed=3), "uint16")
    (tmp_path / "t.txt").write_text("hello world. " * 500)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            for name in ("t.bin", "t.txt"):
                url = f"http://127.0.0.1:{server.server_address[1]}/{name}"
                with pytest.raises(ConfigError, match=rf"data\.path: {url} ignored a byte-range request"):
                    build_config({"data": {"path": url}})
        finally:
            server.shutdown()


def test_prepare_writes_to_s3_only_when_complete(tmp_path, s3_server, monkeypatch):
    monkeypatch.setitem(fsspec.config.conf, "s3", {
        "client_kwargs": {"endpoint_url": s3_server.endpoint_url}, "key": "testing", "secret": "testing",
    })
    (tmp_path / "in.txt").write_text("to the bucket\n" * 1000)
    s3 = s3_server.filesystem()
    s3.pipe(f"{s3_server.bucket}/corpus/in.txt", (tmp_path / "in.txt").read_bytes())
    url = s3_server.url("tokens", "train.bin")
    result = prepare_tokens([s3_server.url("corpus", "*.txt")], url, eos=0, progress=False)
    assert result.output == url and result.tokens == 14_001
    assert s3.cat_file(f"{s3_server.bucket}/tokens/train.bin") == np.array(
        [*(tmp_path / "in.txt").read_bytes(), 0], dtype="<u2").tobytes()

    def fails_midway(text):
        raise RuntimeError("tokenizer crashed")

    failed = s3_server.url("tokens", "failed.bin")
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        prepare_tokens([str(tmp_path / "in.txt")], failed, tokenizer=fails_midway, progress=False)
    s3.invalidate_cache()
    assert not s3.exists(f"{s3_server.bucket}/tokens/failed.bin")


# --- memory ------------------------------------------------------------------------------


def test_reading_a_token_file_keeps_rss_flat(tmp_path):
    """A rank reads windows all over a 512 MiB file; its resident memory stays within 64 MiB.

    The file is sparse (holes read as token 0) with real tokens in a few windows. Every window
    read through the memory map becomes resident, with the kernel's fault-around (up to 64 KiB
    of neighbouring pages a fault): with one map kept, the 8192 windows read here leave up to
    8192 x 64 KiB = 512 MiB resident (measured: 339 MiB). TokenFile maps the file afresh every
    256 windows, so its map holds at most 256 x 64 KiB = 16 MiB (measured growth, all in:
    25 MiB); the rest of the budget covers a batch's int64 tensors (0.5 MiB), the epoch order
    (2 MiB) and the allocator.
    """
    size, seq_len, global_batch, steps = 512 << 20, 1024, 64, 128
    path = tmp_path / "big.bin"
    real = {}  # window index -> its tokens
    rng = np.random.default_rng(0)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for index in np.linspace(0, size // 2 // seq_len - 2, 9).astype(int):
            real[int(index)] = rng.integers(1, 65_535, seq_len + 1).astype("<u2")
            handle.seek(int(index) * seq_len * 2)
            handle.write(real[int(index)].tobytes())
    from workers.train_step import collate

    field = reset_peak_rss()
    before = rss_bytes(field)
    started = time.monotonic()
    dataset = TokenFile(str(path), seq_len, "uint16")  # the driver: len, then the epoch order
    dataset_len = len(dataset)
    assert dataset_len == (size // 2 - 1) // seq_len
    rank_side = pickle.loads(pickle.dumps(dataset))  # as shipped to a rank
    cursor, touched = DataCursor(), set()
    for _ in range(steps):
        indices, cursor = take_global_batch(cursor, dataset_len, global_batch, seed=0)
        batch = collate(rank_side, indices.tolist(), torch.device("cpu"))
        assert batch.inputs.shape == (global_batch, seq_len) and batch.counted_tokens == global_batch * seq_len
        touched.update(indices.tolist())
    batch = collate(rank_side, list(real), torch.device("cpu"))
    growth = rss_bytes(field) - before
    elapsed = time.monotonic() - started
    print(f"\n{field} growth {growth / 2**20:.1f} MiB reading {len(touched)} windows of a {size >> 20} MiB "
          f"token file, {elapsed:.2f}s")
    assert len(touched) == steps * global_batch
    assert min(touched) < dataset_len // 100 and max(touched) > dataset_len * 99 // 100  # the whole file
    assert growth < 64 << 20, f"{field} grew {growth / 2**20:.0f} MiB reading a {size >> 20} MiB token file"
    for inputs, targets, expected in zip(batch.inputs, batch.targets, real.values()):
        assert torch.equal(torch.cat([inputs, targets[-1:]]), torch.from_numpy(expected.astype(np.int64)))


# --- held-out data -----------------------------------------------------------------------


def test_sample_range_is_a_renumbered_view(tmp_path):
    base = GeneratedCorpus(seq_len=8, n_bytes=2_000, seed=1)
    view = SampleRange(base, 10, 14)
    assert len(view) == 4 and view.seq_len == 8
    for i in range(4):
        assert torch.equal(view[i], base[10 + i])
    for outside in (-1, 4):
        with pytest.raises(IndexError):
            view[outside]
    assert len(SampleRange(base, 5, 5)) == 0
    with pytest.raises(ValueError):
        SampleRange(base, 6, 5)
    shipped = pickle.loads(pickle.dumps(view))
    assert "_data" not in shipped.dataset.__dict__ and torch.equal(shipped[3], base[13])


@pytest.mark.parametrize("fraction", [0.001, 0.1, 0.5])
def test_validation_fraction_holds_out_the_tail_and_never_trains_on_it(tmp_path, fraction):
    (tmp_path / "corpus.txt").write_bytes(generate_corpus(20_000, 5))
    config = build_config({"data": {"path": str(tmp_path / "corpus.txt"), "seq_len": 16,
                                    "validation_fraction": fraction}})
    train, validation = default_datasets(config)
    base = TextFiles(str(tmp_path / "corpus.txt"), 16)
    n, held_out = len(base), max(1, round(len(base) * fraction))
    assert (len(train), len(validation)) == (n - held_out, held_out)
    assert (train.start, train.stop, validation.start, validation.stop) == (0, n - held_out, n - held_out, n)
    assert torch.equal(train[len(train) - 1], base[n - held_out - 1])
    assert torch.equal(validation[0], base[n - held_out]) and torch.equal(validation[held_out - 1], base[n - 1])


def test_the_default_corpus_has_a_validation_set_of_its_own(tmp_path):
    config = tiny_config(tmp_path)
    train, validation = default_datasets(config)
    data = config.data
    assert (train.n_bytes, train.seed) == (data.corpus_tokens, config.seed)
    assert validation.seed != config.seed
    assert validation.n_bytes == max(data.corpus_tokens // 10, 8 * (data.seq_len + 1)) == 4_000
    trained = {tuple(train[i].tolist()) for i in range(len(train))}
    held_out = [tuple(validation[i].tolist()) for i in range(len(validation))]
    assert sum(sample in trained for sample in held_out) < len(held_out) // 20
    # Small corpora still get a few batches' worth.
    small = default_datasets(tiny_config(tmp_path, data__corpus_tokens=100))[1]
    assert small.n_bytes == 8 * 33
    # A fraction applies to the default corpus too.
    train, validation = default_datasets(tiny_config(tmp_path, data__validation_fraction=0.25))
    assert isinstance(validation, SampleRange) and validation.dataset is train.dataset
    assert len(validation) == round(len(train.dataset) * 0.25)


def test_validation_path_is_its_own_data_in_the_run_format(tmp_path, monkeypatch):
    write_tokens(tmp_path / "train.bin", range(1000), "uint32")
    write_tokens(tmp_path / "val.bin", range(5000, 5200), "uint32")
    monkeypatch.chdir(tmp_path)
    config = build_config({"data": {"path": "train.bin", "validation_path": "val.bin", "token_dtype": "uint32",
                                    "seq_len": 10}})
    assert config.data.validation_path == str(tmp_path / "val.bin")  # absolute, like path
    train, validation = default_datasets(config)
    assert len(train) == 99 and len(validation) == 19
    assert torch.equal(validation[0], torch.arange(5000, 5011))
    assert default_datasets(build_config({"data": {"path": "train.bin", "token_dtype": "uint32"}}))[1] is None


def test_validation_settings_that_conflict_or_overreach_are_refused(tmp_path):
    (tmp_path / "v.txt").write_text("held out\n" * 100)
    with pytest.raises(ConfigError) as caught:
        build_config({"data": {"validation_fraction": 0.1, "validation_path": str(tmp_path / "v.txt")}})
    assert "validation_fraction=0.1 and validation_path=" in str(caught.value) and "only one" in str(caught.value)
    with pytest.raises(ConfigError, match="data.validation_fraction: .*0.6"):
        build_config({"data": {"validation_fraction": 0.6}})
    with pytest.raises(ConfigError, match="data.validation_path: .*matches no readable file"):
        build_config({"data": {"validation_path": str(tmp_path / "none.txt")}})


def test_validation_data_that_is_the_training_data_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # unread: the files need not exist
    for data, fix in (({"path": "t.bin", "validation_path": str(tmp_path / "t.bin")}, ", or unset it and hold out the "
                       "tail of path with validation_fraction"),
                      ({"sources": [{"path": "a.bin"}, {"path": "t.bin/"}], "validation_path": "t.bin"}, "")):
        with pytest.raises(ConfigError) as refused:
            build_config({"data": data})
        assert str(refused.value) == (f"invalid config: data: validation_path='{tmp_path / 't.bin'}' is the training "
                                      "data too, so its loss says nothing of data the model has not seen; give "
                                      f"held-out data{fix}")


def test_resolve_hooks_keeps_a_given_dataset_with_its_own_validation_set(tmp_path):
    config = tiny_config(tmp_path)
    mine, held_out = GeneratedCorpus(32, 5_000, 9), GeneratedCorpus(32, 500, 10)
    assert resolve_hooks(config, dataset=mine).eval_dataset is None
    hooks = resolve_hooks(config, dataset=mine, eval_dataset=held_out)
    assert hooks.dataset is mine and hooks.eval_dataset is held_out
    defaults = resolve_hooks(config)
    assert isinstance(defaults.dataset, GeneratedCorpus) and isinstance(defaults.eval_dataset, GeneratedCorpus)
    assert resolve_hooks(config, eval_dataset=held_out).eval_dataset is held_out


# --- a real run --------------------------------------------------------------------------


def test_a_run_trains_on_a_token_file_in_s3(ray_cluster, tmp_path, s3_server):
    (tmp_path / "corpus.txt").write_bytes(generate_corpus(40_000, 3))
    prepared = prepare_tokens([str(tmp_path / "corpus.txt")], str(tmp_path / "tokens.bin"), progress=False)
    s3_server.filesystem().pipe(f"{s3_server.bucket}/tokens.bin", (tmp_path / "tokens.bin").read_bytes())
    # The driver (checking data.path) and the ranks (reading it) both reach the server
    # through the run's own S3 settings, and nothing else.
    config = tiny_config(tmp_path, steps=6, data__path=s3_server.url("tokens.bin"), data__format="tokens",
                         checkpoint__s3_endpoint_url=s3_server.endpoint_url)
    trainer = ElasticTrainer(config)
    assert isinstance(trainer.hooks.dataset, TokenFile) and trainer.dataset_len == (prepared.tokens - 1) // 32
    result = trainer.fit()
    assert result.ok, result.exit
    assert result.summary["steps_committed"] == 6
    assert all(math.isfinite(loss) for loss in result.losses) and result.losses[-1] < result.losses[0]


# --- data that is wrong, not unreachable -----------------------------------------------------


def test_token_ids_beyond_the_vocab_are_refused_before_any_rank_starts(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, size=64 * 32 + 1)
    tokens[40 * 32 + 5] = 50_039  # in a window the check samples
    path = write_tokens(tmp_path / "train.bin", tokens, "uint16")
    config = tiny_config(tmp_path, data__path=path, data__validation_fraction=0.0, eval__every=0)
    with pytest.raises(ConfigError, match=r"^data.path: sample \d+ holds token id 50039 .* not below model.vocab_size "
                                          r"256: the data was tokenized for another vocabulary"):
        ElasticTrainer(config)
    # a custom model brings its own vocabulary: the ids are its business
    ElasticTrainer(config, model_fn=lambda: torch.nn.Embedding(60_000, 8))


def test_a_text_file_named_bin_is_refused_as_tokens(tmp_path):
    (tmp_path / "notes.bin").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    with pytest.raises(ConfigError, match=r"notes.bin looks like text, not uint16 token ids; .*data.format = \"text\""):
        build_config({"data": {"path": str(tmp_path / "notes.bin"), "seq_len": 8}})
    text = default_datasets(build_config({"data": {"path": str(tmp_path / "notes.bin"), "seq_len": 8,
                                                   "format": "text"}}))[0]
    assert isinstance(text, TextFiles)


def test_a_rank_that_reads_an_id_beyond_the_vocab_stops_the_run_with_it_and_evicts_nobody(ray_cluster, tmp_path):
    seq_len, n_windows = 32, 200
    tokens = np.random.default_rng(1).integers(0, 256, size=n_windows * seq_len + 1)
    sampled = {i * (n_windows - 1) // 63 for i in range(64)}
    unsampled = next(i for i in range(n_windows // 2, n_windows) if i not in sampled and i + 1 not in sampled)
    tokens[unsampled * seq_len + 3] = 300  # found only when a rank reads it
    path = write_tokens(tmp_path / "train.bin", tokens, "uint16")
    config = tiny_config(tmp_path, groups=2, min_groups=2, steps=30, data__path=path,
                         data__validation_fraction=0.0, eval__every=0)
    result = ElasticTrainer(config).fit()
    assert result.exit.startswith("stopped: step "), result.exit
    assert "own-data" in result.exit and f"DataError: sample {unsampled} holds token id 300" in result.exit
    kinds = [event["kind"] for event in result.summary["events"]]
    assert "rank-evicted" not in kinds and "rank-failed" not in kinds and "group-joined" in kinds
    [diagnosed] = [event for event in result.summary["events"] if event["kind"] == "failure-diagnosed"]
    assert diagnosed["cause"] == "own-data"  # counted in elastic_failures_total, though nothing recovered
    assert kinds.count("group-built") == 2  # the two groups of the start: no process was replaced


def test_a_run_resumed_over_a_corpus_that_doubled_is_refused_then_starts_a_new_epoch(ray_cluster, tmp_path):
    path = tmp_path / "train.bin"
    tokens = np.random.default_rng(2).integers(0, 256, size=40 * 32 + 1)
    write_tokens(path, tokens, "uint16")
    settings = dict(data__path=str(path), data__validation_fraction=0.0, eval__every=0, checkpoint__every=2,
                    run_name="changing-data")
    first = ElasticTrainer(tiny_config(tmp_path, steps=4, **settings)).fit()
    assert first.ok, first.exit
    write_tokens(path, np.concatenate([tokens, tokens]), "uint16")  # doubled under the same path
    with pytest.raises(ConfigError, match=r"resumes from step 4, but its data changed since: .*train.bin"):
        ElasticTrainer(tiny_config(tmp_path, steps=8, **settings)).fit()
    accepted = ElasticTrainer(tiny_config(tmp_path, steps=8, checkpoint__accept_changed_data=True, **settings)).fit()
    assert accepted.ok, accepted.exit
    [changed] = [event for event in accepted.summary["events"] if event["kind"] == "data-changed"]
    assert changed["cursor"] == {"epoch": 0, "position": 0}  # the data over from its first epoch
    assert accepted.summary["steps_committed"] == 4  # steps 4..7, from the resumed model


def save_word_tokenizer(directory, words: list[str]):
    """A HuggingFace tokenizer of one id a word, saved with save_pretrained as one downloaded
    from the Hub is; returns its backend, to look ids up."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: 3 + i for i, w in enumerate(
        sorted(set(words)))}}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                         unk_token="[UNK]").save_pretrained(directory)
    return backend


def test_prepare_with_a_huggingface_tokenizer_from_a_local_directory(tmp_path, capsys):
    """``elastic prepare --tokenizer DIR``: a HuggingFace tokenizer saved with save_pretrained,
    as one downloaded from the Hub is; no special tokens inside the text, its eos after each
    file, and the vocabulary to configure named."""
    text = "the quick brown fox jumps over the lazy dog\n" * 20
    backend = save_word_tokenizer(tmp_path / "tokenizer", text.split())
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.txt").write_text("lazy dog\n")
    out = tmp_path / "train.bin"
    assert main(["prepare", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "--output", str(out),
                     "--tokenizer", str(tmp_path / "tokenizer"), "--quiet"]) == 0
    ids = {word: backend.token_to_id(word) for word in text.split()}
    assert read_tokens(out) == [ids[w] for w in text.split()] + [2] + [ids["lazy"], ids["dog"], 2]
    assert "vocab_size = 64  # at least 11" in capsys.readouterr().out
    assert main(["prepare", str(tmp_path / "a.txt"), "--output", str(out), "--tokenizer",
                     str(tmp_path / "missing")]) == 2
    assert f"--tokenizer '{tmp_path / 'missing'}': the directory does not exist" in capsys.readouterr().err

    # A directory whose tokenizer is its own code (an auto_map): refused, the code never run,
    # whatever a terminal would have answered.
    import json
    import shutil

    shutil.copytree(tmp_path / "tokenizer", tmp_path / "custom")
    config_path = tmp_path / "custom" / "tokenizer_config.json"
    settings = json.loads(config_path.read_text())
    settings["auto_map"] = {"AutoTokenizer": ["custom_code.CustomTokenizer", "custom_code.CustomTokenizer"]}
    config_path.write_text(json.dumps(settings))
    marker = tmp_path / "ran"
    (tmp_path / "custom" / "custom_code.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PreTrainedTokenizerFast as CustomTokenizer\n")
    assert main(["prepare", str(tmp_path / "a.txt"), "--output", str(out), "--tokenizer",
                 str(tmp_path / "custom")]) == 2
    assert "--tokenizer" in capsys.readouterr().err
    assert not marker.exists()

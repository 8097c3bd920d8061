"""Data as people keep it: Parquet, JSONL (plain, gz, zst), HuggingFace save_to_disk and
Megatron pairs, tokenized, packed and mixed; bad data refused before anything starts."""

from __future__ import annotations

import gzip
import json
import logging
import pickle
import re

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from elastic.data.documents import DataError  # noqa: E402
from elastic.data.mixture import at_epoch  # noqa: E402
from elastic.data.tokenizing import IGNORE_INDEX  # noqa: E402
from elastic.setup.dataset import default_datasets, generate_corpus  # noqa: E402
from elastic.setup.errors import ConfigError  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402
from elastic.testing.megatron import write_megatron_pair  # noqa: E402
from elastic.testing.tokenizer import make_tokenizer  # noqa: E402

SEQ_LEN = 16
VOCAB = 300
DOCUMENTS = generate_corpus(40_000, 3).decode().split(". ")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return str(make_tokenizer(tmp_path_factory.mktemp("tokenizer"), DOCUMENTS, VOCAB))


def config_of(data: dict, **values):
    return build_config({"data": {"seq_len": SEQ_LEN, **data}, "model": {"vocab_size": VOCAB}, **values})


def train_set(data: dict, **values):
    return default_datasets(config_of(data, **values), VOCAB)[0]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def packed_stream(tokenizer_dir: str, documents: list[str]) -> np.ndarray:
    """What packing must give: each document's ids and the end-of-sequence token, end to end."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    return np.concatenate([[*row, tokenizer.eos_token_id] for row in ids])


def windows(dataset) -> np.ndarray:
    return np.stack([dataset[i].numpy() for i in range(len(dataset))])


def refused_in_one_line(data: dict, message: str) -> None:
    """``data`` refused before anything starts, in one line that says ``message`` (a regex)."""
    with pytest.raises(ConfigError, match=f"^invalid config: data.path: .*{message}") as raised:
        config_of(data)
    assert "\n" not in str(raised.value), raised.value


def test_every_format_packs_the_same_documents_into_the_same_windows(tmp_path, tokenizer):
    documents = DOCUMENTS[:600]
    pq.write_table(pa.table({"text": documents}), tmp_path / "d.parquet", row_group_size=64)
    plain = write_jsonl(tmp_path / "d.jsonl", [{"text": text, "id": i} for i, text in enumerate(documents)])
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress((tmp_path / "d.jsonl").read_bytes()))
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress((tmp_path / "d.jsonl").read_bytes()))
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": documents}).save_to_disk(str(tmp_path / "saved"))

    stream = packed_stream(tokenizer, documents)
    n = (len(stream) - 1) // SEQ_LEN
    expected = np.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])
    for path in ("d.parquet", "d.jsonl", "d.jsonl.gz", "d.jsonl.zst", "saved"):
        dataset = train_set({"path": str(tmp_path / path), "tokenizer": tokenizer})
        assert len(dataset) == n, path
        np.testing.assert_array_equal(windows(dataset), expected, err_msg=path)
        shipped = pickle.loads(pickle.dumps(dataset))  # as a rank gets it: the index, no caches
        assert shipped.lengths is not None
        np.testing.assert_array_equal(shipped[n - 1].numpy(), expected[n - 1], err_msg=path)
    # without a tokenizer, UTF-8 bytes are the tokens and a newline ends a document
    raw = train_set({"path": plain})
    assert raw[0].tolist() == list((documents[0] + "\n" + documents[1]).encode()[: SEQ_LEN + 1])


def test_a_rank_reads_only_the_row_group_a_window_lies_in(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCUMENTS[:640]}), tmp_path / "d.parquet", row_group_size=64)
    shipped = pickle.loads(pickle.dumps(train_set({"path": str(tmp_path / "d.parquet"), "tokenizer": tokenizer})))
    loaded = []
    file = shipped.files[0]
    original = file._load_block
    file._load_block = lambda block: loaded.append(block) or original(block)
    shipped[len(shipped) // 2]
    assert len(loaded) == 1 and 0 < loaded[0] < 9


def test_a_column_of_token_ids_is_read_as_it_is(tmp_path):
    rows = [list(range(i, i + 7)) for i in range(40)]
    pq.write_table(pa.table({"ids": rows}), tmp_path / "ids.parquet", row_group_size=8)
    dataset = train_set({"path": str(tmp_path / "ids.parquet"), "text_column": "ids"})
    stream = np.concatenate([[*row, ord("\n")] for row in rows])  # no tokenizer: a newline separates
    np.testing.assert_array_equal(dataset[3].numpy(), stream[3 * SEQ_LEN : 4 * SEQ_LEN + 1])


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_a_megatron_pair_is_its_token_stream(tmp_path, dtype):
    sequences = [list(range(5 * i, 5 * i + 9)) for i in range(30)]
    write_megatron_pair(tmp_path / "corpus_text_document", sequences, dtype)
    stream = np.concatenate(sequences)
    for named in ("corpus_text_document", "corpus_text_document.bin", "corpus_text_document.idx"):
        dataset = train_set({"path": str(tmp_path / named)})
        assert len(dataset) == (len(stream) - 1) // SEQ_LEN
        np.testing.assert_array_equal(dataset[2].numpy(), stream[2 * SEQ_LEN : 3 * SEQ_LEN + 1])
    (tmp_path / "corpus_text_document.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ConfigError, match=r"data.path: .*corpus_text_document.bin holds 10 bytes; its index counts"):
        config_of({"path": str(tmp_path / "corpus_text_document")})


def test_a_conversation_trains_on_the_assistants_tokens_only(tmp_path, tokenizer):
    from transformers import AutoTokenizer

    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sees"},
                    {"role": "assistant", "content": "a dog"}, {"role": "user", "content": "and then"},
                    {"role": "assistant", "content": "the old man"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}] * 8
                       + [{"prompt": "my sister likes", "completion": "two apples"}] * 8)
    dataset = train_set({"path": path, "format": "chat", "tokenizer": tokenizer})
    hf = AutoTokenizer.from_pretrained(tokenizer)
    ids = hf.apply_chat_template(conversation, tokenize=True, return_dict=False)
    trained = [token for index in range(len(dataset)) for token, label in
               zip(dataset[index]["input_ids"][1:].tolist(), dataset[index]["labels"][1:].tolist())
               if label != IGNORE_INDEX]
    assistant = [*hf("a dog", add_special_tokens=False)["input_ids"], hf.eos_token_id,
                 *hf("the old man", add_special_tokens=False)["input_ids"], hf.eos_token_id]
    assert trained[: len(assistant)] == assistant  # the first conversation's turns, nothing of the user's
    completion = [*hf("two apples", add_special_tokens=False)["input_ids"], hf.eos_token_id]
    assert trained[-len(completion):] == completion
    assert dataset[0]["input_ids"][: len(ids)].tolist() == ids[: SEQ_LEN + 1]


def test_a_mixture_keeps_every_sample_of_every_source_once_until_it_repeats(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCUMENTS[:300]}), tmp_path / "a.parquet", row_group_size=50)
    jsonl = write_jsonl(tmp_path / "b.jsonl", [{"text": text} for text in DOCUMENTS[300:900]])
    mixture = train_set({"sources": [{"path": str(tmp_path / "a.parquet"), "weight": 1},
                                     {"path": jsonl, "weight": 3}], "tokenizer": tokenizer})
    sizes = mixture.sizes.tolist()
    assert abs(mixture.counts[1] - 0.75 * len(mixture)) <= 1 and sum(mixture.counts) == len(mixture)
    # the source that runs out first sets the epoch, whole global batches of it
    assert len(mixture) % mixture.global_batch == 0 and sizes[1] - mixture.global_batch < mixture.counts[1] <= sizes[1]
    assert mixture.counts[0] < sizes[0]
    drawn: list[list[int]] = [[], []]
    for epoch in range(4):
        view = at_epoch(mixture, epoch)
        for index in range(len(view)):
            source, _, sample = view.locate(index)
            drawn[source].append(sample)
        assert np.array_equal(view[5].numpy(), view.sources[view.locate(5).source][view.locate(5).sample].numpy())
    for source, samples in enumerate(drawn):
        size = sizes[source]
        for start in range(0, len(samples) - size + 1, size):  # each whole pass over the source: all of it once
            assert sorted(samples[start : start + size]) == list(range(size)), source
        tail = samples[len(samples) - len(samples) % size :]
        assert len(set(tail)) == len(tail)
    assert mixture.identity()["data.sources"] == f"{tmp_path / 'a.parquet'} x1; {jsonl} x3"


def token_source(path, samples: int) -> str:
    """A token file of ``samples`` windows."""
    np.random.default_rng(samples).integers(0, VOCAB, samples * SEQ_LEN + 1).astype("<u2").tofile(path)
    return str(path)


def test_a_mixture_trains_every_sample_of_every_source_once_a_pass_and_passes_none_by(tmp_path):
    """Sources of 246 and 248 samples at 1:3 and a global batch of 8: the data plan skips an
    epoch's tail shorter than a batch, so the mixture's epoch is whole batches, and each pass
    over each source trains all of it once; the plan's cursor alone says how many of each."""
    from elastic.core.data_plan import DataCursor, take_global_batch

    sources = [{"path": token_source(tmp_path / "a.bin", 246), "weight": 1},
               {"path": token_source(tmp_path / "b.bin", 248), "weight": 3}]
    mixture = train_set({"sources": sources}, global_batch=8)
    assert mixture.sizes.tolist() == [246, 248]
    drawn: dict[tuple[int, int], list[int]] = {}  # (source, its own pass) -> its samples trained
    cursor = DataCursor()
    for _ in range(6 * len(mixture) // 8):  # six mixture epochs, resumable at any step from its cursor
        indices, cursor = take_global_batch(cursor, len(mixture), 8, mixture.seed)
        view = at_epoch(mixture, cursor.epoch)
        for index in indices.tolist():
            source, source_pass, sample = view.locate(index)
            drawn.setdefault((source, source_pass), []).append(sample)
    for source, size in enumerate(mixture.sizes.tolist()):
        passes = sorted(source_pass for s, source_pass in drawn if s == source)
        assert passes == list(range(len(passes))) and len(passes) >= 2
        for source_pass in passes[:-1]:  # the last is under way
            assert sorted(drawn[source, source_pass]) == list(range(size)), (source, source_pass)
        assert len(set(drawn[source, passes[-1]])) == len(drawn[source, passes[-1]])
    trained = [sum(len(samples) for (s, _), samples in drawn.items() if s == source) for source in (0, 1)]
    assert mixture.trained_before(cursor).tolist() == trained


def test_a_mixture_refuses_a_weight_that_trains_its_source_never_or_a_source_listed_twice(tmp_path):
    a, b = token_source(tmp_path / "a.bin", 100), token_source(tmp_path / "b.bin", 100)
    with pytest.raises(ConfigError, match=r"^invalid config: data.sources\[0\].weight=1e-06: its share of the "
                                          r"mixture's epoch of 96 samples rounds to none, so .*a.bin would never be "
                                          r"trained; give it a weight of at least 0.011, or drop the source$"):
        train_set({"sources": [{"path": a, "weight": 1e-6}, {"path": b}]}, global_batch=8)
    assert train_set({"sources": [{"path": a, "weight": 0.011}, {"path": b}]}, global_batch=8).counts.min() >= 1
    # weights near the float's largest: their sum is no float, their shares are
    assert train_set({"sources": [{"path": a, "weight": 1e308}, {"path": b, "weight": 1e308}]},
                     global_batch=8).counts.tolist() == [100, 100]
    with pytest.raises(ConfigError, match=r"^invalid config: data: sources\[0\] and sources\[2\] both read "
                                          r".*a.bin: each of its samples would train twice a pass; list it once, "
                                          r"with the two weights added \(3\)$"):
        config_of({"sources": [{"path": a}, {"path": b}, {"path": a, "weight": 2}]})
    with pytest.raises(ConfigError, match=r"^invalid config: data.sources: the mixture gives 6 samples before a "
                                          r"source would repeat, fewer than global_batch=8; lower global_batch"):
        train_set({"sources": [{"path": token_source(tmp_path / "c.bin", 3)}, {"path": b}]}, global_batch=8)


def test_each_source_reads_its_own_column_and_the_summary_counts_what_each_gave(tmp_path):
    """One Parquet file's two columns as two sources, 7:3: each reads its own text_column, else
    data.text_column; the leg's samples of each, from the data plan's cursors alone, are what
    the plan gave, close to 7:3."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from elastic.core.data_plan import DataCursor, take_global_batch
    from elastic.trainer import ElasticTrainer
    from tests.tiny import tiny_config

    qa = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"question": DOCUMENTS[:400], "answer": DOCUMENTS[400:800]}), qa)
    config = tiny_config(tmp_path, data__sources=[{"path": str(qa), "weight": 7, "text_column": "question"},
                                                  {"path": str(qa), "weight": 3}],
                         data__text_column="answer", data__seq_len=SEQ_LEN, model__vocab_size=VOCAB)
    trainer = ElasticTrainer(config, model_fn=lambda: None)
    mixture = trainer.hooks.dataset
    for source, column in enumerate(("question", "answer")):
        alone = train_set({"path": str(qa), "text_column": column})
        assert mixture.sizes[source] == len(alone)
        np.testing.assert_array_equal(mixture.sources[source][3].numpy(), alone[3].numpy())
    assert mixture.names == [f"{qa} (column question)", str(qa)]

    cursor, given = DataCursor(), np.zeros(2, dtype=np.int64)
    for step in range(3 * len(mixture) // config.global_batch):
        if step == 20:
            started = cursor  # the leg resumed from here
        indices, cursor = take_global_batch(cursor, len(mixture), config.global_batch, config.seed)
        if step >= 20:
            view = at_epoch(mixture, cursor.epoch)
            for index in indices.tolist():
                given[view.locate(index).source] += 1
    leg = SimpleNamespace(resume=SimpleNamespace(manifest=SimpleNamespace(cursor=asdict(started))),
                          history=SimpleNamespace(cursor=cursor))
    assert trainer._source_samples(leg) == dict(zip(mixture.names, given.tolist()))
    assert abs(given[0] / given.sum() - 0.7) < 0.01


def test_bad_data_is_refused_in_one_line_naming_the_file_and_row_before_anything_starts(tmp_path, tokenizer):
    good = [{"text": text} for text in DOCUMENTS[:50]]
    cases = {
        "malformed": (write_jsonl(tmp_path / "m.jsonl", good[:3]) and (tmp_path / "m.jsonl").open("a").write(
            "{not json\n") and str(tmp_path / "m.jsonl"), r"m.jsonl line 4: not a JSON object"),
        "no column": (write_jsonl(tmp_path / "c.jsonl", [{"body": "x"}]), r"c.jsonl line 1: no 'text' field "
                      r"\(it has \['body'\]\); set data.text_column"),
        "empty": (write_jsonl(tmp_path / "e.jsonl", []), r"e.jsonl holds no documents"),
        "not a number": (write_jsonl(tmp_path / "n.jsonl", [{"text": 5}]), r"n.jsonl line 1: column 'text' "
                         r"holds int, not text or a list of token ids"),
    }
    (tmp_path / "u.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    cases["not utf-8"] = (str(tmp_path / "u.jsonl"), r"u.jsonl line 1: the line is not UTF-8")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    cases["parquet column"] = (str(tmp_path / "p.parquet"), r"p.parquet: no column 'text' \(it has \['body'\]\)")
    for path, message in cases.values():
        refused_in_one_line({"path": path, "tokenizer": tokenizer}, message)
    # a tokenizer whose loading would run its own code
    remote = tmp_path / "remote-tokenizer"
    make_tokenizer(remote, DOCUMENTS[:100], VOCAB)
    settings = json.loads((remote / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (remote / "tokenizer_config.json").write_text(json.dumps(settings))
    (remote / "tokenization_evil.py").write_text("raise SystemExit('remote code ran')\n")
    with pytest.raises(ConfigError, match=r"^invalid config: data.tokenizer '.*remote-tokenizer': asks to run its "
                                          r"own code"):
        config_of({"path": write_jsonl(tmp_path / "ok.jsonl", good), "tokenizer": str(remote)})
    settings["tokenizer_class"] = "EvilTokenizer"  # and one that cannot load without it
    (remote / "tokenizer_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError, match=r"^invalid config: data.tokenizer '.*remote-tokenizer': cannot be loaded "
                                          r"without running its own code"):
        config_of({"path": str(tmp_path / "ok.jsonl"), "tokenizer": str(remote)})
    with pytest.raises(ConfigError, match=r"data.sources.0.weight"):
        config_of({"sources": [{"path": str(tmp_path / "ok.jsonl"), "weight": 0}]})
    with pytest.raises(ConfigError, match=r"format chat renders conversations with a tokenizer's chat template"):
        config_of({"path": str(tmp_path / "ok.jsonl"), "format": "chat"})
    with pytest.raises(ConfigError, match=r"validation_fraction splits one source, not a mixture"):
        config_of({"sources": [{"path": str(tmp_path / "ok.jsonl")}], "validation_fraction": 0.1})


def test_a_line_the_parser_or_the_tokenizer_cannot_take_is_refused_in_one_line_naming_it(tmp_path, tokenizer):
    good = "".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS[:3])
    (tmp_path / "deep.jsonl").write_text(good + "\n" + '{"text": ' + "[" * 100_000 + "\n")
    refused_in_one_line({"path": str(tmp_path / "deep.jsonl"), "tokenizer": tokenizer},
                        r"deep.jsonl line 5: the JSON nests deeper than Python's parser goes; flatten the line")
    # JSON's escape of half a UTF-16 pair: no character, which neither a tokenizer nor UTF-8 takes
    (tmp_path / "half.jsonl").write_text(good + '{"text": "a \\ud800 b"}\n')
    half = re.escape(r"half.jsonl line 4: the text holds '\ud800', half of a UTF-16 pair and no character")
    refused_in_one_line({"path": str(tmp_path / "half.jsonl"), "tokenizer": tokenizer}, half)
    refused_in_one_line({"path": str(tmp_path / "half.jsonl")}, half)
    conversation = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "\ud800"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": conversation}) + "\n")
    refused_in_one_line({"path": str(tmp_path / "chat.jsonl"), "format": "chat", "tokenizer": tokenizer},
                        re.escape(r"chat.jsonl line 1: the text holds '\ud800'"))


def test_a_document_is_named_by_its_jsonl_line_or_its_parquet_row_group_and_row(tmp_path, tokenizer):
    from elastic.data.documents import JsonlFile

    lines = [json.dumps({"text": text}) for text in DOCUMENTS[:5]]
    (tmp_path / "m.jsonl").write_text("\n".join(lines[:2]) + "\n\n\n" + "\n".join(lines[2:]) + "\n{not json\n")
    (tmp_path / "m.jsonl.gz").write_bytes(gzip.compress((tmp_path / "m.jsonl").read_bytes()))
    for name in ("m.jsonl", "m.jsonl.gz"):  # document 5, as an editor counts: line 8
        refused_in_one_line({"path": str(tmp_path / name), "tokenizer": tokenizer},
                            rf"{name} line 8: not a JSON object \(.*\); fix or drop the line")
    (tmp_path / "ok.jsonl").write_text("\n" + "\n".join(lines[:2]) + "\n\n\n" + "\n".join(lines[2:]) + "\n\n")
    scanned = JsonlFile(str(tmp_path / "ok.jsonl"), "text", max_document_bytes=2**20)
    assert sum(len(batch) for batch in scanned.scan()) == 5
    on_a_rank = pickle.loads(pickle.dumps(scanned))
    assert [on_a_rank.where(row) for row in range(5)] == [f"{tmp_path / 'ok.jsonl'} line {n}" for n in (2, 3, 6, 7, 8)]
    pq.write_table(pa.table({"text": [*DOCUMENTS[:23], None, *DOCUMENTS[23:30]]}), tmp_path / "p.parquet",
                   row_group_size=10)
    refused_in_one_line({"path": str(tmp_path / "p.parquet"), "tokenizer": tokenizer},
                        r"p.parquet row 23 \(row group 2, its row 3\): column 'text' is empty")


def test_token_ids_are_integers_from_zero_in_a_document_and_in_every_window(tmp_path):
    ids = [list(range(1, 40)) for _ in range(6)]
    cases = {"beyond int64": [2**70], "negative": [7, -5, 3], "true and false": [True, False]}
    for name, bad in cases.items():
        write_jsonl(tmp_path / "ids.jsonl", [{"ids": row} for row in ids] + [{"ids": bad}] + [{"ids": ids[0]}] * 6)
        refused_in_one_line({"path": str(tmp_path / "ids.jsonl"), "text_column": "ids"},
                            r"ids.jsonl line 7: column 'ids' holds " + {
                                "beyond int64": r"1180591620717411303424, which is no token id",
                                "negative": r"-5, which is no token id",
                                "true and false": r"true/false values, not token ids"}[name])
    pq.write_table(pa.table({"ids": pa.array([[2**64 - 1]], pa.list_(pa.uint64()))}), tmp_path / "ids.parquet")
    refused_in_one_line({"path": str(tmp_path / "ids.parquet"), "text_column": "ids"},
                        r"ids.parquet row 0 \(row group 0, its row 0\): column 'ids' holds 18446744073709551615")
    # a token stream: every window a rank reads, not only those the preflight samples
    sequences = [[(5 * i + j) % VOCAB for j in range(9)] for i in range(400)]
    sequences[2][3] = -3  # token 21, in sample 1: the preflight reads 64 samples of 224, not that one
    write_megatron_pair(tmp_path / "signed", sequences, "int16")
    dataset = train_set({"path": str(tmp_path / "signed")})
    with pytest.raises(DataError, match=r"^sample 1 holds token id -3 \(token 21 of .*signed.bin\), and no token id "
                                        r"is below 0"):
        dataset[1]


def test_a_megatron_index_that_claims_what_it_cannot_hold_is_refused_in_one_line(tmp_path):
    write_megatron_pair(tmp_path / "pair", [[i % VOCAB for i in range(3000)]] * 2)
    index = bytearray((tmp_path / "pair.idx").read_bytes())
    claims = bytearray(index)
    claims[18:26] = (2**61).to_bytes(8, "little")  # the header's count of sequences
    (tmp_path / "pair.idx").write_bytes(claims)
    refused_in_one_line({"path": str(tmp_path / "pair")}, r"pair.idx: the index is cut short \(\d+ of "
                                                          rf"{2**61} sequence lengths\)")
    index[34:42] = np.array([7000, -1000], dtype="<i4").tobytes()  # still 6000 tokens, as the .bin holds
    (tmp_path / "pair.idx").write_bytes(index)
    refused_in_one_line({"path": str(tmp_path / "pair")}, r"pair.idx: sequence 1's length is -1000, and no length is "
                                                          r"below 0: the index is damaged")


def test_a_damaged_parquet_file_or_save_to_disk_directory_is_refused_in_one_line_naming_the_file(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": DOCUMENTS[:400]}), tmp_path / "d.parquet", row_group_size=100)
    damaged = bytearray((tmp_path / "d.parquet").read_bytes())
    chunk = pq.ParquetFile(tmp_path / "d.parquet").metadata.row_group(1).column(0)
    page = chunk.dictionary_page_offset or chunk.data_page_offset
    damaged[page : page + 8] = bytes(b ^ 0x5A for b in damaged[page : page + 8])  # its first page's header
    (tmp_path / "d.parquet").write_bytes(damaged)
    refused_in_one_line({"path": str(tmp_path / "d.parquet"), "tokenizer": tokenizer},
                        r"d.parquet: row group 1 cannot be read \(.*\); the file is damaged: write it again$")
    saved = tmp_path / "saved"
    saved.mkdir()
    with pa.ipc.new_stream(saved / "data-00000-of-00001.arrow", pa.schema({"text": pa.string()})) as stream:
        stream.write_table(pa.table({"text": DOCUMENTS[:100]}))
    for files, message in (([], r"lists no data files \(its _data_files is empty\)"),
                           (["data-00000-of-00001.arrow"] * 3, r"lists data-00000-of-00001.arrow 3 times")):
        (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": name} for name in files]}))
        refused_in_one_line({"path": str(saved), "tokenizer": tokenizer}, rf"saved/state.json {message}")


def test_format_auto_is_the_files_a_directory_or_glob_matches_and_a_urls_path(tmp_path):
    from elastic.setup.config import parse_config
    from elastic.setup.dataset import source_format

    shards = tmp_path / "shards"
    shards.mkdir()
    for name, rows in (("a.jsonl", DOCUMENTS[:200]), ("b.jsonl", DOCUMENTS[200:400])):
        write_jsonl(shards / name, [{"text": text} for text in rows])
    (shards / "_SUCCESS").write_text("")  # a writer's marker, as pyarrow skips it
    stream = np.frombuffer("".join(text + "\n" for text in DOCUMENTS[:400]).encode(), dtype=np.uint8)
    for path in (shards, shards / "a.js*"):
        dataset = train_set({"path": str(path)})
        assert [file.url.rsplit("/", 1)[-1] for file in dataset.files] == ["a.jsonl", "b.jsonl"][: len(dataset.files)]
        np.testing.assert_array_equal(dataset[3].numpy(), stream[3 * SEQ_LEN : 4 * SEQ_LEN + 1], err_msg=str(path))
    (shards / "notes.txt").write_text("not a document\n")
    refused_in_one_line({"path": str(shards)}, r"shards holds jsonl \(.*a.jsonl\) and text \(.*notes.txt\); give "
                                               r"files of one format")
    signed = "https://bucket.s3.amazonaws.com/d/x.jsonl.gz?X-Amz-Credential=k&X-Amz-Signature=s"
    assert source_format(parse_config({"data": {"path": signed}}), signed) == "jsonl"


def test_lines_a_format_added_as_a_reader_and_one_registry_entry_trains_a_document_a_line(tmp_path, tokenizer):
    """``lines`` is ``elastic/data/text_lines.py`` and one entry of ``elastic/data/formats.py``:
    the config takes it, a line is a document (its end none of it, a blank line none at all),
    plain or compressed; auto still reads a ``.txt`` as text; a line not UTF-8 is refused in
    one line naming it."""
    documents = [*DOCUMENTS[:300], "un café ☕ à emporter"]
    text = "\n".join(documents[:100]) + "\n\n  \n" + "\r\n".join(documents[100:]) + "\n"
    (tmp_path / "d.txt").write_text(text)
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress(text.encode()))

    def expected(stream: np.ndarray) -> np.ndarray:
        return np.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range((len(stream) - 1) // SEQ_LEN)])

    raw = np.frombuffer("".join(document + "\n" for document in documents).encode(), dtype=np.uint8)
    for name in ("d.txt", "d.txt.gz"):
        dataset = pickle.loads(pickle.dumps(train_set({"path": str(tmp_path / name), "format": "lines"})))
        np.testing.assert_array_equal(windows(dataset), expected(raw), err_msg=name)
    packed = train_set({"path": str(tmp_path / "d.txt"), "format": "lines", "tokenizer": tokenizer})
    np.testing.assert_array_equal(windows(packed), expected(packed_stream(tokenizer, documents)))
    assert train_set({"path": str(tmp_path / "d.txt")})[0].tolist() == list(text.encode()[: SEQ_LEN + 1])
    (tmp_path / "bad.txt").write_bytes(b"fine\n\n\xff\xfe\n")
    refused_in_one_line({"path": str(tmp_path / "bad.txt"), "format": "lines"},
                        r"bad.txt line 3: the line is not UTF-8; re-encode the file as UTF-8")


def test_a_ray_dataset_of_no_rows_is_refused_in_one_line(tmp_path):
    from elastic.data.ray_dataset import materialize

    class NoRows:
        """What Ray's write_parquet leaves of a dataset of no rows: no file, and no directory
        (it removes the one it made)."""

        def write_parquet(self, path, filesystem):
            pass

    directory = str(tmp_path / "runs" / "r" / "data" / "train")
    with pytest.raises(DataError, match=rf"^{directory}: the Ray dataset given has no rows, so nothing was written to "
                                        r"train on; give a dataset with rows$"):
        materialize(NoRows(), directory, {})


def test_a_tokenizer_past_model_vocab_size_is_refused_at_preflight_and_an_unset_vocab_size_follows_it(tmp_path,
                                                                                                       tokenizer):
    data = {"path": write_jsonl(tmp_path / "d.jsonl", [{"text": text} for text in DOCUMENTS[:200]]),
            "tokenizer": tokenizer, "seq_len": SEQ_LEN}
    # refused before the data is read (it is not there): named by the tokenizer and the vocabulary, not data.path
    with pytest.raises(ConfigError, match=r"^invalid config: data.tokenizer '.*': has 300 tokens, more than "
                                          r"model.vocab_size 256: .*; set model.vocab_size = 320 \(at least 300\), "
                                          r"or leave it unset to take the tokenizer's$"):
        build_config({"data": {**data, "path": str(tmp_path / "missing.jsonl")}, "model": {"vocab_size": 256}})
    with pytest.raises(ConfigError, match=r"^invalid config: data.tokenizer .* set model.vocab_size = 320 \(at least "
                                          r"300\) over model.preset tiny's$"):
        build_config({"data": data, "model": {"preset": "tiny"}})
    followed = build_config({"data": data})
    assert followed.model.vocab_size == 320  # a multiple of 64: any power-of-two scaling.tp divides it
    assert int(max(default_datasets(followed, followed.model.vocab_size)[0][0])) < 320
    assert build_config({"data": data, "scaling": {"tp": 2}, "model": {"vocab_size": 512}}).model.vocab_size == 512


def test_a_tokenizer_that_is_not_there_is_refused_at_once_naming_data_tokenizer(tmp_path, monkeypatch):
    import socket
    import time

    from huggingface_hub import constants

    from elastic.data.tokenizing import hub_unreachable

    data = {"path": write_jsonl(tmp_path / "d.jsonl", [{"text": "the cat"}] * 40)}
    with pytest.raises(ConfigError, match=r"^invalid config: data.tokenizer '.*nowhere': the directory does not "
                                          r"exist; give the directory a tokenizer was saved in"):
        config_of({**data, "tokenizer": str(tmp_path / "nowhere")})
    # A Hub id on a host where the Hub does not answer: read from the local cache alone, not retried for a minute.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for variable in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                     "all_proxy"):
        monkeypatch.delenv(variable, raising=False)
    hub_unreachable.cache_clear()
    began = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"^invalid config: data.tokenizer 'elastic-tests/no-such-tokenizer': no "
                                              r"such directory, and the Hub id was not found in the local Hub cache "
                                              r"\(.*\), the Hub being out of reach \(127.0.0.1:\d+: Connection "
                                              r"refused\); download it"):
            config_of({**data, "tokenizer": "elastic-tests/no-such-tokenizer"})
    finally:
        hub_unreachable.cache_clear()
        closed.close()
    assert time.monotonic() - began < 10


def tokenizer_with_template(directory, tokenizer: str, template: str) -> str:
    import shutil

    shutil.copytree(tokenizer, directory)
    (directory / "chat_template.jinja").write_text(template)
    return str(directory)


# The test tokenizer's template, with an assistant's tool calls rendered after its content
TOOLS_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}{{ call.function.name }}({{ call.function.arguments | tojson }})"
    "{% endfor %}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_a_text_the_tokenizer_cannot_take_is_refused_naming_its_document(tmp_path, tokenizer):
    """Half of a UTF-16 pair (JSON's lone "\ud800") fails the tokenizer's whole batch with a
    TypeError: refused naming the document, wherever the text comes from (the files' readers
    refuse it in a text too, by their line)."""
    from elastic.data.tokenizing import tokenizer_for

    encoder = tokenizer_for(tokenizer, max_document_bytes=2**20, chat_template_timeout_s=10)
    with pytest.raises(ConfigError, match=r"^d.jsonl line 8: the text holds '\\ud800', half of a UTF-16 pair"):
        encoder.encode(["the cat", "a \ud800 b"], lambda row: f"d.jsonl line {row + 1}", 6)
    # in a tool call, which the template renders into the text the tokenizer takes
    tools = tokenizer_with_template(tmp_path / "tools", tokenizer, TOOLS_TEMPLATE)
    call = {"type": "function", "function": {"name": "find", "arguments": {"q": "\ud800"}}}
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "where"},
                                                            {"role": "assistant", "content": "", "tool_calls": [call]}]}])
    refused_in_one_line({"path": chat, "format": "chat", "tokenizer": tools},
                        r"c\.jsonl line 1: the text holds '\\ud800', half of a UTF-16 pair")


def test_chat_tool_calls_train_where_the_template_renders_them_and_are_refused_where_it_does_not(tmp_path,
                                                                                                 tokenizer):
    from transformers import AutoTokenizer

    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    rows = [{"messages": [{"role": "user", "content": "the cat sees"},
                          {"role": "assistant", "content": "", "tool_calls": [call]}]}] * 12
    path = write_jsonl(tmp_path / "tools.jsonl", rows)
    refused_in_one_line({"path": path, "format": "chat", "tokenizer": tokenizer},
                        r"tools\.jsonl line 1: message 1's tool_calls are not in what the chat template of "
                        r"data.tokenizer '.*' renders, so its turn would train without them")
    tools = tokenizer_with_template(tmp_path / "tools", tokenizer, TOOLS_TEMPLATE)
    dataset = train_set({"path": path, "format": "chat", "tokenizer": tools})
    trained = [token for index in range(len(dataset)) for token, label in
               zip(dataset[index]["input_ids"][1:].tolist(), dataset[index]["labels"][1:].tolist())
               if label != IGNORE_INDEX]
    turn = 'weather({"city": "Paris"})</s>'  # the assistant's content is the call alone
    assert AutoTokenizer.from_pretrained(tools).decode(trained).startswith(turn * 2)


def test_chat_windows_without_an_assistant_token_are_counted_and_refused_when_all_are(tmp_path, tokenizer, caplog):
    from transformers import AutoTokenizer

    prompts = [" ".join(DOCUMENTS[i : i + 1 + i % 4]) for i in range(24)]  # some longer than a window
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": prompt, "completion": "a dog"} for prompt in prompts])
    with caplog.at_level("WARNING", logger="elastic.data.packing"):
        dataset = train_set({"path": path, "format": "chat", "tokenizer": tokenizer})
    untrained = sum(bool((dataset[i]["labels"][1:] == IGNORE_INDEX).all()) for i in range(len(dataset)))
    assert 0 < untrained < len(dataset)
    assert f"{untrained} of the {len(dataset)} windows of file://{path} (data.seq_len {SEQ_LEN} tokens) hold no " \
           "assistant token to train on" in caplog.text
    # one conversation whose answer lies past the last whole window: no window to train on
    hf = AutoTokenizer.from_pretrained(tokenizer)
    prompt = " ".join(DOCUMENTS[:3])
    seq_len = len(hf(prompt, add_special_tokens=False)["input_ids"]) - 1
    lone = write_jsonl(tmp_path / "lone.jsonl", [{"prompt": prompt, "completion": "a dog"}])
    refused_in_one_line({"path": lone, "format": "chat", "tokenizer": tokenizer, "seq_len": seq_len},
                        rf"lone\.jsonl: none of its 1 windows of data.seq_len {seq_len} tokens holds an assistant "
                        r"token to train on \(the prompts fill them\), so every step would train on nothing")


def test_a_mixture_on_s3_and_local_disk_reads_by_range(tmp_path, tokenizer, s3_server):
    pq.write_table(pa.table({"text": DOCUMENTS[:200]}), tmp_path / "a.parquet", row_group_size=40)
    s3_server.filesystem().put(str(tmp_path / "a.parquet"), f"{s3_server.bucket}/shards/a.parquet")
    jsonl = write_jsonl(tmp_path / "b.jsonl", [{"text": text} for text in DOCUMENTS[200:500]])
    config = config_of({"sources": [{"path": s3_server.url("shards", "*.parquet"), "weight": 2},
                                    {"path": jsonl}], "tokenizer": tokenizer},
                       checkpoint={"s3_endpoint_url": s3_server.endpoint_url})
    mixture = pickle.loads(pickle.dumps(default_datasets(config, VOCAB)[0]))
    local = train_set({"path": str(tmp_path / "a.parquet"), "tokenizer": tokenizer})
    source, _, sample = mixture.locate(0)
    assert source == 0
    np.testing.assert_array_equal(mixture[0].numpy(), local[sample].numpy())
    assert any(key.startswith("s3://") for key in mixture.identity())


def conversations(count: int) -> list[dict]:
    rows = []
    for i in range(count):
        turns = [{"role": "user", "content": DOCUMENTS[3 * i]}, {"role": "assistant", "content": DOCUMENTS[3 * i + 1]}]
        if i % 3 == 0:
            turns = [{"role": "system", "content": "answer in one sentence"}, *turns,
                     {"role": "user", "content": "and then"}, {"role": "assistant", "content": DOCUMENTS[3 * i + 2]}]
        rows.append({"messages": turns} if i % 4 else {"prompt": DOCUMENTS[3 * i], "completion": DOCUMENTS[3 * i + 1]})
    return rows


def test_a_chat_run_at_two_groups_of_shard_two_starts_at_transformers_own_masked_loss(ray_cluster, tmp_path, tokenizer):
    """A tiny HuggingFace Llama and chat JSONL: the first step's loss, over 2 groups x shard 2,
    is transformers' own on the same batch with every non-assistant label -100."""
    import torch
    import transformers

    from elastic.core.data_plan import epoch_order
    from elastic.trainer import ElasticTrainer
    from tests.tiny import tiny_config

    torch.manual_seed(11)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    llama.save_pretrained(tmp_path / "llama")
    chat = write_jsonl(tmp_path / "chat.jsonl", conversations(120))
    config = tiny_config(tmp_path, groups=2, shard=2, steps=1, model__init_from=str(tmp_path / "llama"),
                         data__path=chat, data__format="chat", data__tokenizer=tokenizer)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit

    dataset = default_datasets(config, VOCAB)[0]
    batch = [dataset[int(i)] for i in epoch_order(len(dataset), config.seed, 0)[: config.global_batch]]
    ids, labels = (torch.stack([sample[key] for sample in batch]) for key in ("input_ids", "labels"))
    assert 0 < int((labels[:, 1:] != IGNORE_INDEX).sum()) < labels[:, 1:].numel()  # the prompts are masked
    with torch.no_grad():
        expected = llama(input_ids=ids, labels=labels).loss.item()
    assert abs(result.losses[0] - expected) <= 1e-4 * expected


def test_a_resume_over_other_sources_or_weights_is_refused_before_ray_naming_the_flag_which_starts_the_data_over(
        tmp_path, tokenizer, monkeypatch):
    """The run's checkpoint records its data settings and files. A resume with another weight,
    or a source's other column (its files the same), is refused in one line before Ray starts,
    naming --accept-changed-data; with the flag, the model resumes and the data starts over from
    its first epoch, where every source starts a pass."""
    import hashlib

    import elastic.trainer
    from elastic.outputs.report import load_summary
    from elastic.setup.resume_checks import config_record
    from elastic.trainer import ElasticTrainer
    from tests.test_catalog import METADATA
    from tests.tiny import tiny_config

    class RayStarted(Exception):
        pass

    def connect_ray():
        raise RayStarted()

    monkeypatch.setattr(elastic.trainer, "connect_ray", connect_ray)
    pq.write_table(pa.table({"text": DOCUMENTS[:300], "title": DOCUMENTS[300:600]}), tmp_path / "a.parquet",
                   row_group_size=50)
    jsonl = write_jsonl(tmp_path / "b.jsonl", [{"text": text} for text in DOCUMENTS[300:600]])

    def trainer(weight: float, column: str | None = None, **settings) -> ElasticTrainer:
        source = {"path": str(tmp_path / "a.parquet"), "weight": weight} | ({"text_column": column} if column else {})
        config = tiny_config(tmp_path, data__sources=[source, {"path": jsonl}], data__tokenizer=tokenizer,
                             model__vocab_size=VOCAB, **settings)
        return ElasticTrainer(config, model_fn=lambda: None)

    first = trainer(2.0)
    catalog = first._catalog()
    directory = tmp_path / "runs" / "test" / "checkpoints" / "step-00000004"
    directory.mkdir(parents=True)
    files = {}
    for name, payload in ((".metadata", METADATA), ("__0_0.distcp", b"state")):
        (directory / name).write_bytes(payload)
        files[name] = (len(payload), hashlib.sha256(payload).hexdigest())
    record = config_record(first.config)
    for source in record["data"]["sources"]:  # as a run recorded it before a source had a column of its own
        del source["text_column"]
    catalog.commit(4, {"epoch": 1, "position": 16}, {"shard": 1, "tp": 1}, "h", files, {}, config=record,
                   data=first.data_identity)
    with pytest.raises(RayStarted):  # the same data: on to Ray
        first.fit()
    for (weight, column), refused in (((1.0, None), r"data.sources: .*a.parquet x2; .*b.jsonl x1 -> .*a.parquet "
                                                    r"x1; .*b.jsonl x1; data.sources.0.weight: 2.0 -> 1.0; "),
                                      ((2.0, "title"), r".*; data.sources.0.text_column: absent -> title; ")):
        changed = trainer(weight, column)
        with pytest.raises(ConfigError, match=rf"^run 'test' resumes from step 4, but its data changed since: "
                                              rf"{refused}.*pass --accept-changed-data \(checkpoint.accept_changed_"
                                              r"data = true\) to resume the model and start the data over") as raised:
            changed.fit()
        assert "\n" not in str(raised.value)
    with pytest.raises(RayStarted):
        trainer(1.0, checkpoint__accept_changed_data=True).fit()
    [event] = [event for event in load_summary(first.run_dir).events if event["kind"] == "data-changed"]
    assert event["cursor"] == {"epoch": 0, "position": 0} and "data.sources.0.weight" in event["files"]


def test_a_ray_dataset_is_written_once_and_trains_as_that_parquet_would(ray_cluster, tmp_path, tokenizer):
    """A ``ray.data.Dataset`` given to the API: written once as Parquet into the run's
    storage, read from there by every leg (a resume writes nothing), with the losses of one
    process trained on that Parquet as its data.path."""
    import ray

    from elastic.testing.losses import max_relative_difference
    from elastic.trainer import ElasticTrainer
    from tests.reference import reference_run
    from tests.tiny import tiny_config

    rows = ray.data.from_items([{"text": text} for text in DOCUMENTS[:400]]).repartition(3)
    settings = {"data__tokenizer": tokenizer, "model__vocab_size": VOCAB, "checkpoint__every": 2}
    first = ElasticTrainer(tiny_config(tmp_path, steps=2, run_name="from-ray", **settings), dataset=rows).fit()
    assert first.ok, first.exit
    written = tmp_path / "runs" / "from-ray" / "data" / "train"
    files = sorted(written.glob("*.parquet"))
    assert len(files) == 3 and (written / "_COMPLETE").exists()
    assert sorted(text for file in files for text in pq.read_table(file).column("text").to_pylist()) == \
        sorted(DOCUMENTS[:400])
    stamps = [file.stat().st_mtime_ns for file in files]
    resumed = ElasticTrainer(tiny_config(tmp_path, steps=4, run_name="from-ray", **settings), dataset=rows).fit()
    assert resumed.ok, resumed.exit
    assert [file.stat().st_mtime_ns for file in sorted(written.glob("*.parquet"))] == stamps

    losses, _ = reference_run(tiny_config(tmp_path, steps=4, run_name="from-parquet",
                                          data__path=str(written / "*.parquet"), **settings), 4)
    assert max_relative_difference(first.losses + resumed.losses, losses) <= 1e-5


def pieces_alone_loss(logits_of, sample: dict) -> tuple[float, int]:
    """The summed loss of a packed window's targets, each from the logits of its document's
    piece of the window run alone (no other document before it), and how many targets."""
    import torch

    ids, positions = sample["input_ids"], sample["positions"]
    targets = ids[1:]
    starts = [*torch.nonzero(positions[:-1] == 0).flatten().tolist(), len(targets)]
    total = 0.0
    for begin, end in zip(starts, starts[1:]):
        with torch.no_grad():
            logits = logits_of(ids[begin:end][None])[0]
        total += torch.nn.functional.cross_entropy(logits.float(), targets[begin:end], reduction="sum").item()
    return total, len(targets)


def test_packed_documents_with_masking_train_as_each_document_alone(tmp_path, tokenizer):
    import torch

    from workers.model import ModelArgs, Transformer
    from workers.train_step import collate

    lengths = [3, 40, 1, 7, 90, 12, 5, 33, 2, 60]  # sentences a document: shorter and longer than a window
    texts, at = [], 0
    for n in lengths * 3:
        texts.append(". ".join(DOCUMENTS[at : at + n]))
        at += n
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": text} for text in texts])
    masked = train_set({"path": path, "tokenizer": tokenizer, "document_masking": True, "seq_len": 64})
    plain = train_set({"path": path, "tokenizer": tokenizer, "seq_len": 64})
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                  max_seq_len=64)).eval()
    indices = list(range(min(len(masked), 12)))
    assert any((masked[i]["positions"][1:] == 0).any() for i in indices)  # windows that hold several documents
    batch = collate(masked, indices, torch.device("cpu"))
    with torch.no_grad():
        logits = model(batch.inputs, positions=batch.positions)
    packed = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum").item()
    alone = sum(pieces_alone_loss(model, masked[i])[0] for i in indices)
    assert abs(packed - alone) <= 1e-5 * alone
    unmasked = collate(plain, indices, torch.device("cpu"))
    assert torch.equal(unmasked.inputs, batch.inputs) and unmasked.positions is None
    with torch.no_grad():
        seen = torch.nn.functional.cross_entropy(model(unmasked.inputs).flatten(0, 1), unmasked.targets.flatten(),
                                                 reduction="sum").item()
    assert abs(seen - alone) > 10 * 1e-5 * alone  # without the mask, documents see each other: ten times the tolerance


def test_document_masking_is_refused_where_it_cannot_hold(tmp_path, tokenizer):
    from elastic.trainer import ElasticTrainer
    from tests.tiny import tiny_config

    path = write_jsonl(tmp_path / "d.jsonl", [{"text": text} for text in DOCUMENTS[:200]])
    with pytest.raises(ConfigError, match=r"scaling.pp > 1 with data.document_masking: .*set scaling.pp = 1"):
        tiny_config(tmp_path, scaling__pp=2, micro_batch=1, model__n_layers=2, data__path=path, data__tokenizer=tokenizer,
                    data__document_masking=True)
    (tmp_path / "t.txt").write_text("text " * 500)
    with pytest.raises(ConfigError, match=r"data.document_masking needs documents .* is text"):
        tiny_config(tmp_path, data__path=str(tmp_path / "t.txt"), data__document_masking=True)
    config = tiny_config(tmp_path, data__path=path, data__tokenizer=tokenizer, data__document_masking=True,
                         model__vocab_size=VOCAB)
    with pytest.raises(ConfigError, match=r"data.document_masking: only the reference model"):
        ElasticTrainer(config, model_fn=lambda: torch_linear())


def torch_linear():
    import torch

    return torch.nn.Linear(2, 2)


def test_a_masked_run_at_cp_two_by_tp_two_starts_at_transformers_loss_of_each_document_alone(
        ray_cluster, tmp_path, tokenizer):
    """The reference model from a tiny HuggingFace Llama, packed documents with masking, at
    cp 2 x tp 2 with sequence parallelism (each cp rank's chunks of the documents, the mask
    built from the positions gathered from both, crossing the TP plan's input layouts): the
    first step's loss is the sum, over the batch's targets, of transformers' own losses of
    each document's piece run alone."""
    import torch
    import transformers

    from elastic.core.data_plan import epoch_order
    from elastic.trainer import ElasticTrainer
    from tests.tiny import tiny_config

    torch.manual_seed(13)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    llama.save_pretrained(tmp_path / "llama")
    texts = [". ".join(DOCUMENTS[i : i + 1 + i % 9]) for i in range(0, 1200, 5)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": text} for text in texts])
    config = tiny_config(tmp_path, tp=2, scaling__cp=2, steps=1, model__init_from=str(tmp_path / "llama"),
                         data__path=path, data__tokenizer=tokenizer, data__document_masking=True,
                         scaling__sequence_parallel=True)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit

    dataset = default_datasets(config, VOCAB)[0]
    total, count = 0.0, 0
    for index in epoch_order(len(dataset), config.seed, 0)[: config.global_batch]:
        loss, targets = pieces_alone_loss(lambda ids: llama(ids).logits, dataset[int(index)])
        total, count = total + loss, count + targets
    assert abs(result.losses[0] - total / count) <= 1e-4 * total / count


def test_a_named_runs_data_index_is_kept_with_the_run_and_read_back_by_its_next_leg(tmp_path, tokenizer, monkeypatch):
    from elastic.data import packing
    from elastic.data.documents import JsonlFile, ParquetFile

    pq.write_table(pa.table({"text": DOCUMENTS[:300]}), tmp_path / "a.parquet", row_group_size=50)
    jsonl = write_jsonl(tmp_path / "b.jsonl", [{"text": text} for text in DOCUMENTS[300:600]])
    values = {"sources": [{"path": str(tmp_path / "a.parquet")}, {"path": jsonl}], "tokenizer": tokenizer}
    settings = {"storage": str(tmp_path / "runs"), "run_name": "kept"}
    first = train_set(values, **settings)
    [kept, kept_too] = sorted((tmp_path / "runs" / "kept" / "data" / "index").glob("*.npz"))
    packing._BUILT.clear()  # a new leg is a new process

    def no_scan(self):
        raise AssertionError("the data was scanned again")

    monkeypatch.setattr(JsonlFile, "scan", no_scan)
    monkeypatch.setattr(ParquetFile, "scan", no_scan)
    again = pickle.loads(pickle.dumps(train_set(values, **settings)))
    assert len(again) == len(first) and all(np.array_equal(again[i].numpy(), first[i].numpy())
                                            for i in range(0, len(first), 9))
    packing._BUILT.clear()
    (tmp_path / "b.jsonl").write_text((tmp_path / "b.jsonl").read_text() + json.dumps({"text": "more"}) + "\n")
    with pytest.raises(AssertionError, match="scanned again"):  # other data: another index, built anew
        train_set(values, **settings)


def test_a_data_index_cut_short_is_made_again_from_the_data_and_kept_whole(tmp_path, caplog):
    from elastic.data import packing

    values = {"path": write_jsonl(tmp_path / "b.jsonl", [{"text": text} for text in DOCUMENTS[:300]])}
    settings = {"storage": str(tmp_path / "runs"), "run_name": "kept"}
    first = train_set(values, **settings)
    [kept] = (tmp_path / "runs" / "kept" / "data" / "index").glob("*.npz")
    kept.write_bytes(kept.read_bytes()[: kept.stat().st_size // 2])  # as a full disk leaves it
    packing._BUILT.clear()  # a new leg is a new process
    with caplog.at_level(logging.WARNING, logger="elastic.data.packing"):
        again = train_set(values, **settings)
    assert [record.getMessage() for record in caplog.records] == [
        f"the data index {kept} cannot be read (File is not a zip file): made again from the data"]
    assert len(again) == len(first) and np.array_equal(again[7].numpy(), first[7].numpy())
    with np.load(kept) as whole:
        np.testing.assert_array_equal(whole["0.lengths"], again.lengths[0])

"""What data can make a rank compute or hold: a document over data.max_document_bytes and a
chat template past its deadline or size are refused in one line naming the file and the
row, before they are read whole or tokenized; a long document is tokenized once a rank, not
once for each of its windows."""

from __future__ import annotations

import gzip
import json
import pickle
import re
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from elastic.core.data_plan import epoch_order  # noqa: E402
from elastic.data import packing  # noqa: E402
from elastic.data.chat_template import ChatTemplate  # noqa: E402
from elastic.data.documents import DataError, JsonlFile, ParquetFile  # noqa: E402
from elastic.setup.dataset import default_datasets, generate_corpus  # noqa: E402
from elastic.setup.errors import ConfigError  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402
from elastic.testing.tokenizer import make_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 16
VOCAB = 300
LIMIT = 2**20  # data.max_document_bytes in these tests
DOCUMENTS = generate_corpus(40_000, 3).decode().split(". ")
CONVERSATION = [{"role": "user", "content": "the cat sees"}, {"role": "assistant", "content": "a dog"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return str(make_tokenizer(tmp_path_factory.mktemp("tokenizer"), DOCUMENTS, VOCAB))


def config_of(data: dict):
    return build_config({"data": {"seq_len": SEQ_LEN, **data}, "model": {"vocab_size": VOCAB}})


def with_template(tokenizer: str, directory: Path, template: str) -> str:
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer)
    loaded.chat_template = template
    loaded.save_pretrained(directory)
    return str(directory)


def write_line_of(path: Path, text_bytes: int) -> None:
    """One JSONL document of ``text_bytes`` bytes, written (and compressed) a MiB at a time,
    so that the test itself never holds it."""
    chunk = b"a" * 2**20
    if path.name.endswith(".zst"):
        import zstandard

        sink = zstandard.ZstdCompressor().stream_writer(path.open("wb"))
    else:
        sink = gzip.open(path, "wb") if path.name.endswith(".gz") else path.open("wb")
    with sink:
        sink.write(b'{"text": "')
        for _ in range(text_bytes // len(chunk)):
            sink.write(chunk)
        sink.write(b'"}\n')


@pytest.mark.parametrize("name", ["d.jsonl", "d.jsonl.gz", "d.jsonl.zst"])
def test_a_jsonl_line_over_the_limit_is_refused_before_it_is_read_whole(tmp_path, name):
    pytest.importorskip("zstandard")
    path = tmp_path / name
    write_line_of(path, 64 * LIMIT)  # 64 MiB, a few hundred bytes compressed
    with pytest.raises(ConfigError, match=rf"{name} line 1: the line holds at least {LIMIT + 1} bytes, over "
                                          rf"data.max_document_bytes \({LIMIT}\); split it") as refused:
        config_of({"path": str(path), "max_document_bytes": LIMIT})
    assert "\n" not in str(refused.value)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="the line holds at least"):
            list(JsonlFile(str(path), "text", max_document_bytes=LIMIT).scan())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * LIMIT, f"held {peak} bytes reading a line refused at {LIMIT}"


def test_a_parquet_document_over_the_limit_is_refused_before_python_holds_it(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": ["short", "a" * (8 * LIMIT)]}), tmp_path / "p.parquet")
    assert (tmp_path / "p.parquet").stat().st_size < LIMIT  # compressed: the file says nothing of its documents
    with pytest.raises(ConfigError, match=rf"p.parquet row 1 \(row group 0, its row 1\): the document holds "
                                          rf"{8 * LIMIT} bytes, over data.max_document_bytes \({LIMIT}\)"):
        config_of({"path": str(tmp_path / "p.parquet"), "tokenizer": tokenizer, "max_document_bytes": LIMIT})
    tracemalloc.start()  # Arrow's memory is its own: what Python holds is traced
    try:
        with pytest.raises(DataError, match="the document holds"):
            list(ParquetFile(str(tmp_path / "p.parquet"), "text", max_document_bytes=LIMIT).scan())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * LIMIT, f"Python held {peak} bytes of a document refused at {LIMIT}"
    pq.write_table(pa.table({"ids": [list(range(LIMIT // 8 + 1))]}), tmp_path / "ids.parquet")
    with pytest.raises(ConfigError, match=rf"ids.parquet row 0 \(row group 0, its row 0\): the document holds "
                                          rf"{LIMIT + 8} bytes"):
        config_of({"path": str(tmp_path / "ids.parquet"), "text_column": "ids", "max_document_bytes": LIMIT})
    long_turn = [CONVERSATION[0], {"role": "assistant", "content": "a" * LIMIT}]
    pq.write_table(pa.table({"messages": [CONVERSATION, long_turn]}), tmp_path / "chat.parquet")
    with pytest.raises(ConfigError, match=rf"chat.parquet row 1 \(row group 0, its row 1\): the conversation's "
                                          rf"text holds {LIMIT + 12} bytes, over data.max_document_bytes \({LIMIT}\)"):
        config_of({"path": str(tmp_path / "chat.parquet"), "format": "chat", "tokenizer": tokenizer,
                   "max_document_bytes": LIMIT})


def test_the_bounded_chat_template_renders_as_transformers_renders_it():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{{ bos_token }}{% set ns = namespace(turns=0) %}{% macro tag(role) %}<|{{ role }}|>{% endmacro %}"
        "{% for message in messages %}{% set ns.turns = ns.turns + 1 %}{{ tag(message['role']) }}"
        "{{ message.content | trim }}{% if loop.last %} ({{ loop.length }} of {{ ns.turns }}){% endif %}"
        "{% generation %}{{ eos_token }}{% endgeneration %}{% endfor %}{{ messages | map(attribute='role') | list }}"
        "{% set tail %}{{ '%s-%d' % ('x', 2 ** 3) }}{% endset %}{{ tail ~ ('-' * 3) }}{{ {'k': [1, (2, 3)]} | tojson }}"
        "{% filter upper %}done{% endfilter %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    variables = {"bos_token": "<s>", "eos_token": "</s>"}
    for prompt in (False, True):
        ours = ChatTemplate(template, LIMIT, 10.0).render(CONVERSATION, prompt, variables)
        theirs = render_jinja_template([CONVERSATION], chat_template=template, add_generation_prompt=prompt,
                                       **variables)[0][0]
        assert ours == theirs


REFUSED = """
import sys
from elastic.setup.errors import ConfigError
from elastic.setup.preflight import build_config
try:
    build_config({"data": {"path": sys.argv[1], "format": "chat", "tokenizer": sys.argv[2], "seq_len": 16,
                           "chat_template_timeout_s": float(sys.argv[3])}, "model": {"vocab_size": 300}})
except ConfigError as error:
    print(error)
"""


# The deadline case cannot render in its 0.5 s; the size cases are refused in a fraction of a
# second, far within their 60 s on a loaded host.
@pytest.mark.parametrize("template, timeout_s, refusal", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}{% endfor %}{% endfor %}"
     "{% endfor %}", 0.5, r"the chat template takes over 0.5 s to render this conversation, more than "
                     r"data.chat_template_timeout_s allows"),
    ("{{ 'a' * 1000000000 }}", 60, r"the chat template makes a value of 1000000000 characters rendering this "
                               r"conversation, over data.max_document_bytes \(67108864\)"),
    ("{% set ns = namespace(text='a') %}{% for i in range(64) %}{% set ns.text = ns.text ~ ns.text %}{% endfor %}"
     "{{ ns.text }}", 60, r"the chat template makes a value of 134217728 characters"),
    ("{% set ns = namespace(tree=[1]) %}{% for i in range(64) %}{% set ns.tree = [ns.tree, ns.tree] %}{% endfor %}"
     "{{ ns.tree }}", 60, r"the chat template makes a value of \d+ characters"),
], ids=["nested-loops", "repetition", "doubling-text", "doubling-list"])
def test_a_chat_template_past_its_deadline_or_size_is_refused_in_one_line(tmp_path, tokenizer, template, timeout_s,
                                                                          refusal):
    bounded = with_template(tokenizer, tmp_path / "tokenizer", template)
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    # unbounded, each of these runs for hours, or aborts the process in the tokenizer
    completed = subprocess.run([sys.executable, "-c", REFUSED, str(data), bounded, str(timeout_s)], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.count("\n") == 1, completed.stdout
    assert f"{data} line 1: " in completed.stdout
    assert re.search(refusal, completed.stdout), completed.stdout


def test_a_long_documents_windows_tokenize_it_once_on_a_rank(tmp_path, tokenizer, monkeypatch):
    long = " ".join(DOCUMENTS[:400])  # some 40 windows
    documents = [*DOCUMENTS[400:420], long, *DOCUMENTS[420:440]]
    pq.write_table(pa.table({"text": documents}), tmp_path / "d.parquet", row_group_size=8)
    dataset = default_datasets(config_of({"path": str(tmp_path / "d.parquet"), "tokenizer": tokenizer}), VOCAB)[0]
    expected = [dataset[i].numpy() for i in range(len(dataset))]
    assert sum(len(w) for w in expected) > 40 * SEQ_LEN

    def read_as_a_rank():
        rank = pickle.loads(pickle.dumps(dataset))  # no caches travel
        encoded = []
        encode = rank.tokenizer.encode
        rank.tokenizer.encode = lambda batch, *where: encoded.extend(batch) or encode(batch, *where)
        order = epoch_order(len(rank), 0, 0)
        for index in order:
            np.testing.assert_array_equal(rank[int(index)].numpy(), expected[int(index)])
        return rank, encoded

    rank, encoded = read_as_a_rank()
    assert encoded.count(long) == 1
    assert sorted(encoded) == sorted(documents)  # every document once, across all of its windows
    assert rank._tokens.held <= packing._CACHED_TOKEN_BYTES
    # a cache smaller than the long document's tokens: it is tokenized again, windows unchanged
    monkeypatch.setattr(packing, "_CACHED_TOKEN_BYTES", 2 * SEQ_LEN)
    rank, encoded = read_as_a_rank()
    assert encoded.count(long) > 1 and rank._tokens.held <= 2 * SEQ_LEN



def test_a_jsonl_file_in_s3_is_read_line_by_line_as_a_local_one_and_bounded_alike(tmp_path, s3_server):
    """A remote file is fsspec's buffered file, whose ``readline`` takes no limit: the scan
    reads its lines through a buffer that does."""
    from checkpointing.storage import StorageOptions

    def both(name: str, rows: list[dict]) -> tuple[JsonlFile, JsonlFile]:
        (tmp_path / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
        s3_server.filesystem().pipe(f"{s3_server.bucket}/data/{name}", (tmp_path / name).read_bytes())
        url = s3_server.url("data", name)
        options = StorageOptions(endpoint_url=s3_server.endpoint_url).for_url(url)
        return (JsonlFile(str(tmp_path / name), "text", max_document_bytes=LIMIT),
                JsonlFile(url, "text", storage_options=options, max_document_bytes=LIMIT))

    local, remote = both("d.jsonl", [{"text": text} for text in DOCUMENTS[:50]])
    assert [d for batch in remote.scan() for d in batch] == [d for batch in local.scan() for d in batch]
    np.testing.assert_array_equal(remote.spans, local.spans)
    assert remote.read(10, 13) == DOCUMENTS[10:13]
    _, remote = both("long.jsonl", [{"text": "short"}, {"text": "a" * (8 * LIMIT)}])
    with pytest.raises(DataError, match=rf"long.jsonl line 2: the line holds at least {LIMIT + 1} bytes"):
        list(remote.scan())

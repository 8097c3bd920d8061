"""A file's documents, by row: Parquet and HuggingFace Arrow files through pyarrow, JSONL
(plain, ``.gz`` or ``.zst``) line by line.

A document is a text (from ``data.text_column``), a list of token ids (a column of them,
read as it is), or a conversation (``chat``: a row's ``messages``, or its ``prompt`` and
``completion``). Each reader counts its rows once, on the driver (``scan``), and then reads
any range of them on a rank (``read``) without reading the rest: a Parquet file by row
group, a plain JSONL file by the byte ranges of its lines, an Arrow file memory-mapped. A
compressed JSONL file cannot be entered in the middle: a rank decompresses it whole, the
first time it reads from it.

Nothing here executes what it reads: JSON is parsed, Arrow and Parquet are columns.
"""

from __future__ import annotations

import bisect
import gzip
import io
import json
import re
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from checkpointing.storage import regular_file
from elastic.data.recipe import Recipe
from elastic.setup.errors import ConfigError

# Row groups, decompressed files and Arrow tables a reader keeps, least recently used dropped first.
_CACHED_BLOCKS = 4

# Rows a scan reads at once: the index is built a batch at a time, never a file in memory.
SCAN_ROWS = 8192

# Half of a UTF-16 pair: JSON's "\ud800" escape makes one in a Python string, which is no
# character, has no UTF-8, and no tokenizer takes.
_SURROGATE = re.compile("[\ud800-\udfff]")


class DataError(ConfigError):
    """The data itself is wrong, not the storage it is read from: every read of it fails the
    same way, so no retry or fresh process helps (a rank reports it as ``own-data``). Bad
    input: found before the run starts, it is refused as any ``ConfigError`` is."""


def url_name(url: str) -> str:
    """``url`` without its query string: a presigned URL's signature (``x.jsonl?X-Amz-...``)
    says nothing of what the file is."""
    return url.split("?", 1)[0] if "://" in url else url


@contextmanager
def arrow_reading(url: str, what: str, fix: str) -> Iterator[None]:
    """Reading ``url`` through pyarrow, whose own errors are the file's: a ``DataError`` of one
    line (pyarrow's text runs over several), ``what`` failed, and ``fix``. The storage's errors
    stay theirs (a failing disk or network is no fault of the data): pyarrow raises again what
    the file object raised, as it was, and its own are an ``ArrowException`` or a bare
    ``OSError`` without an errno ("Corrupt snappy compressed data.")."""
    import pyarrow as pa

    try:
        yield
    except Exception as error:
        if not (isinstance(error, pa.ArrowException) or (type(error) is OSError and error.errno is None)):
            raise
        raise DataError(f"{url}: {what} ({' '.join(str(error).split())}); {fix}") from None


@dataclass(frozen=True)
class Chat:
    """A conversation to render with the tokenizer's chat template: ``messages``, or a
    ``prompt`` and its ``completion``. ``where`` names its file and row in an error."""

    where: str
    messages: list = field(default_factory=list)
    prompt: str | None = None
    completion: str | None = None


Document = str | np.ndarray | Chat


def _tool_calls(message: dict, where: str, turn: int) -> dict:
    """A message's ``tool_calls``, kept for the chat template to render (the tokenizer refuses a
    template that leaves them out); a message's other fields are not trained on."""
    calls = message.get("tool_calls")
    if not calls:  # a Parquet table's messages have every message's fields, None where one has none
        return {}
    if not isinstance(calls, list):
        raise DataError(f"{where}: message {turn}'s tool_calls is {type(calls).__name__}, not a list of calls; give "
                        "them as a list")
    return {"tool_calls": calls}


def _message_size(message: dict) -> int:
    """A message's text in bytes, its tool calls as JSON."""
    calls = message.get("tool_calls")
    return len(message["content"].encode()) + (len(json.dumps(calls, default=str).encode()) if calls else 0)


class DocumentFile(Recipe):
    """One file's documents. ``column`` names the text (or token-id) column; ``chat`` reads
    conversations instead. A document over ``max_document_bytes`` is refused before it is
    tokenized, and where the format allows before it is read whole."""

    _transient = ("_fs", "_blocks")
    # What ``scan`` records for ``read``, kept with the run's data index (arrays, or None)
    indexed: tuple[str, ...] = ()

    def __init__(self, url: str, column: str, chat: bool = False, storage_options: dict | None = None, *,
                 max_document_bytes: int):
        self.url, self.column, self.chat = url, column, chat
        self.storage_options = storage_options or {}
        self.max_document_bytes = max_document_bytes

    @cached_property
    def _fs(self) -> fsspec.AbstractFileSystem:
        return url_to_fs(self.url, **self.storage_options)[0]

    @cached_property
    def _blocks(self) -> OrderedDict:
        return OrderedDict()

    def _cached(self, key, load):
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return self._blocks[key]
        value = self._blocks[key] = load()
        if len(self._blocks) > _CACHED_BLOCKS:
            self._blocks.popitem(last=False)
        return value

    def scan(self) -> Iterator[list[Document]]:
        """Every document, a batch at a time, in order; records what ``read`` needs later."""
        raise NotImplementedError

    def read(self, start: int, stop: int) -> list[Document]:
        raise NotImplementedError

    def where(self, row: int) -> str:
        return f"{self.url} row {row}"

    def _check_size(self, size: int, row: int, what: str = "the document holds") -> None:
        if size > self.max_document_bytes:
            raise DataError(f"{self.where(row)}: {what} {size} bytes, over data.max_document_bytes "
                            f"({self.max_document_bytes}); split it into smaller documents, or raise the limit")

    def _document(self, value, row: int) -> Document:
        """A row's value as a document, or a ``DataError`` naming the file, the row and the fix."""
        if self.chat:
            return self._conversation(value, row)
        if isinstance(value, str):
            return self._text(value, row)
        if isinstance(value, list | np.ndarray) and all(isinstance(v, int | np.integer) for v in value):
            return self._token_ids(value, row)
        if value is None:
            raise DataError(f"{self.where(row)}: column {self.column!r} is empty; fill it or drop the row")
        raise DataError(f"{self.where(row)}: column {self.column!r} holds {type(value).__name__}, not text or a list "
                        "of token ids; set data.text_column to the column that holds the documents")

    def _text(self, text: str, row: int) -> str:
        if not text.isascii() and (surrogate := _SURROGATE.search(text)):
            raise DataError(f"{self.where(row)}: the text holds {surrogate.group()!r}, half of a UTF-16 pair and no "
                            "character; fix its escape (a character outside the BMP is a pair, \\ud83d\\ude00)")
        return text

    def _token_ids(self, values, row: int) -> np.ndarray:
        """A row's token ids as int64, each 0 or above (the model's vocabulary bounds them from
        above, window by window)."""
        if any(isinstance(v, bool) for v in values):
            raise DataError(f"{self.where(row)}: column {self.column!r} holds true/false values, not token ids; "
                            "give the ids as integers")
        try:
            ids = np.asarray(values, dtype=np.int64)
        except OverflowError:  # a Python int beyond int64
            ids = None
        if ids is None or (len(ids) and int(ids.min()) < 0):
            bad = next(v for v in values if not 0 <= v <= np.iinfo(np.int64).max)
            raise DataError(f"{self.where(row)}: column {self.column!r} holds {bad}, which is no token id (an id is "
                            "0 or above, below the vocabulary's size); fix the row")
        return ids

    def _conversation(self, row_value, row: int) -> Chat:
        where = self.where(row)
        if not isinstance(row_value, dict):
            raise DataError(f"{where}: a chat row is an object with messages, or with prompt and completion")
        if "messages" in row_value:
            messages = row_value["messages"]
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in messages):
                raise DataError(f"{where}: messages must be a non-empty list of {{role, content}} objects of text")
            if not any(m["role"] == "assistant" for m in messages):
                raise DataError(f"{where}: the conversation has no assistant turn to train on")
            for message in messages:
                self._text(message["content"], row)
            kept = [{"role": m["role"], "content": m["content"], **_tool_calls(m, where, turn)}
                    for turn, m in enumerate(messages)]
            self._check_size(sum(map(_message_size, kept)), row, "the conversation's text holds")
            return Chat(where, messages=kept)
        prompt, completion = row_value.get("prompt"), row_value.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            self._text(prompt, row)
            self._text(completion, row)
            self._check_size(len(prompt.encode()) + len(completion.encode()), row, "the conversation's text holds")
            return Chat(where, prompt=prompt, completion=completion)
        raise DataError(f"{where}: a chat row needs messages, or prompt and completion as text")


class JsonlFile(DocumentFile):
    """JSON Lines, one document a line (blank lines skipped). A plain file is read by the byte
    ranges of its lines, which ``scan`` records; a ``.gz`` or ``.zst`` file is decompressed
    whole on the rank that first reads it. A document is named by its line, as an editor
    counts them."""

    _transient = (*DocumentFile._transient, "_lines")
    indexed = ("spans", "blank_lines")

    def __init__(self, url: str, column: str, chat: bool = False, storage_options: dict | None = None, *,
                 max_document_bytes: int):
        super().__init__(url, column, chat, storage_options, max_document_bytes=max_document_bytes)
        self.spans: np.ndarray | None = None  # plain files: each document's [start, end) bytes
        # The blank lines before documents: the rows they precede, and how many precede each
        # (all before it, in total). Counted as the lines are read, so that a document is
        # named by its line from the first one read.
        self.blank_lines: np.ndarray | tuple[list, list] | None = None

    @property
    def compressed(self) -> bool:
        return url_name(self.url).endswith((".gz", ".zst"))

    @contextmanager
    def _stream(self) -> Iterator[io.BufferedIOBase]:
        """The file's bytes, decompressed as they are read."""
        with self._fs.open(self.url, "rb") as handle:
            if url_name(self.url).endswith(".gz"):
                with gzip.open(handle) as stream:
                    yield stream
            elif url_name(self.url).endswith(".zst"):
                try:
                    import zstandard
                except ImportError:
                    raise DataError(f"{self.url}: reading .zst needs zstandard: pip install "
                                    "'elastic-trainer[data]'") from None
                with zstandard.ZstdDecompressor().stream_reader(handle) as reader:
                    yield io.BufferedReader(reader)
            elif isinstance(self._fs, LocalFileSystem):
                yield handle
            else:  # fsspec's remote file reads a line whole, whatever its length: a buffer stops where asked
                yield io.BufferedReader(handle)

    def _parse(self, line: bytes, row: int) -> Document:
        try:
            value = json.loads(line)
        except UnicodeDecodeError:
            raise DataError(f"{self.where(row)}: the line is not UTF-8; re-encode the file as UTF-8") from None
        except ValueError as error:
            raise DataError(f"{self.where(row)}: not a JSON object ({error}); fix or drop the line") from None
        except RecursionError:
            raise DataError(f"{self.where(row)}: the JSON nests deeper than Python's parser goes; flatten the line "
                            "or drop it") from None
        if self.chat:
            return self._document(value, row)
        if not isinstance(value, dict) or self.column not in value:
            keys = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise DataError(f"{self.where(row)}: no {self.column!r} field (it has {keys}); set data.text_column to "
                            "the field that holds the documents")
        return self._document(value[self.column], row)

    def where(self, row: int) -> str:
        rows, blanks = self.blank_lines if self.blank_lines is not None else ((), ())
        before = bisect.bisect_right(rows, row)
        return f"{self.url} line {row + 1 + (int(blanks[before - 1]) if before else 0)}"

    def _lines_of(self, stream: io.BufferedIOBase) -> Iterator[tuple[int, int, bytes]]:
        """Each document's line, where it starts and ends in the (decompressed) stream: a line
        is read no further than ``max_document_bytes``, then refused. Counts the blank lines
        (``blank_lines``) as it goes."""
        row, at = 0, 0
        rows, blanks = self.blank_lines = [], []
        while line := stream.readline(self.max_document_bytes + 1):
            if len(line) > self.max_document_bytes and not line.endswith(b"\n"):
                self._check_size(len(line), row, "the line holds at least")
            begin, at = at, at + len(line)
            if line.strip():
                yield begin, at, line
                row += 1
            elif rows and rows[-1] == row:
                blanks[-1] += 1
            else:
                rows.append(row)
                blanks.append(blanks[-1] + 1 if blanks else 1)
        self.blank_lines = np.array([rows, blanks], dtype=np.int64).reshape(2, -1)

    def scan(self) -> Iterator[list[Document]]:
        starts, ends, batch = [], [], []
        try:
            with self._stream() as stream:
                for row, (begin, end, line) in enumerate(self._lines_of(stream)):
                    batch.append(self._parse(line, row))
                    starts.append(begin)
                    ends.append(end)
                    if len(batch) == SCAN_ROWS:
                        yield batch
                        batch = []
        except (EOFError, gzip.BadGzipFile) as error:
            raise DataError(f"{self.url}: the compressed file is cut short or damaged ({error})") from None
        if batch:
            yield batch
        self.spans = None if self.compressed else np.array([starts, ends], dtype=np.int64).reshape(2, -1)

    @cached_property
    def _lines(self) -> list[bytes]:
        with self._stream() as stream:
            return [line for _, _, line in self._lines_of(stream)]

    def read(self, start: int, stop: int) -> list[Document]:
        if self.spans is None:
            return [self._parse(line, row) for row, line in zip(range(start, stop), self._lines[start:stop])]
        begin, end = int(self.spans[0, start]), int(self.spans[1, stop - 1])
        data = self._fs.cat_file(self.url, start=begin, end=end)
        return [self._parse(data[int(a) - begin : int(b) - begin], row)
                for row, a, b in zip(range(start, stop), self.spans[0, start:stop], self.spans[1, start:stop])]


class ColumnarFile(DocumentFile):
    """A table read through pyarrow; a subclass gives its blocks (row groups, record batches)."""

    _transient = (*DocumentFile._transient, "_bounds")
    indexed = ("block_rows",)

    def __init__(self, url: str, column: str, chat: bool = False, storage_options: dict | None = None, *,
                 max_document_bytes: int):
        super().__init__(url, column, chat, storage_options, max_document_bytes=max_document_bytes)
        self.block_rows: np.ndarray | None = None  # rows in each block, from the file's own metadata

    def _block_count_rows(self) -> list[int]:
        raise NotImplementedError

    def _load_block(self, block: int):
        raise NotImplementedError

    def _columns(self) -> list[str] | None:
        return None if self.chat else [self.column]

    def _check_column(self, names: list[str]) -> None:
        if not self.chat and self.column not in names:
            raise DataError(f"{self.url}: no column {self.column!r} (it has {names}); set data.text_column to the "
                            "column that holds the documents")

    def _values(self, table, first_row: int) -> list[Document]:
        if self.chat:
            return [self._document(row, first_row + i) for i, row in enumerate(table.to_pylist())]
        self._check_column(table.column_names)
        column = table.column(self.column)
        self._check_sizes(column, first_row)
        return [self._document(value, first_row + i) for i, value in enumerate(column.to_pylist())]

    def _check_sizes(self, column, first_row: int) -> None:
        """Each document's bytes (a token id's 8), weighed in Arrow, before Python holds it."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or \
                pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            sizes = pc.binary_length(column)
        elif pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            sizes = pc.multiply(pc.list_value_length(column), 8)
        else:
            return  # not documents: _document says what the column holds instead
        first_over = pc.index(pc.greater(sizes, self.max_document_bytes), True).as_py()
        if first_over >= 0:
            self._check_size(sizes[first_over].as_py(), first_row + first_over)

    def scan(self) -> Iterator[list[Document]]:
        self.block_rows = np.array(self._block_count_rows(), dtype=np.int64)
        self.__dict__.pop("_bounds", None)
        row = 0
        for block in range(len(self.block_rows)):
            table = self._load_block(block)
            for at in range(0, table.num_rows, SCAN_ROWS):
                yield self._values(table.slice(at, SCAN_ROWS), row + at)
            row += table.num_rows

    def _block_of(self, row: int) -> int:
        return int(np.searchsorted(self._bounds, row, side="right")) - 1

    @cached_property
    def _bounds(self) -> np.ndarray:
        """Where each block starts (and the end), by row."""
        return np.concatenate([[0], np.cumsum(self.block_rows)])

    def read(self, start: int, stop: int) -> list[Document]:
        bounds = self._bounds
        documents = []
        block = self._block_of(start)
        while start < stop:
            first, last = int(bounds[block]), int(bounds[block + 1])
            table = self._cached(block, lambda: self._load_block(block))
            take = min(stop, last) - start
            documents += self._values(table.slice(start - first, take), start)
            start += take
            block += 1
        return documents


class ParquetFile(ColumnarFile):
    """A Parquet file, read a row group at a time (only ``data.text_column``, or a chat's
    columns). A row is named by its row group too, as Parquet's tools count them."""

    _transient = (*ColumnarFile._transient, "_parquet")

    @cached_property
    def _parquet(self):
        import pyarrow.parquet as pq

        with arrow_reading(self.url, "not a Parquet file", "give the file as Parquet, or set data.format"):
            return pq.ParquetFile(self._fs.open(self.url, "rb"))

    def where(self, row: int) -> str:
        block = self._block_of(row)
        return f"{self.url} row {row} (row group {block}, its row {row - int(self._bounds[block])})"

    def _block_count_rows(self) -> list[int]:
        metadata = self._parquet.metadata
        self._check_column(self._parquet.schema_arrow.names)  # from the footer, before any row group is read
        return [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]

    def _load_block(self, block: int):
        with arrow_reading(self.url, f"row group {block} cannot be read", "the file is damaged: write it again"):
            return self._parquet.read_row_group(block, columns=self._columns())


class ArrowFile(ColumnarFile):
    """One Arrow stream file of a HuggingFace dataset saved with ``save_to_disk``: memory-mapped
    where it is local, read whole (once a rank) where it is not."""

    _transient = (*ColumnarFile._transient, "_table")

    @cached_property
    def _table(self):
        import pyarrow as pa

        with arrow_reading(self.url, "not an Arrow stream file as datasets' save_to_disk writes",
                           "save the dataset again with save_to_disk"):
            local = isinstance(self._fs, LocalFileSystem)
            source = pa.memory_map(url_to_fs(self.url)[1]) if local else self._fs.open(self.url, "rb")
            return pa.ipc.open_stream(source).read_all()

    def _block_count_rows(self) -> list[int]:
        return [self._table.num_rows]

    def _load_block(self, block: int):
        return self._table


def arrow_files(fs: fsspec.AbstractFileSystem, directory: str) -> list[str]:
    """The Arrow files of a dataset saved with ``save_to_disk``, in its own order (``state.json``)."""
    directory = directory.rstrip("/")
    try:
        state = json.loads(fs.cat_file(regular_file(f"{directory}/state.json", fs)))
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"{directory}: not a dataset saved with save_to_disk (its state.json: {error}); give the "
                        "directory save_to_disk wrote, or a split of a DatasetDict") from None
    if not all(isinstance(name, str) and "/" not in name and name not in (".", "..") for name in names):
        raise DataError(f"{directory}: state.json names files outside the dataset's directory")
    if not names:
        raise DataError(f"{directory}/state.json lists no data files (its _data_files is empty); save the dataset "
                        "again with save_to_disk")
    name, count = Counter(names).most_common(1)[0]
    if count > 1:
        raise DataError(f"{directory}/state.json lists {name} {count} times, which would train on its rows {count} "
                        "times an epoch; list each file once, or save the dataset again with save_to_disk")
    # Checked here, on the driver, once: each rank maps or reads them later.
    return [regular_file(f"{directory}/{name}", fs) for name in names]

"""Map-style token datasets: a generated default corpus, text files, a token file, or
documents (``elastic.data``) mixed by weight, by path or URL.

A sample is ``seq_len + 1`` tokens (inputs and shifted targets). The driver owns the order;
a dataset only answers ``len`` and ``[index]``. Every dataset is small to pickle: it holds a
recipe and reads its tokens lazily on the worker that reads them. Files are never loaded
whole: ``len`` takes only their sizes and a sample reads only its own window.

Text is byte-level (a byte is a token); a token file is a flat binary of uint16 or uint32
tokens with no header (nanoGPT), written by ``elastic prepare``, or the ``.bin`` of a
Megatron pair. Parquet, JSONL and Arrow documents are packed by ``elastic.data.packing``,
whose index is built here, on the driver, once.

This module owns the datasets a config names (``default_datasets``), their identity for a
resume (``data_identity``) and the check that the config's data can be read at all
(``check_readable``, run by ``elastic.setup.preflight``). It reads a config and sits above
it: the config is imported only as a type, so reading data never loads pydantic.
"""

from __future__ import annotations

import random
from functools import cached_property
from typing import TYPE_CHECKING

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from checkpointing.storage import join_url, regular_file
from elastic.core.events import redact_credentials
from elastic.data.digests import content_identities
from elastic.data.documents import ArrowFile, DataError, JsonlFile, ParquetFile, arrow_files, url_name
from elastic.data.kept import KeptFiles
from elastic.data.megatron import DTYPES, pair_urls, read_index
from elastic.data.mixture import Mixture
from elastic.data.packing import PackedDocuments
from elastic.data.ray_dataset import materialize
from elastic.data.tokenizing import tokenizer_for
from elastic.data.windows import TokenWindows
from elastic.setup.config import invalid_config
from elastic.setup.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from elastic.setup.config import DataSource, TrainConfig

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "builds", "finds", "carries", "paints", "follows"]
_OBJECTS = ["a red ball", "the green door", "two apples", "the blue river", "a long road", "the tall tree"]
_PLACES = ["in the park", "at home", "near the sea", "on the hill", "under the bridge"]

_OPEN_FILES = 8  # local file handles a TextFiles keeps open, least recently used closed first

# Little-endian whatever the host: a token file is written on one machine and read on others.
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
# What a token file may be read as: the above, and the integer dtypes of Megatron's .bin files.
STREAM_DTYPES = {**TOKEN_DTYPES, **{name: np.dtype(name).newbyteorder("<") for name in DTYPES.values()}}

# Windows a TokenFile reads through one memory map before it maps the file afresh. Each read
# maps its window's pages, and the kernel's fault-around maps neighbours (64 KiB a fault by
# default); unmapping drops them from the process's RSS (they stay in the page cache), so a
# rank that reads a file far larger than memory stays at about this many times 64 KiB.
_WINDOWS_PER_MAP = 256

# Printable ASCII and whitespace: what a text file is made of.
_TEXT_BYTES = bytes(range(32, 127)) + b"\t\n\r"

# The held-out corpus made beside the generated default one: another seed, a tenth of the size.
_VALIDATION_SEED_OFFSET = 1_000_003


def generate_corpus(n_bytes: int, seed: int) -> bytes:
    """Sentences from a small grammar: learnable structure, so the loss falls visibly."""
    rng = random.Random(seed)
    sentences, size = [], 0
    while size < n_bytes:
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            sentence += f" {rng.choice(_PLACES)}"
        sentence = sentence[0].upper() + sentence[1:] + ". "
        sentences.append(sentence)
        size += len(sentence)
    return "".join(sentences).encode()[:n_bytes]


def list_files(path: str, storage_options: dict | None = None) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The files a path, glob or fsspec URL names, in a fixed order: a directory's own files,
    but those named ``.*`` or ``_*`` (as pyarrow's datasets skip them: ``_SUCCESS``, ``.crc``
    and the like are no data); raises OSError naming the path."""
    try:
        fs, _, paths = fsspec.get_fs_token_paths(path, storage_options=storage_options)
    except Exception as error:  # fsspec raises many kinds for a bad URL
        raise OSError(f"{path!r} cannot be opened: {error}") from None
    files = []
    for found in paths:
        if fs.isfile(found):
            files.append(found)
        elif fs.isdir(found):
            files += sorted(entry["name"] for entry in fs.ls(found, detail=True) if entry["type"] == "file"
                            and not entry["name"].rstrip("/").rsplit("/", 1)[-1].startswith((".", "_")))
    if not files:
        raise OSError(f"{path!r} matches no readable file")
    return fs, files


def resolve_text_files(path: str, storage_options: dict | None = None) -> list[str]:
    """Expand a path, glob or fsspec URL into readable files; raises OSError naming the path."""
    fs, files = list_files(path, storage_options)
    for file in files:
        try:
            with fs.open(file, "rb") as handle:
                handle.read(1)
        except OSError as error:
            raise OSError(f"{path!r}: {file} is unreadable ({error})") from None
    return [fs.unstrip_protocol(p) for p in files]


def data_identity(dataset) -> dict[str, str]:
    """Each file of a dataset read from files, and its size and digest; empty for the generated
    corpus (its settings say what it is) and for a dataset of the user's own. Redacted: it is
    stored in every manifest, and a presigned URL's signature is no part of what the data is."""
    identity = getattr(dataset, "identity", None)
    redacted: dict[str, list[str]] = {}
    for file, what in (identity() if callable(identity) else {}).items():
        # URLs that differ only in a secret (?key=a, ?key=b) share a name: it keeps each one's identity
        redacted.setdefault(redact_credentials(str(file)), []).append(redact_credentials(str(what)))
    return {file: "; ".join(identities) for file, identities in redacted.items()}


def read_range(fs: fsspec.AbstractFileSystem, file: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of a remote file by one ranged request; raises OSError when the
    server answers with more (it ignored the range, and would send the whole file a sample)."""
    data = fs.cat_file(file, start=start, end=end)  # by keyword: s3fs takes version_id second
    if len(data) > end - start:
        raise OSError(f"{fs.unstrip_protocol(file)} ignored a byte-range request (asked for {end - start} bytes, "
                      f"got {len(data)}); serve it from storage that answers Range requests, or copy it locally")
    return data


class GeneratedCorpus(TokenWindows):
    _transient = ("_data",)

    def __init__(self, seq_len: int, n_bytes: int, seed: int):
        super().__init__(seq_len)
        self.n_bytes, self.seed = n_bytes, seed

    @cached_property
    def _data(self) -> np.ndarray:
        return np.frombuffer(generate_corpus(self.n_bytes, self.seed), dtype=np.uint8)

    def n_tokens(self) -> int:
        return len(self._data)

    def read(self, start: int, count: int) -> np.ndarray:
        return self._data[start : start + count]


class TextFiles(TokenWindows):
    """Files joined by ``b"\\n"``, a byte a token, read by byte range: ``len`` needs only the file sizes.

    The layout (files and where each starts in the stream) is taken once, on the driver's
    ``len``, and travels in the pickle, so every rank reads the very stream the driver counted.
    Local files are read by seek and read through a few cached handles; other URLs by one
    ranged request per file a window touches (``fs.cat_file``), opened with
    ``storage_options`` (fsspec's keyword arguments: an S3 endpoint, retries). ``kept``: where
    a named run keeps its files' digests.
    """

    _transient = ("_fs", "_handles")

    def __init__(self, path: str, seq_len: int, storage_options: dict | None = None, kept: KeptFiles | None = None):
        super().__init__(seq_len)
        self.path = path
        self.storage_options = storage_options or {}
        self.kept = kept

    @cached_property
    def _layout(self) -> tuple[list[str], np.ndarray]:
        """The files, stripped of protocol, and ``starts``: file ``i`` holds stream bytes
        ``[starts[i], starts[i + 1] - 1)``, followed by its separator; ``starts[-1]`` is the
        stream size + 1 (the last file has no separator)."""
        fs, files = list_files(self.path, self.storage_options)
        sizes = fs.sizes(files)
        return files, np.cumsum([0] + [size + 1 for size in sizes], dtype=np.int64)

    @cached_property
    def _fs(self) -> fsspec.AbstractFileSystem:
        return url_to_fs(self.path, **self.storage_options)[0]

    def identity(self) -> dict[str, str]:
        return content_identities(self._fs, self._layout[0], self.kept)

    @cached_property
    def _handles(self) -> dict:
        return {}

    def n_tokens(self) -> int:
        return int(self._layout[1][-1]) - 1

    def where(self, position: int) -> str:
        files, starts = self._layout
        i = int(np.searchsorted(starts, position, side="right")) - 1
        return f"token {position} of the data, byte {position - int(starts[i])} of {files[i]}"

    def read(self, start: int, count: int) -> np.ndarray:
        files, starts = self._layout
        end, chunks = start + count, []
        i = int(np.searchsorted(starts, start, side="right")) - 1
        while start < end:
            separator = int(starts[i + 1]) - 1
            if start < separator:
                stop = min(end, separator)
                chunks.append(self._read_file(files[i], start - int(starts[i]), stop - int(starts[i])))
                start = stop
            else:
                chunks.append(b"\n")
                start, i = start + 1, i + 1
        return np.frombuffer(b"".join(chunks), dtype=np.uint8)

    def _read_file(self, file: str, start: int, end: int) -> bytes:
        if not isinstance(self._fs, LocalFileSystem):
            return read_range(self._fs, file, start, end)
        handle = self._handles.pop(file, None) or open(file, "rb")
        self._handles[file] = handle  # most recently used last
        if len(self._handles) > _OPEN_FILES:
            self._handles.pop(next(iter(self._handles))).close()
        handle.seek(start)
        return handle.read(end - start)


class TokenFile(TokenWindows):
    """A flat binary of ``dtype`` tokens (``"uint16"`` or ``"uint32"``, little-endian, no header).

    ``len`` needs one ``fs.size``, taken once on the driver and carried in the pickle. A local
    file is read through ``np.memmap``, mapped lazily on the reading process and mapped afresh
    every ``_WINDOWS_PER_MAP`` windows; any other URL by one ranged request a window
    (``fs.cat_file``), opened with ``storage_options``. ``kept``: where a named run keeps the
    file's digest.
    """

    _transient = ("_filesystem", "_map", "_map_reads")
    _map_reads = 0  # windows read through the current map

    def __init__(self, path: str, seq_len: int, dtype: str = "uint16", storage_options: dict | None = None,
                 kept: KeptFiles | None = None):
        super().__init__(seq_len)
        if dtype not in STREAM_DTYPES:
            raise ValueError(f"token dtype {dtype!r} is not one of {sorted(STREAM_DTYPES)}")
        self.path, self.dtype = path, dtype
        self.storage_options = storage_options or {}
        self.kept = kept

    @cached_property
    def _filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, file = url_to_fs(self.path, **self.storage_options)
        return fs, regular_file(file, fs)

    @cached_property
    def _n_tokens(self) -> int:
        fs, file = self._filesystem
        size, itemsize = fs.size(file), STREAM_DTYPES[self.dtype].itemsize
        if size % itemsize:
            raise ValueError(
                f"{self.path!r} holds {size} bytes, not a whole number of {self.dtype} tokens ({itemsize} bytes "
                "each); set data.token_dtype to the dtype the file was written with"
            )
        return size // itemsize

    def identity(self) -> dict[str, str]:
        fs, file = self._filesystem
        return content_identities(fs, [file], self.kept)

    def looks_like_text(self, sample_bytes: int = 65_536) -> bool:
        """Whether the file's first bytes are text (printable ASCII and whitespace, no NUL),
        which token ids almost never are: a text file named ``*.bin``."""
        fs, file = self._filesystem
        head = read_range(fs, file, 0, min(sample_bytes, fs.size(file)))
        other = len(head.translate(None, _TEXT_BYTES))  # the bytes that are not text
        return bool(head) and b"\0" not in head and other <= 0.05 * len(head)

    @cached_property
    def _map(self) -> np.memmap:
        return np.memmap(self._filesystem[1], dtype=STREAM_DTYPES[self.dtype], mode="r", shape=(self._n_tokens,))

    def n_tokens(self) -> int:
        return self._n_tokens

    def where(self, position: int) -> str:
        return f"token {position} of {self.path}"

    def read(self, start: int, count: int) -> np.ndarray:
        fs, file = self._filesystem
        dtype = STREAM_DTYPES[self.dtype]
        if not isinstance(fs, LocalFileSystem):
            data = read_range(fs, file, start * dtype.itemsize, (start + count) * dtype.itemsize)
            return np.frombuffer(data, dtype=dtype, count=len(data) // dtype.itemsize)
        if self._map_reads == _WINDOWS_PER_MAP:
            self.__dict__.pop("_map")
            self._map_reads = 0
        window = np.array(self._map[start : start + count])  # a copy: the window outlives the map
        self._map_reads += 1
        return window


class SampleRange:
    """Samples ``[start, stop)`` of a dataset, numbered from 0: a split that reads its base
    lazily and pickles as the base's recipe and two numbers."""

    def __init__(self, dataset, start: int, stop: int):
        if not 0 <= start <= stop:
            raise ValueError(f"sample range [{start}, {stop}) starts below 0 or ends before it starts")
        self.dataset, self.start, self.stop = dataset, start, stop

    @property
    def seq_len(self) -> int:
        return self.dataset.seq_len

    def identity(self) -> dict[str, str]:
        return data_identity(self.dataset)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside the range's {len(self)} samples")
        return self.dataset[self.start + index]


def held_out_split(dataset, fraction: float) -> tuple[SampleRange, SampleRange]:
    """(train, validation): the last ``fraction`` of the samples (at least one) held out."""
    n = len(dataset)
    held_out = max(1, round(n * fraction))
    return SampleRange(dataset, 0, n - held_out), SampleRange(dataset, n - held_out, n)


def format_by_extension(path: str) -> str | None:
    """The format a file's extension names (its URL's query string aside), if any."""
    name = url_name(path).rstrip("/")
    for suffixes, found in (((".parquet",), "parquet"), ((".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson"), "jsonl"),
                            ((".idx",), "megatron")):
        if name.endswith(suffixes):
            return found
    return None


def source_format(config: TrainConfig, path: str, declared: str | None = None) -> str:
    """The format ``path`` is read as: as declared (a source's own, else ``data.format``), or
    for ``auto`` by its extension, a save_to_disk directory's ``state.json``, the Megatron
    index beside a ``.bin`` or a prefix, or else the extension of every file it matches (a
    directory, a glob), all alike."""
    chosen = declared or config.data.format
    if chosen != "auto":
        return chosen
    found = format_by_extension(path)
    if found:
        return found
    storage_options = config.checkpoint.storage_options().for_url(path)
    fs, local = url_to_fs(path.rstrip("/"), **storage_options)
    if fs.exists(pair_urls(local)[1]):  # a .bin or a prefix with its Megatron index beside it
        return "megatron"
    if url_name(path).endswith(".bin"):
        return "tokens"
    if fs.exists(f"{local}/state.json"):
        return "arrow"
    formats: dict[str, str] = {}  # each format found, and the first file found in it
    for file in list_files(path, storage_options)[1]:
        formats.setdefault(format_by_extension(file) or "text", file)
    if len(formats) > 1:
        (one, first), (other, second) = list(formats.items())[:2]
        raise DataError(f"{path} holds {one} ({first}) and {other} ({second}); give files of one format (a glob "
                        "such as *.jsonl picks them), or set data.format")
    return next(iter(formats))


def file_dataset(config: TrainConfig, path: str, declared: str | None = None) -> TokenWindows:
    """The dataset at ``path`` in its format, opened with the run's S3 settings; documents
    (parquet, jsonl, arrow, chat) indexed now, on this process."""
    data = config.data
    storage_options = config.checkpoint.storage_options().for_url(path)
    kept = kept_data(config)
    chosen = source_format(config, path, declared)
    streams = chosen in ("text", "tokens", "megatron")  # tokens as they lie, no documents to tokenize or mask
    if streams and data.document_masking:
        raise ValueError(f"data.document_masking needs documents (parquet, jsonl, arrow or chat), and {path} is "
                         f"{chosen}; unset data.document_masking or give documents")
    if streams and data.tokenizer:
        raise ValueError(f"data.tokenizer applies to parquet, jsonl, arrow and chat documents, not to {path} "
                         f"({chosen}); tokenize text files with `elastic prepare --tokenizer`, or unset data.tokenizer")
    if chosen == "tokens":
        return TokenFile(path, data.seq_len, data.token_dtype, storage_options, kept)
    if chosen == "text":
        return TextFiles(path, data.seq_len, storage_options, kept)
    if chosen == "megatron":
        fs = url_to_fs(path, **storage_options)[0]
        pair = read_index(fs, path)
        return TokenFile(pair.bin_url, data.seq_len, pair.dtype, storage_options, kept)
    if chosen == "arrow":
        fs, directory = url_to_fs(path, **storage_options)
        urls = [fs.unstrip_protocol(file) for file in arrow_files(fs, directory)]
        files = [ArrowFile(url, data.text_column, storage_options=storage_options,
                           max_document_bytes=data.max_document_bytes) for url in urls]
    else:
        fs, found = list_files(path, storage_options)
        files = []
        for file in found:  # conversations are in JSONL or Parquet, each file as its extension says
            columnar = chosen == "parquet" or (chosen == "chat" and format_by_extension(file) == "parquet")
            files.append((ParquetFile if columnar else JsonlFile)(
                fs.unstrip_protocol(file), data.text_column, chat=chosen == "chat", storage_options=storage_options,
                max_document_bytes=data.max_document_bytes))
    tokenizer = tokenizer_for(data.tokenizer, data.max_document_bytes, data.chat_template_timeout_s)
    packed = PackedDocuments(files, tokenizer, data.seq_len, data.document_masking, kept)
    packed.build_index()
    return packed


def kept_data(config: TrainConfig) -> KeptFiles | None:
    """Where a named run keeps its data index and its files' digests, for its later legs; an
    unnamed run is never resumed."""
    if not config.run_name:
        return None
    return KeptFiles(join_url(config.storage, config.run_name, "data", "index"),
                     config.checkpoint.storage_options().for_url(config.storage))


def training_dataset(config: TrainConfig) -> TokenWindows | Mixture:
    """``data.path``'s dataset, or ``data.sources`` mixed by weight."""
    sources = config.data.sources
    if not sources:
        return file_dataset(config, config.data.path)
    datasets = [file_dataset(read_as(config, source), source.path, source.format) for source in sources]
    mixture = Mixture(datasets, [source.weight for source in sources], [source.name for source in sources],
                      config.seed, config.global_batch)
    problems = mixture.problems()
    if problems:
        raise ConfigError(invalid_config(problems[:1]))
    return mixture


def read_as(config: TrainConfig, source: DataSource) -> TrainConfig:
    """The config a mixture's source is read with: its own text_column, where it gives one."""
    data = config.data.model_copy(update={"text_column": source.text_column or config.data.text_column})
    return config.model_copy(update={"data": data})


def ray_dataset_source(config: TrainConfig, dataset, directory: str, vocab_size: int | None) -> TokenWindows:
    """A ``ray.data.Dataset`` as a Parquet source of the run: written once under ``directory``
    (``elastic.data.ray_dataset``), then packed as ``data.text_column``, ``data.tokenizer`` say."""
    storage_options = config.checkpoint.storage_options().for_url(directory)
    path = materialize(dataset, directory, storage_options)
    return bounded(file_dataset(config, path, "parquet"), vocab_size, "dataset")


def check_readable(config: TrainConfig) -> None:
    """Raise ValueError naming the field when the training or validation data cannot be read
    as its format, with the run's S3 settings."""
    fields = [(f"sources[{i}].path", source.path, source.format, read_as(config, source))
              for i, source in enumerate(config.data.sources)]
    fields += [(field, getattr(config.data, field), None, config) for field in ("path", "validation_path")]
    for field, path, declared, reading in fields:
        if path is None:
            continue
        try:
            chosen = source_format(config, path, declared)  # once: auto probes the storage
            dataset = file_dataset(reading, path, chosen)
            len(dataset)  # sizes: enough data for one sample
            dataset[0]  # and it reads as the ranks will, by range
            if chosen == "tokens":
                if dataset.looks_like_text():
                    raise ValueError(f"{path} looks like text, not {config.data.token_dtype} token ids; train on "
                                     "it as text (data.format = \"text\") or tokenize it with `elastic prepare`")
            elif chosen == "text":
                resolve_text_files(path, config.checkpoint.storage_options().for_url(path))
        except OSError as error:
            raise ValueError(f"data.{field}: {error}; give a readable file, glob or fsspec URL") from None
        except ValueError as error:
            raise ValueError(f"data.{field}: {error}") from None


def bounded(dataset: TokenWindows, vocab_size: int | None, field: str) -> TokenWindows:
    """``dataset`` checked against ``vocab_size`` (None: unchecked), a sample of it now."""
    dataset.vocab_size = vocab_size
    if vocab_size is not None:
        try:
            dataset.check_token_ids()
        except DataError as error:
            raise ConfigError(f"{field}: {error}; point it at data tokenized for model.vocab_size") from None
    return dataset


def default_datasets(config: TrainConfig, vocab_size: int | None = None,
                     ) -> tuple[TokenWindows | SampleRange, TokenWindows | SampleRange | None]:
    """(train, validation) from ``config.data``; validation is None when the config asks for none.

    Validation comes from ``data.validation_path``, or else the training data's last
    ``data.validation_fraction``; the generated default corpus always has one (a held-out
    corpus of its own). With ``vocab_size`` (the reference model's), a sample of windows of
    each file is checked now and every window as a rank reads it.
    """
    data = config.data
    if data.sources:
        train = training_dataset(config)
        for i, source in enumerate(train.sources):
            bounded(source, vocab_size, f"data.sources[{i}].path")
    elif data.path:
        train = bounded(file_dataset(config, data.path), vocab_size, "data.path")
    else:
        train = GeneratedCorpus(data.seq_len, data.corpus_tokens, config.seed)
    if data.validation_path:
        return train, bounded(file_dataset(config, data.validation_path), vocab_size, "data.validation_path")
    if data.validation_fraction:
        try:
            return held_out_split(train, data.validation_fraction)
        except (OSError, ValueError) as error:
            raise ConfigError(
                f"data.validation_fraction: the training data cannot be split: {error}; check data.path"
            ) from None
    if not data.path:
        n_bytes = max(data.corpus_tokens // 10, 8 * (data.seq_len + 1))
        return train, GeneratedCorpus(data.seq_len, n_bytes, config.seed + _VALIDATION_SEED_OFFSET)
    return train, None

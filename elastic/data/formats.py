"""Every data format, one entry each: its name (a choice of ``data.format``), the suffixes and
the probe ``auto`` knows it by, its opener, and what preflight checks of it beyond a sample.
The config's choices, ``auto`` and the checks read this table and nothing else: a new format
is a reader module of its own and an entry here.

``auto`` reads a path so: by a suffix of the path itself (a URL's query string aside); else by
each probe, in the table's order (the Megatron index beside a ``.bin`` or a prefix, a ``.bin``
alone, a save_to_disk directory's ``state.json``); else by the suffixes of every file the path
matches (a directory, a glob), which must all name one format, ``text`` where none names any.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import fsspec
from fsspec.core import url_to_fs

from elastic.data.documents import ArrowFile, DataError, DocumentFile, JsonlFile, ParquetFile, arrow_files, url_name
from elastic.data.kept import KeptFiles
from elastic.data.megatron import pair_urls, read_index
from elastic.data.streams import TextFiles, TokenFile, list_files, resolve_text_files
from elastic.data.text_lines import LinesFile
from elastic.data.windows import TokenWindows


@dataclass(frozen=True)
class Reading:
    """What a format is opened with: the path, the settings of ``data`` a reader takes, the
    storage's options for the path, and where a named run keeps its data's digests."""

    path: str
    seq_len: int
    token_dtype: str
    text_column: str
    max_document_bytes: int
    storage_options: dict
    kept: KeptFiles | None = None

    def files(self) -> list[str]:
        """The URLs of the files the path, glob or directory names, in a fixed order."""
        fs, found = list_files(self.path, self.storage_options)
        return [fs.unstrip_protocol(file) for file in found]

    def document_file(self, reader: type[DocumentFile], url: str, chat: bool = False) -> DocumentFile:
        return reader(url, self.text_column, chat=chat, storage_options=self.storage_options,
                      max_document_bytes=self.max_document_bytes)


@dataclass(frozen=True)
class Format:
    name: str
    # A token stream as it lies (``documents`` False), or the files' documents to tokenize and pack.
    open: Callable[[Reading], TokenWindows | list[DocumentFile]]
    documents: bool
    # For auto: a path or a matched file named so is of this format.
    suffixes: tuple[str, ...] = ()
    # For auto, when the path's name says nothing: (filesystem, path stripped of its protocol, path as given).
    probe: Callable[[fsspec.AbstractFileSystem, str, str], bool] | None = None
    # For preflight, after a sample is read: raises ValueError or OSError saying what is wrong.
    check: Callable[[TokenWindows, Reading], object] | None = None


def documents_of(reader: type[DocumentFile]) -> Callable[[Reading], list[DocumentFile]]:
    """The opener of a format whose every file is read by ``reader``."""
    return lambda reading: [reading.document_file(reader, url) for url in reading.files()]


def _megatron_pair(reading: Reading) -> TokenFile:
    pair = read_index(url_to_fs(reading.path, **reading.storage_options)[0], reading.path)
    return TokenFile(pair.bin_url, reading.seq_len, pair.dtype, reading.storage_options, reading.kept)


def _saved_dataset(reading: Reading) -> list[DocumentFile]:
    fs, directory = url_to_fs(reading.path, **reading.storage_options)
    return [reading.document_file(ArrowFile, fs.unstrip_protocol(file)) for file in arrow_files(fs, directory)]


def _conversations(reading: Reading) -> list[DocumentFile]:
    """Conversations in JSONL or Parquet, each file as its suffix says."""
    return [reading.document_file(ParquetFile if by_suffix(url) == "parquet" else JsonlFile, url, chat=True)
            for url in reading.files()]


def _not_text(dataset: TokenFile, reading: Reading) -> None:
    if dataset.looks_like_text():
        raise ValueError(f"{reading.path} looks like text, not {reading.token_dtype} token ids; train on it as text "
                         "(data.format = \"text\") or tokenize it with `elastic prepare`")


# In the order auto tries the probes: a .bin with its Megatron index beside it is a pair, not tokens.
FORMATS: dict[str, Format] = {format.name: format for format in (
    # bytes are tokens, files joined by newlines
    Format("text", lambda r: TextFiles(r.path, r.seq_len, r.storage_options, r.kept), documents=False,
           check=lambda dataset, r: resolve_text_files(r.path, r.storage_options)),
    # a .bin/.idx pair, named by its prefix or either file
    Format("megatron", _megatron_pair, documents=False, suffixes=(".idx",),
           probe=lambda fs, local, path: fs.exists(pair_urls(local)[1])),
    # a flat binary of data.token_dtype (elastic prepare writes one)
    Format("tokens", lambda r: TokenFile(r.path, r.seq_len, r.token_dtype, r.storage_options, r.kept),
           documents=False, probe=lambda fs, local, path: url_name(path).endswith(".bin"), check=_not_text),
    Format("parquet", documents_of(ParquetFile), documents=True, suffixes=(".parquet",)),
    Format("jsonl", documents_of(JsonlFile), documents=True, suffixes=(".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson")),
    # a HuggingFace dataset's save_to_disk directory
    Format("arrow", _saved_dataset, documents=True, probe=lambda fs, local, path: fs.exists(f"{local}/state.json")),
    # JSONL or Parquet conversations (messages, or prompt and completion): the assistant's tokens trained
    Format("chat", _conversations, documents=True),
    # text files of a document a line; by name only, as auto reads a .txt as text
    Format("lines", documents_of(LinesFile), documents=True),
)}


def by_suffix(path: str) -> str | None:
    """The format a file's suffix names (its URL's query string aside), if any."""
    name = url_name(path).rstrip("/")
    return next((format.name for format in FORMATS.values() if name.endswith(format.suffixes)), None)


def detect(path: str, storage_options: dict) -> str:
    """The format ``auto`` reads ``path`` as (see the module's docstring)."""
    found = by_suffix(path)
    if found:
        return found
    fs, local = url_to_fs(path.rstrip("/"), **storage_options)
    for format in FORMATS.values():
        if format.probe and format.probe(fs, local, path):
            return format.name
    formats: dict[str, str] = {}  # each format found, and the first file found in it
    for file in list_files(path, storage_options)[1]:
        formats.setdefault(by_suffix(file) or "text", file)
    if len(formats) > 1:
        (one, first), (other, second) = list(formats.items())[:2]
        raise DataError(f"{path} holds {one} ({first}) and {other} ({second}); give files of one format (a glob "
                        "such as *.jsonl picks them), or set data.format")
    return next(iter(formats))

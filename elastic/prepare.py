"""``elastic prepare``: text files to a token file (``data.format = "tokens"``), streamed.

Inputs are read a chunk at a time and tokens written as they come, so memory stays bounded
whatever the corpus size. Byte-level (no tokenizer) passes the bytes straight through; a
tokenizer sees whole lines, about ``CHUNK`` characters at a time. The output appears under its
name only once it is complete.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any, BinaryIO

import fsspec
import numpy as np
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from tqdm import tqdm

from checkpointing.storage import absolute_url, check_protocol
from elastic.data.streams import TOKEN_DTYPES, list_files
from elastic.setup.errors import ConfigError

CHUNK = 1 << 20
PROGRESS_FROM_BYTES = 8 << 20  # smaller inputs finish before a bar would tell anything
BYTE_VOCABULARY = 256


@dataclass(frozen=True)
class PrepareResult:
    output: str
    tokens: int
    dtype: str
    max_token: int | None  # None: nothing was written


def prepare_tokens(
    inputs: list[str],
    output: str,
    *,
    tokenizer: Callable[[str], list[int]] | Any = None,
    dtype: str = "auto",
    eos: int | None = None,
    progress: bool = True,
) -> PrepareResult:
    """Tokenize ``inputs`` (paths, globs or fsspec URLs, in order) into one token file.

    ``tokenizer``: None for bytes (vocabulary 256), a callable ``str -> list[int]``, or an
    object with ``.encode(str)`` (HuggingFace, tiktoken); it is applied to chunks of whole
    lines, so wrap it in a callable to choose its special tokens (e.g.
    ``lambda text: tok.encode(text, add_special_tokens=False)``). ``dtype``: ``"uint16"``,
    ``"uint32"`` or ``"auto"`` (uint16 when the tokenizer's ``vocab_size`` / ``n_vocab`` and
    ``eos`` fit it, else uint32). ``eos`` is appended after each input file. Raises
    ``ConfigError`` for an input that matches nothing or a token the dtype cannot hold.
    """
    if not inputs:
        raise ConfigError("inputs: none given; give at least one text file, glob or fsspec URL")
    try:
        check_protocol(output)
    except ValueError as error:
        raise ConfigError(f"output {output!r}: {error}") from None
    sources = [(fs, file) for pattern in inputs for fs, file in _input_files(pattern)]
    vocabulary = BYTE_VOCABULARY if tokenizer is None else _vocabulary(tokenizer)
    dtype = _output_dtype(dtype, vocabulary, eos)
    if eos is not None:
        _largest_token(np.array([eos]), dtype, "eos")
    encode = None if tokenizer is None else _encoder(tokenizer)
    total_bytes = sum(fs.size(file) for fs, file in sources)
    tokens, max_token = 0, -1
    show_progress = progress and total_bytes > PROGRESS_FROM_BYTES
    with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, disable=not show_progress) as bar, \
            _written_whole(output) as out:
        for fs, file in sources:
            with fs.open(file, "rb") as handle:
                pieces = _byte_chunks(handle, bar) if encode is None else _encoded_chunks(handle, bar, encode, file)
                if eos is not None:
                    pieces = chain(pieces, [np.array([eos])])
                for piece in pieces:
                    max_token = max(max_token, _largest_token(piece, dtype, file))
                    out.write(piece.astype(TOKEN_DTYPES[dtype]).tobytes())
                    tokens += len(piece)
    return PrepareResult(absolute_url(output), tokens, dtype, max_token if tokens else None)


def _largest_token(piece: np.ndarray, dtype: str, file: str) -> int:
    """The piece's largest token (-1 when empty); a token ``dtype`` cannot hold is an error."""
    if not len(piece):
        return -1
    low, high, limit = int(piece.min()), int(piece.max()), int(np.iinfo(TOKEN_DTYPES[dtype]).max)
    if low < 0 or high > limit:
        bad = low if low < 0 else high
        fix = "use dtype='uint32'" if dtype == "uint16" and low >= 0 else "check the tokenizer"
        raise ConfigError(f"{file}: token {bad} does not fit {dtype} (0 to {limit}); {fix}")
    return high


def _input_files(pattern: str) -> list[tuple[fsspec.AbstractFileSystem, str]]:
    try:
        fs, files = list_files(pattern)
    except OSError as error:
        raise ConfigError(f"input {error}; give a readable file, glob or fsspec URL") from None
    return [(fs, file) for file in files]


@dataclass(frozen=True)
class HuggingFaceTokenizer:
    """A HuggingFace tokenizer (a Hub name or a local directory) as ``prepare_tokens`` takes
    one: it adds no special tokens inside the text; ``eos`` goes after each input file."""

    tokenizer: Any

    @classmethod
    def load(cls, name_or_path: str, named_by: str = "--tokenizer") -> HuggingFaceTokenizer:
        """``named_by``: the flag or field that names it, for the errors (``load_tokenizer``'s)."""
        from elastic.data.tokenizing import load_tokenizer

        return cls(load_tokenizer(name_or_path, named_by))

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)  # added tokens included, unlike its vocab_size

    @property
    def eos(self) -> int | None:
        return self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def _vocabulary(tokenizer) -> int | None:
    for name in ("vocab_size", "n_vocab"):
        size = getattr(tokenizer, name, None)
        if isinstance(size, int):
            return size
    return None


def _output_dtype(dtype: str, vocabulary: int | None, eos: int | None) -> str:
    if dtype != "auto":
        if dtype not in TOKEN_DTYPES:
            raise ConfigError(f"dtype={dtype!r}: use 'auto', 'uint16' or 'uint32'")
        return dtype
    # Decided before the first token is written: an unknown vocabulary may hold any id.
    fits = vocabulary is not None and max(vocabulary - 1, eos or 0) <= np.iinfo(np.uint16).max
    return "uint16" if fits else "uint32"


def _encoder(tokenizer) -> Callable[[str], list[int]]:
    encode = getattr(tokenizer, "encode", None)
    if callable(encode):
        return encode
    if callable(tokenizer):
        return tokenizer
    raise ConfigError("tokenizer: give a callable str -> list[int] or an object with .encode(str)")


def _byte_chunks(handle: BinaryIO, bar) -> Iterator[np.ndarray]:
    while block := handle.read(CHUNK):
        bar.update(len(block))
        yield np.frombuffer(block, dtype=np.uint8)


def _encoded_chunks(handle: BinaryIO, bar, encode, file: str) -> Iterator[np.ndarray]:
    """Whole lines, about ``CHUNK`` characters at a time, through the tokenizer. A line longer
    than a chunk is cut where the chunk ends: memory stays bounded on text with no newlines."""
    decoder = codecs.getincrementaldecoder("utf-8")()  # keeps a character split across reads
    pending = ""
    try:
        while True:
            block = handle.read(CHUNK)
            bar.update(len(block))
            pending += decoder.decode(block, final=not block)
            cut = pending.rfind("\n") + 1 if block else len(pending)
            if cut or len(pending) >= CHUNK:
                text, pending = (pending[:cut], pending[cut:]) if cut else (pending, "")
                yield np.asarray(encode(text), dtype=np.int64)
            if not block:
                return
    except UnicodeDecodeError as error:
        raise ConfigError(f"{file}: not UTF-8 text ({error.reason}); give text, or no tokenizer for bytes") from None


@contextmanager
def _written_whole(output: str) -> Iterator[BinaryIO]:
    """A handle whose bytes appear under ``output`` only if the block completes.

    A local file is written under a temporary name beside it and renamed (atomic on one
    filesystem). An object store has no rename: the object is written in place but committed
    only at the end (fsspec's commit/discard protocol: s3fs completes the multipart upload on
    commit and aborts it on discard), so a failure leaves nothing under the name.
    """
    fs, path = url_to_fs(absolute_url(output))
    if isinstance(fs, LocalFileSystem):
        partial = f"{path}.partial-{os.getpid()}"
        try:
            with _open_for_writing(partial, output) as handle:
                yield handle
            os.replace(partial, path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return
    handle = fs.open(path, "wb", autocommit=False)
    try:
        with handle:
            yield handle
    except BaseException:
        handle.discard()
        raise
    handle.commit()


def _open_for_writing(path: str, output: str) -> BinaryIO:
    """``path`` opened for writing, its directory created; a place that cannot take it is the
    user's ``output`` to change."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "wb")
    except OSError as error:
        raise ConfigError(
            f"output {output!r}: cannot write there ({error.strerror}); give a path in a writable directory"
        ) from None

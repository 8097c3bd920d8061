"""Map-style byte-level datasets: a generated default corpus, or text files by path or URL.

A sample is ``seq_len + 1`` byte tokens (inputs and shifted targets). The driver owns the
order; a dataset only answers ``len`` and ``[index]``. Both datasets are small to pickle:
they hold a recipe and read their bytes lazily on the worker that reads them. Text files are
never loaded whole: ``len`` takes only their sizes and a sample reads only its own window.
"""

from __future__ import annotations

import random
from functools import cached_property

import fsspec
import numpy as np
import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "builds", "finds", "carries", "paints", "follows"]
_OBJECTS = ["a red ball", "the green door", "two apples", "the blue river", "a long road", "the tall tree"]
_PLACES = ["in the park", "at home", "near the sea", "on the hill", "under the bridge"]

_OPEN_FILES = 8  # local file handles a TextFiles keeps open, least recently used closed first


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


def _list_text_files(path: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    """The files a path, glob or fsspec URL names, in a fixed order; raises OSError naming the path."""
    try:
        fs, _, paths = fsspec.get_fs_token_paths(path)
    except Exception as error:  # fsspec raises many kinds for a bad URL
        raise OSError(f"data.path={path!r} cannot be opened: {error}") from None
    files = [p for p in paths if fs.isfile(p)]
    if not files:
        raise OSError(f"data.path={path!r} matches no readable file")
    return fs, files


def resolve_text_files(path: str) -> list[str]:
    """Expand a path, glob or fsspec URL into readable files; raises OSError naming the path."""
    fs, files = _list_text_files(path)
    for file in files:
        try:
            with fs.open(file, "rb") as handle:
                handle.read(1)
        except OSError as error:
            raise OSError(f"data.path={path!r}: {file} is unreadable ({error})") from None
    return [fs.unstrip_protocol(p) for p in files]


class ByteDataset:
    """Non-overlapping windows of ``seq_len + 1`` bytes over a byte stream.

    A subclass gives the stream's size (``nbytes``) and reads a range of it (``read``);
    sample ``i`` is the bytes ``[i * seq_len, i * seq_len + seq_len + 1)``, widened to int64
    one window at a time. Attributes named in ``_transient`` are caches, left out of a pickle.
    """

    _transient: tuple[str, ...] = ()

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def nbytes(self) -> int:
        raise NotImplementedError

    def read(self, start: int, length: int) -> bytes:
        raise NotImplementedError

    def __len__(self) -> int:
        size = self.nbytes()
        if size < self.seq_len + 1:
            raise ValueError(f"the data holds {size} bytes, fewer than one sample of seq_len + 1")
        return (size - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside the dataset's {len(self)} samples")
        data = self.read(index * self.seq_len, self.seq_len + 1)
        if len(data) != self.seq_len + 1:
            raise OSError(f"sample {index} read {len(data)} of {self.seq_len + 1} bytes: did the data change?")
        return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key not in self._transient}


class GeneratedCorpus(ByteDataset):
    _transient = ("_data",)

    def __init__(self, seq_len: int, n_bytes: int, seed: int):
        super().__init__(seq_len)
        self.n_bytes, self.seed = n_bytes, seed

    @cached_property
    def _data(self) -> bytes:
        return generate_corpus(self.n_bytes, self.seed)

    def nbytes(self) -> int:
        return len(self._data)

    def read(self, start: int, length: int) -> bytes:
        return self._data[start : start + length]


class TextFiles(ByteDataset):
    """Files joined by ``b"\\n"``, read by byte range: ``len`` needs only the file sizes.

    The layout (files and where each starts in the stream) is taken once, on the driver's
    ``len``, and travels in the pickle, so every rank reads the very stream the driver counted.
    Local files are read by seek and read through a few cached handles; other URLs by one
    ranged request per file a window touches (``fs.cat_file``).
    """

    _transient = ("_fs", "_handles")

    def __init__(self, path: str, seq_len: int):
        super().__init__(seq_len)
        self.path = path

    @cached_property
    def _layout(self) -> tuple[list[str], np.ndarray]:
        """The files, stripped of protocol, and ``starts``: file ``i`` holds stream bytes
        ``[starts[i], starts[i + 1] - 1)``, followed by its separator; ``starts[-1]`` is the
        stream size + 1 (the last file has no separator)."""
        fs, files = _list_text_files(self.path)
        sizes = fs.sizes(files)
        return files, np.cumsum([0] + [size + 1 for size in sizes], dtype=np.int64)

    @cached_property
    def _fs(self) -> fsspec.AbstractFileSystem:
        return url_to_fs(self.path)[0]

    @cached_property
    def _handles(self) -> dict:
        return {}

    def nbytes(self) -> int:
        return int(self._layout[1][-1]) - 1

    def read(self, start: int, length: int) -> bytes:
        files, starts = self._layout
        end, chunks = start + length, []
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
        return b"".join(chunks)

    def _read_file(self, file: str, start: int, end: int) -> bytes:
        if not isinstance(self._fs, LocalFileSystem):
            return self._fs.cat_file(file, start=start, end=end)  # by keyword: s3fs takes version_id second
        handle = self._handles.pop(file, None) or open(file, "rb")
        self._handles[file] = handle  # most recently used last
        if len(self._handles) > _OPEN_FILES:
            self._handles.pop(next(iter(self._handles))).close()
        handle.seek(start)
        return handle.read(end - start)


def default_dataset(seq_len: int, corpus_tokens: int, seed: int, path: str | None) -> ByteDataset:
    if path:
        return TextFiles(path, seq_len)
    return GeneratedCorpus(seq_len, corpus_tokens, seed)

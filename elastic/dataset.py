"""Map-style byte-level datasets: a generated default corpus, or text files by path or URL.

A sample is ``seq_len + 1`` byte tokens (inputs and shifted targets). The driver owns the
order; a dataset only answers ``len`` and ``[index]``. Both datasets are small to pickle:
they hold a recipe and load their bytes lazily on the worker that reads them.
"""

from __future__ import annotations

import random
from functools import cached_property

import fsspec
import torch

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "builds", "finds", "carries", "paints", "follows"]
_OBJECTS = ["a red ball", "the green door", "two apples", "the blue river", "a long road", "the tall tree"]
_PLACES = ["in the park", "at home", "near the sea", "on the hill", "under the bridge"]


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


def resolve_text_files(path: str) -> list[str]:
    """Expand a path, glob or fsspec URL into readable files; raises OSError naming the path."""
    try:
        fs, _, paths = fsspec.get_fs_token_paths(path)
    except Exception as error:  # fsspec raises many kinds for a bad URL
        raise OSError(f"data.path={path!r} cannot be opened: {error}") from None
    files = [p for p in paths if fs.isfile(p)]
    if not files:
        raise OSError(f"data.path={path!r} matches no readable file")
    for file in files:
        try:
            with fs.open(file, "rb") as handle:
                handle.read(1)
        except OSError as error:
            raise OSError(f"data.path={path!r}: {file} is unreadable ({error})") from None
    return [fs.unstrip_protocol(p) for p in files]


class ByteDataset:
    """Non-overlapping windows of ``seq_len + 1`` bytes over a byte string."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def load_bytes(self) -> bytes:
        raise NotImplementedError

    @cached_property
    def _tokens(self) -> torch.Tensor:
        data = self.load_bytes()
        if len(data) < self.seq_len + 1:
            raise ValueError(f"the data holds {len(data)} bytes, fewer than one sample of seq_len + 1")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def __len__(self) -> int:
        return (len(self._tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self._tokens[start : start + self.seq_len + 1]

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key != "_tokens"}


class GeneratedCorpus(ByteDataset):
    def __init__(self, seq_len: int, n_bytes: int, seed: int):
        super().__init__(seq_len)
        self.n_bytes, self.seed = n_bytes, seed

    def load_bytes(self) -> bytes:
        return generate_corpus(self.n_bytes, self.seed)


class TextFiles(ByteDataset):
    def __init__(self, path: str, seq_len: int):
        super().__init__(seq_len)
        self.path = path

    def load_bytes(self) -> bytes:
        chunks = []
        for url in resolve_text_files(self.path):
            with fsspec.open(url, "rb") as handle:
                chunks.append(handle.read())
        return b"\n".join(chunks)


def default_dataset(seq_len: int, corpus_tokens: int, seed: int, path: str | None) -> ByteDataset:
    if path:
        return TextFiles(path, seq_len)
    return GeneratedCorpus(seq_len, corpus_tokens, seed)

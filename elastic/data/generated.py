"""The default corpus: sentences from a small grammar, made from a seed, byte-level tokens."""

from __future__ import annotations

import random
from functools import cached_property

import numpy as np

from elastic.data.windows import TokenWindows

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

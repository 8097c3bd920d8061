"""Samples as windows over a token stream: ``seq_len + 1`` tokens each (inputs and shifted
targets), sample ``i`` starting at token ``i * seq_len``. Every file-backed dataset is one."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from elastic.data.documents import DataError
from elastic.data.recipe import Recipe

if TYPE_CHECKING:
    import torch


class TokenWindows(Recipe):
    """Non-overlapping windows of ``seq_len + 1`` tokens over a token stream.

    A subclass gives the stream's length (``n_tokens``) and reads a range of it (``read``,
    an integer array of any width); sample ``i`` is the tokens ``[i * seq_len, i * seq_len +
    seq_len + 1)``, widened to int64 one window at a time. Every window is checked to hold no
    id below 0, and with ``vocab_size`` set (the model's) none at or above it: a ``min`` and a
    ``max`` a window.
    """

    vocab_size: int | None = None

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def n_tokens(self) -> int:
        raise NotImplementedError

    def read(self, start: int, count: int) -> np.ndarray:
        raise NotImplementedError

    def __len__(self) -> int:
        size = self.n_tokens()
        if size < self.seq_len + 1:
            raise ValueError(f"the data holds {size} tokens, fewer than one sample of seq_len + 1; give more "
                             "data or lower data.seq_len")
        return (size - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        self.check_index(index)
        tokens = self.checked(index, self.read(index * self.seq_len, self.seq_len + 1))
        import torch  # here, not at the top: a config refused for its data never loads torch

        return torch.from_numpy(tokens.astype(np.int64))

    def check_index(self, index: int) -> None:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside the dataset's {len(self)} samples")

    def where(self, position: int) -> str:
        """What holds the stream's token ``position``, for an error that names it."""
        return f"token {position} of the data"

    def checked(self, index: int, tokens: np.ndarray) -> np.ndarray:
        """Sample ``index``'s tokens, checked: whole, and every id from 0 and below ``vocab_size``
        (an id outside would fail the embedding on the rank as if the model's code were wrong)."""
        if len(tokens) != self.seq_len + 1:
            raise OSError(f"sample {index} read {len(tokens)} of {self.seq_len + 1} tokens: did the data change?")
        above = self.vocab_size is not None and int(tokens.max()) >= self.vocab_size
        if above or int(tokens.min()) < 0:
            position = int(np.argmax((tokens >= self.vocab_size) if above else (tokens < 0)))
            token = int(tokens[position])
            outside = f"not below model.vocab_size {self.vocab_size}" if token >= 0 else "and no token id is below 0"
            raise DataError(
                f"sample {index} holds token id {token} ({self.where(index * self.seq_len + position)}), {outside}: "
                "the data was tokenized for another vocabulary, or is not a token file"
            )
        return tokens

    def check_token_ids(self, windows: int = 64) -> None:
        """Raise ``DataError`` if one of ``windows`` samples spread over the data holds an id
        at or above ``vocab_size``: a cheap look before training; the ranks check the rest
        as they read it."""
        n = len(self)
        for index in sorted({i * (n - 1) // max(1, windows - 1) for i in range(windows)}):
            self[index]

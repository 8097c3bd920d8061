"""A held-out split: a dataset's last samples, read through the dataset itself."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.data.digests import data_identity

if TYPE_CHECKING:
    import torch


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

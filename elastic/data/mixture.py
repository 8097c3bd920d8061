"""Several datasets as one, each drawn in proportion to its weight, every sample of each
exactly once before any of it repeats.

The mixture's epoch is ``n`` samples: as many as the data allows before the source that runs
out first (for its weight) would repeat. Source ``s`` takes ``counts[s]`` of them (weights
apportioned), laid out as one block; the data plan's seeded permutation of the mixture's
epoch spreads the blocks through every batch. The mixture's sample ``j`` of source ``s`` in
mixture epoch ``e`` is the source's ``e * counts[s] + j``-th sample in an order of its own,
a seeded permutation per pass over it: so every source moves on through its samples from one
mixture epoch to the next, and the cursor the data plan keeps (the mixture's epoch and
position) is every source's position too. A rank reads a mixture at the epoch its share is
from (``at_epoch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import NamedTuple

import numpy as np

from elastic.core.data_plan import apportion_array
from elastic.data.recipe import Recipe


class Drawn(NamedTuple):
    source: int
    source_epoch: int  # the source's own pass over its samples
    sample: int


def at_epoch(dataset, epoch: int):
    """``dataset`` as read in epoch ``epoch``: a dataset whose samples depend on the epoch (a
    mixture, or a user's with an ``at_epoch`` method) gives a view; any other is itself."""
    view = getattr(dataset, "at_epoch", None)
    return dataset if view is None else view(epoch)


class Mixture(Recipe):
    _transient = ("_orders",)

    def __init__(self, sources: Sequence, weights: Sequence[float], names: Sequence[str], seed: int, epoch: int = 0):
        self.sources, self.weights, self.names = list(sources), [float(w) for w in weights], list(names)
        self.seed, self.epoch = seed, epoch

    @property
    def seq_len(self) -> int:
        return self.sources[0].seq_len

    @cached_property
    def sizes(self) -> np.ndarray:
        return np.array([len(source) for source in self.sources], dtype=np.int64)

    @cached_property
    def counts(self) -> np.ndarray:
        """Samples each source gives a mixture epoch: none repeats within it."""
        shares = np.array(self.weights) / sum(self.weights)
        total = int(np.floor(np.min(self.sizes / shares) + 1e-9))
        return apportion_array(total, shares)

    @cached_property
    def _bounds(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)])

    @cached_property
    def _orders(self) -> dict[tuple[int, int], np.ndarray]:
        return {}

    def __len__(self) -> int:
        return int(self._bounds[-1])

    def at_epoch(self, epoch: int) -> Mixture:
        view = Mixture(self.sources, self.weights, self.names, self.seed, epoch)
        # the sources' orders too: a rank takes a view a micro-batch, and an order is a permutation of a whole source
        view.__dict__.update({key: getattr(self, key) for key in ("sizes", "counts", "_bounds", "_orders")})
        return view

    def locate(self, index: int) -> Drawn:
        """Which source's sample the mixture's ``index`` is in this epoch, and in which of its passes."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside the mixture's {len(self)} samples")
        source = int(np.searchsorted(self._bounds, index, side="right")) - 1
        drawn = self.epoch * int(self.counts[source]) + index - int(self._bounds[source])
        source_epoch, position = divmod(drawn, int(self.sizes[source]))
        return Drawn(source, source_epoch, int(self._order(source, source_epoch)[position]))

    def _order(self, source: int, source_epoch: int) -> np.ndarray:
        key = (source, source_epoch)
        if key not in self._orders:
            if len(self._orders) >= 2 * len(self.sources):
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = np.random.default_rng([self.seed, 1 + source, source_epoch]).permutation(
                int(self.sizes[source]))
        return self._orders[key]

    def __getitem__(self, index: int):
        drawn = self.locate(index)
        return self.sources[drawn.source][drawn.sample]

    def identity(self) -> dict[str, str]:
        identity = {}
        for source in self.sources:
            own = getattr(source, "identity", None)
            identity.update(own() if callable(own) else {})
        identity["data.sources"] = "; ".join(f"{name} x{weight:g}" for name, weight in zip(self.names, self.weights))
        return identity

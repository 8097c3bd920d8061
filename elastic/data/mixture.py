"""Several datasets as one, each drawn in proportion to its weight, every sample of each
exactly once before any of it repeats.

The mixture's epoch is ``n`` samples: as many whole global batches as the data allows before
the source that runs out first (for its weight) would repeat, so the data plan, which skips
an epoch's tail shorter than a batch, trains all of it. Source ``s`` takes ``counts[s]`` of
them (weights apportioned), laid out as one block; the data plan's seeded permutation of the
mixture's epoch spreads the blocks through every batch. The mixture's sample ``j`` of source
``s`` in mixture epoch ``e`` is the source's ``e * counts[s] + j``-th sample in an order of
its own, a seeded permutation per pass over it: so every source moves on through its samples
from one mixture epoch to the next, none passed by, and the cursor the data plan keeps (the
mixture's epoch and position) is every source's position too (``trained_before`` counts
each source's samples from it). A rank reads a mixture at the epoch its share is from
(``at_epoch``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cached_property
from typing import NamedTuple

import numpy as np

from elastic.core.data_plan import DataCursor, apportion_array, epoch_order
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


def rounded_up(value: float) -> float:
    """``value`` rounded up to two significant digits, the last raised a step rather than
    fall short of ``value`` by a float's error."""
    step = 10.0 ** (math.floor(math.log10(value)) - 1)
    return (math.floor(value / step) + 1) * step


class Mixture(Recipe):
    _transient = ("_orders",)

    def __init__(self, sources: Sequence, weights: Sequence[float], names: Sequence[str], seed: int,
                 global_batch: int, epoch: int = 0):
        self.sources, self.weights, self.names = list(sources), [float(w) for w in weights], list(names)
        self.seed, self.global_batch, self.epoch = seed, global_batch, epoch

    @property
    def seq_len(self) -> int:
        return self.sources[0].seq_len

    @cached_property
    def sizes(self) -> np.ndarray:
        return np.array([len(source) for source in self.sources], dtype=np.int64)

    @cached_property
    def _shares(self) -> np.ndarray:
        weights = np.array(self.weights)
        shares = weights / weights.max()  # first: a sum of weights near the float's largest is infinite
        return shares / shares.sum()

    @cached_property
    def _before_repeat(self) -> int:
        """The samples the data gives before a source would repeat."""
        with np.errstate(divide="ignore"):  # a share that underflows to 0 never runs out
            return int(np.floor(np.min(self.sizes / self._shares) + 1e-9))

    @cached_property
    def counts(self) -> np.ndarray:
        """Samples each source gives a mixture epoch: none repeats within it."""
        return apportion_array(self._before_repeat - self._before_repeat % self.global_batch, self._shares)

    @cached_property
    def _bounds(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.counts)])

    @cached_property
    def _orders(self) -> dict[tuple[int, int], np.ndarray]:
        return {}

    def __len__(self) -> int:
        return int(self._bounds[-1])

    def at_epoch(self, epoch: int) -> Mixture:
        view = Mixture(self.sources, self.weights, self.names, self.seed, self.global_batch, epoch)
        # the sources' orders too: a rank takes a view a micro-batch, and an order is a permutation of a whole source
        view.__dict__.update({key: getattr(self, key) for key in ("sizes", "counts", "_bounds", "_orders")})
        return view

    def problems(self) -> list[str]:
        """Why the mixture would not train as its weights say, each ``<field>: <what>; <fix>``,
        in order: the first is refused."""
        problems = []
        if not len(self):
            problems.append(f"data.sources: the mixture gives {self._before_repeat} samples before a source would "
                            f"repeat, fewer than global_batch={self.global_batch}; lower global_batch or give more "
                            "data")
        largest = max(self.weights)
        for i in np.flatnonzero(self.counts == 0):
            # At this weight its exact share of the epoch it makes (no shorter) is one sample or more;
            # in units of the largest weight, whose sum with the others' may exceed a float.
            others = sum(weight / largest for weight in self.weights) - self.weights[i] / largest
            least = others / max(len(self) - 1, 1) * largest
            problems.append(f"data.sources[{i}].weight={self.weights[i]:g}: its share of the mixture's epoch of "
                            f"{len(self)} samples rounds to none, so {self.names[i]} would never be trained; give it "
                            f"a weight of at least {rounded_up(least):g}, or drop the source")
        return problems

    def trained_before(self, cursor: DataCursor) -> np.ndarray:
        """The samples of each source the data plan gives before ``cursor``, from the first
        epoch: what a run that stands there has trained of each (the samples it returned to the
        plan not yet)."""
        order = epoch_order(len(self), self.seed, cursor.epoch)[: cursor.position]
        sources = np.searchsorted(self._bounds, order, side="right") - 1
        returned = np.searchsorted(self._bounds, np.array(cursor.returned, dtype=np.int64), side="right") - 1
        return (cursor.epoch * self.counts + np.bincount(sources, minlength=len(self.sources))
                - np.bincount(returned, minlength=len(self.sources)))

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

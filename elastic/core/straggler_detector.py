"""Straggler detection: per-rank compute time scored against the fleet, with a noise gate
and persistence, so noise never flags a healthy rank. Pure numpy, no Ray, injectable clock.

Each rank reports its compute seconds per sample at every step it takes part in. The
detector keeps the last ``window`` observations of each rank (its own ring; a step the rank
sat out does not use a slot) and, at each step, scores every *present* rank:

    score = rank's window median / median over present ranks of their window medians

A rank is **slow** at a step when both hold:

* ``score >= threshold`` (relative slowdown big enough to matter), and
* ``median_r - global_median > mad_gate * max(1.4826 * MAD, 0.01 * global_median)``
  where MAD is the median absolute deviation of the present ranks' window medians; the
  ``1.4826 * MAD`` term is a robust standard deviation, and the 1 % floor keeps a perfectly
  homogeneous fleet (MAD ~ 0) from turning tiny differences into flags.

Persistence (hysteresis): a rank is **flagged** once it was slow for ``patience``
consecutive observations of that rank, and a flagged rank **recovers** after ``patience``
consecutive observations with ``score < (1 + threshold) / 2``. Scores in between keep the
current state, so a rank hovering near the threshold does not flap.

Latency and tolerance, with a clean step change of a persistent slowdown at observation
``k`` (the first slow one): the window median turns slow at the ``window // 2 + 1``-th slow
observation, and ``patience`` consecutive slow observations later the rank is flagged, i.e.
at its ``window // 2 + patience``-th slow observation (5 with the defaults). Recovery is
symmetric: ``window // 2 + patience`` healthy observations. A spike of ``L`` observations
leaves the median alone if ``L <= window // 2`` and raises it for exactly ``L`` observations
otherwise, so spikes of up to ``max(window // 2, patience - 1)`` observations never flag
(2 with the defaults; a 3-observation spike of a big enough size does flag).

Rules worth knowing:

* Fewer than 3 present ranks: nothing is scored and no state changes (a median of one or
  two values cannot tell the slow rank from the healthy one). Observations are still kept.
* A rank becomes eligible for "slow" only once it has ``window // 2 + 1`` observations,
  so the first step(s) of a fresh rank (warm-up, allocator, compilation) can't flag it on
  their own. Its median still counts towards the fleet median.
* Values that are not finite or are negative are ignored (treated as absent).
* A non-positive fleet median means the step cannot be scored; it is skipped like a
  too-small step.
* Ranks are non-negative ints (global ranks). ``forget(rank)`` drops a rank's history and
  flag, for a rank that was evicted or replaced by a fresh process.

Storage is a numpy ring (``window`` slots x rows, NaN where unfilled), rows found through a
rank -> row index that grows as ranks appear; forgotten rows are reused. Cost: one
``observe`` is a few dozen vectorized numpy passes over the present ranks (a sorting network
over the window slots, two medians, the counters): ~1-2 ms at 16,384 ranks on a busy 2-core
box, of which ~0.5 ms is unpacking the dict (``observe_arrays`` takes arrays and skips it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

MIN_RANKS_TO_SCORE = 3
_MAD_TO_SIGMA = 1.4826
_MEDIAN_FLOOR = 0.01
# The dense rank -> row index is a numpy array indexed by rank; it is used while the
# largest rank seen stays within this many entries (64 MiB of int32), else a dict.
_DENSE_INDEX_LIMIT = 1 << 24


def _window_medians(block: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Median of each column of ``block`` (window x n) whose ``count`` filled slots hold
    values and whose unfilled slots are NaN; ``block`` is not modified.

    ``np.sort(axis=...)`` over many tiny lanes pays a per-lane overhead (~1.5 ms for
    16,384 lanes of 5); an odd-even transposition network over whole slot vectors is a few
    dozen vectorized min/max passes instead. Unfilled slots become +inf so they sort last.
    """
    window, n = block.shape
    columns = np.arange(n)
    if window > 16:
        ordered = np.sort(block, axis=0)  # NaN sorts last too
        return 0.5 * (ordered[(count - 1) // 2, columns] + ordered[count // 2, columns])
    if count.min() < window:
        block = np.where(np.isnan(block), np.inf, block)
    lanes = [np.array(block[i], dtype=np.float64) for i in range(window)]  # owned copies
    spare = np.empty(n)
    for phase in range(window):
        for i in range(phase % 2, window - 1, 2):
            np.minimum(lanes[i], lanes[i + 1], out=spare)
            np.maximum(lanes[i], lanes[i + 1], out=lanes[i + 1])
            lanes[i], spare = spare, lanes[i]
    if count.min() == window:
        if window % 2:
            return lanes[window // 2]
        return 0.5 * (lanes[window // 2 - 1] + lanes[window // 2])
    ordered = np.stack(lanes)
    return 0.5 * (ordered[(count - 1) // 2, columns] + ordered[count // 2, columns])


@dataclass(frozen=True)
class StragglerFlag:
    rank: int
    step: int
    score: float
    at: float = float("nan")  # clock time of the decision


# The defaults of the detector, and of the config's ``stragglers`` section, which uses these.
DEFAULT_WINDOW = 8
DEFAULT_THRESHOLD = 1.3
DEFAULT_MAD_GATE = 5.0
DEFAULT_PATIENCE = 4


class StragglerDetector:
    def __init__(
        self,
        window: int = DEFAULT_WINDOW,
        threshold: float = DEFAULT_THRESHOLD,
        mad_gate: float = DEFAULT_MAD_GATE,
        patience: int = DEFAULT_PATIENCE,
        clock: Callable[[], float] = time.monotonic,
    ):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if threshold <= 1.0:
            raise ValueError(f"threshold must be > 1, got {threshold}")
        if mad_gate < 0:
            raise ValueError(f"mad_gate must be >= 0, got {mad_gate}")
        self.window = window
        self.threshold = threshold
        self.recover_below = (1.0 + threshold) / 2.0
        self.mad_gate = mad_gate
        self.patience = patience
        self.min_observations = window // 2 + 1
        self.clock = clock

        self._row_of: dict[int, int] = {}  # authoritative rank -> row
        self._dense = np.full(0, -1, dtype=np.int32)  # fast rank -> row (-1: none)
        self._free: list[int] = []
        self._capacity = 0
        self._rows_used = 0
        self._alloc(1024)

        self.flagged_at: dict[int, float] = {}  # flagged rank -> clock time it was flagged
        self.flagged_step: dict[int, int] = {}  # flagged rank -> step it was flagged
        self.last_step: int | None = None

    # ----------------------------------------------------------------- storage
    _ROW_ARRAYS = (
        ("_buf", np.float64, np.nan),
        ("_pos", np.int64, 0),
        ("_count", np.int64, 0),
        ("_median", np.float64, np.nan),
        ("_score", np.float64, np.nan),
        ("_slow_run", np.int64, 0),
        ("_ok_run", np.int64, 0),
        ("_flag", bool, False),
        ("_rank_of", np.int64, -1),
    )

    def _alloc(self, capacity: int) -> None:
        """Grow every per-row array to ``capacity`` rows (new rows empty)."""
        old = self._capacity
        if capacity <= old:
            return
        for name, dtype, fill in self._ROW_ARRAYS:
            # The ring is slot-major (window x rows): one contiguous vector per ring slot.
            shape = (self.window, capacity) if name == "_buf" else (capacity,)
            grown = np.full(shape, fill, dtype=dtype)
            if old:
                grown[..., :old] = getattr(self, name)
            setattr(self, name, grown)
        self._capacity = capacity

    def _reset_row(self, row: int) -> None:
        for name, _, fill in self._ROW_ARRAYS:
            getattr(self, name)[..., row] = fill

    def _new_row(self, rank: int) -> int:
        if rank < 0:
            raise ValueError(f"ranks must be non-negative ints, got {rank}")
        if self._free:
            row = self._free.pop()
        else:
            if self._rows_used == self._capacity:
                self._alloc(2 * self._capacity)
            row = self._rows_used
            self._rows_used += 1
        self._rank_of[row] = rank
        self._row_of[rank] = row
        if rank < _DENSE_INDEX_LIMIT:
            if rank >= len(self._dense):
                size = max(rank + 1, 2 * len(self._dense), 1024)
                dense = np.full(min(size, _DENSE_INDEX_LIMIT), -1, dtype=np.int32)
                dense[: len(self._dense)] = self._dense
                self._dense = dense
            self._dense[rank] = row
        return row

    def _rows_for(self, ranks: np.ndarray) -> np.ndarray:
        """Rows of ``ranks`` (int64 array), allocating rows for ranks seen for the first time."""
        if len(ranks) and ranks.min() >= 0 and ranks.max() < len(self._dense):
            rows = self._dense[ranks].astype(np.int64)
            missing = np.flatnonzero(rows < 0)
            for i in missing.tolist():
                rows[i] = self._new_row(int(ranks[i]))
            return rows
        return np.fromiter(
            (self._row_of[r] if r in self._row_of else self._new_row(r) for r in ranks.tolist()),
            dtype=np.int64,
            count=len(ranks),
        )

    # ----------------------------------------------------------------- observe
    def observe(
        self, step: int, seconds_per_sample: Mapping[int, float]
    ) -> tuple[list[StragglerFlag], list[int]]:
        """Record one step's per-rank compute seconds per sample; returns (newly flagged
        ranks, ranks that recovered). Only the ranks in this observation are scored."""
        n = len(seconds_per_sample)
        # Unpacking a 16,384-entry dict is ~0.5 ms of the call; a driver that already holds
        # the timings in arrays can use observe_arrays() directly.
        ranks = np.fromiter(seconds_per_sample.keys(), dtype=np.int64, count=n)
        values = np.fromiter(seconds_per_sample.values(), dtype=np.float64, count=n)
        return self.observe_arrays(step, ranks, values)

    def observe_arrays(
        self, step: int, ranks: np.ndarray, values: np.ndarray
    ) -> tuple[list[StragglerFlag], list[int]]:
        """``observe`` for parallel arrays of distinct ranks and their seconds per sample."""
        self.last_step = step
        ranks = np.asarray(ranks, dtype=np.int64)
        values = np.asarray(values, dtype=np.float64)
        if ranks.shape != values.shape or ranks.ndim != 1:
            raise ValueError("ranks and values must be 1-D arrays of the same length")
        if len(ranks) == 0:
            return [], []
        valid = np.isfinite(values) & (values >= 0.0)
        if not valid.all():
            ranks, values = ranks[valid], values[valid]
            if len(ranks) == 0:
                return [], []
        rows = self._rows_for(ranks)
        # The usual step (every rank present, in first-seen order) maps to a contiguous run
        # of rows: a slice then turns every gather/scatter below into a view.
        sel: slice | np.ndarray = rows
        if rows[-1] - rows[0] == len(rows) - 1 and (len(rows) == 1 or bool((np.diff(rows) == 1).all())):
            sel = slice(int(rows[0]), int(rows[0]) + len(rows))

        # Append to each rank's own ring.
        pos = self._pos[sel]
        self._buf[pos, rows] = values
        self._pos[sel] = (pos + 1) % self.window
        count = np.minimum(self._count[sel] + 1, self.window)
        self._count[sel] = count

        medians = _window_medians(self._buf[:, sel], count)
        self._median[sel] = medians

        if len(rows) < MIN_RANKS_TO_SCORE:
            return [], []
        fleet = float(np.median(medians))
        if not fleet > 0.0:
            return [], []
        mad = float(np.median(np.abs(medians - fleet)))
        gate = self.mad_gate * max(_MAD_TO_SIGMA * mad, _MEDIAN_FLOOR * fleet)
        scores = medians / fleet
        self._score[sel] = scores

        slow = (scores >= self.threshold) & (medians - fleet > gate) & (count >= self.min_observations)
        slow_run = np.where(slow, self._slow_run[sel] + 1, 0)
        flag = self._flag[sel]
        ok_run = np.where(flag & (scores < self.recover_below), self._ok_run[sel] + 1, 0)

        newly = ~flag & (slow_run >= self.patience)
        recovered = flag & (ok_run >= self.patience)
        flag = (flag | newly) & ~recovered
        ok_run[newly | recovered] = 0
        slow_run[recovered] = 0
        self._slow_run[sel] = slow_run
        self._ok_run[sel] = ok_run
        self._flag[sel] = flag

        if not (newly.any() or recovered.any()):
            return [], []
        now = self.clock()
        flags = []
        for i in np.flatnonzero(newly).tolist():
            rank = int(ranks[i])
            self.flagged_at[rank] = now
            self.flagged_step[rank] = step
            flags.append(StragglerFlag(rank, step, float(scores[i]), now))
        back = sorted(int(ranks[i]) for i in np.flatnonzero(recovered).tolist())
        for rank in back:
            self.flagged_at.pop(rank, None)
            self.flagged_step.pop(rank, None)
        flags.sort(key=lambda flag_: flag_.rank)
        return flags, back

    # ----------------------------------------------------------------- queries
    def _known_rows(self) -> np.ndarray:
        return np.flatnonzero(self._rank_of[: self._rows_used] >= 0)

    def scores(self, digits: int | None = None) -> dict[int, float]:
        """Latest score of every known rank that has been scored at least once (rounded to
        ``digits`` where given)."""
        rows = self._known_rows()
        rows = rows[np.isfinite(self._score[rows])]
        scores = self._score[rows] if digits is None else np.round(self._score[rows], digits)
        return dict(zip(self._rank_of[rows].tolist(), scores.tolist()))

    def flagged(self) -> dict[int, float]:
        """Currently flagged rank -> its latest score."""
        rows = np.flatnonzero(self._flag[: self._rows_used])
        return dict(zip(self._rank_of[rows].tolist(), self._score[rows].tolist()))

    def medians(self, ranks: Iterable[int] | None = None) -> dict[int, float]:
        """Window median seconds per sample per rank (all known ranks by default)."""
        if ranks is None:
            rows = self._known_rows()
            return dict(zip(self._rank_of[rows].tolist(), self._median[rows].tolist()))
        return {rank: float(self._median[self._row_of[rank]]) for rank in ranks if rank in self._row_of}

    def medians_of(self, ranks: np.ndarray) -> np.ndarray:
        """Vectorized window medians for an int array of ranks; NaN for unknown ranks. The
        driver uses it to get each group's slowest rank (``reshape(groups, -1).max(1)``)."""
        ranks = np.asarray(ranks, dtype=np.int64)
        out = np.full(ranks.shape, np.nan)
        if ranks.size == 0:
            return out
        if ranks.min() >= 0 and ranks.max() < len(self._dense):
            rows = self._dense[ranks]
        else:
            rows = np.fromiter((self._row_of.get(r, -1) for r in ranks.ravel().tolist()), np.int64, ranks.size)
            rows = rows.reshape(ranks.shape)
        known = rows >= 0
        out[known] = self._median[rows[known]]
        return out

    def forget(self, rank: int) -> None:
        """The rank was evicted or replaced: drop its history and flag."""
        row = self._row_of.pop(rank, None)
        self.flagged_at.pop(rank, None)
        self.flagged_step.pop(rank, None)
        if row is None:
            return
        if 0 <= rank < len(self._dense):
            self._dense[rank] = -1
        self._reset_row(row)
        self._free.append(row)

    def __len__(self) -> int:
        return len(self._row_of)

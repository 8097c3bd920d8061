"""Silent errors in compute, found by replaying a step's work on other ranks: pure verdicts.

A device that computes wrong values hands its wrong gradients to the cross-group sum: every
group then applies the same corrupt update, the replicas stay identical, and the integrity
check (``elastic.core.integrity``) never sees it. But every group steps from the same state
with deterministic code, so any group can recompute another's share of a step bit for bit. At
a spot check (every ``integrity.replay_every`` steps) each group also computes the share of
the next group in the segment's order, before its own: each rank fingerprints what its own
work hands the cross-group sum and what its replay of the next group's work would hand, and
the ranks at each position compare the two across groups in the step's row.

A rank that computes wrong spoils its group's own work and its replay of the next group's: the
position finds two groups' work not reproduced, and the one group in both pairs (the work's
and its replayer's) is the culprit's. With two groups each is the other's replayer, and the
pairs name both: both ranks of the position are suspects. A mismatch discards the step
(nothing of it is committed), the suspect ranks (the culprit's alone where it is named) are
evicted, and the state goes back to where the last clean spot check left it: a fault that
began after it may have spoiled the steps since.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Fingerprints below this cross groups in the row's float64 exactly.
FINGERPRINT_MODULUS = 2**52
# Groups one can replay another's work among.
MIN_GROUPS = 2


@dataclass(frozen=True)
class ComputeMismatch:
    """A position's replays did not reproduce some groups' work at ``step``."""

    step: int
    position: tuple[int, ...]  # (pp, shard, tp) index
    mismatched: tuple[int, ...]  # the groups whose work its replay did not reproduce
    # the groups whose rank at the position may have computed wrong: the one in every
    # mismatch's pair, or where none is (two groups), every group of the pairs
    suspects: tuple[int, ...]
    suspect_ranks: tuple[int, ...] = ()  # their ranks at the position

    @property
    def named(self) -> bool:
        """Whether the replays named the one rank that computed wrong."""
        return len(self.suspects) == 1


def replay_due(step: int, every: int) -> bool:
    """Whether ``step`` is a spot check (0: never)."""
    return every > 0 and step % every == 0


def replayed_group(group: int, groups: Sequence[int]) -> int:
    """The group whose work ``group`` replays: the next in the segment's order."""
    return groups[(list(groups).index(group) + 1) % len(groups)]


def replayer_of(group: int, groups: Sequence[int]) -> int:
    return groups[(list(groups).index(group) - 1) % len(groups)]


def combine(fingerprint: int, part: int) -> int:
    """A running fingerprint with one more part (a bucket's), order-sensitive, below the modulus."""
    return (fingerprint * 1_000_003 + part) % FINGERPRINT_MODULUS


def verdict(step: int, position: tuple[int, ...], own: Mapping[int, int], replayed: Mapping[int, int],
            groups: Sequence[int]) -> ComputeMismatch | None:
    """One position's verdict: ``own`` by group, each group's fingerprint of its own work;
    ``replayed`` by group, its work's fingerprint as its replayer computed it."""
    mismatched = tuple(group for group in groups if own[group] != replayed[group])
    if not mismatched:
        return None
    pairs = [{group, replayer_of(group, groups)} for group in mismatched]
    common = set.intersection(*pairs)
    suspects = common if len(common) == 1 else set.union(*pairs)
    return ComputeMismatch(step, position, mismatched, tuple(sorted(suspects)))

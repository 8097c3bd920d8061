"""The silent-corruption check across replica groups: pure verdicts over fingerprints.

Replica groups hold bitwise the same committed state: they apply the same summed gradient
with the same code, in the same order. So the ranks at one position can compare their
states without moving them. Every ``integrity.every`` steps each rank fingerprints the
committed state it holds, one integer per tensor (the sum of the tensor's bits read as
integers: exact, so the order of the sum does not matter, and any flipped bit changes it),
and the ranks at each position gather the fingerprints across groups as the step begins.
The step's vote carries the verdict: on a mismatch every rank discards the step, which the
corrupt state would have tainted through the cross-group sum, and ends its run.

The odd groups are the ones that differ from a majority of the groups; without a majority
(two groups, or a tie) every group is suspect, and the state comes back from a tier below.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

# The differing tensors an event names: the first ones, in the model's order.
NAMED_TENSORS = 5


@dataclass(frozen=True)
class IntegrityMismatch:
    """Replicas of one position disagreed about the state committed before ``step``."""

    step: int
    position: tuple[int, ...]  # (pp, shard, tp) index
    suspects: tuple[int, ...]  # the groups to heal: the odd ones, or every group without a majority
    majority: tuple[int, ...]  # the groups that agree (none: no majority)
    tensors: tuple[str, ...]  # the differing tensors' names, at most NAMED_TENSORS


def check_due(step: int, every: int) -> bool:
    """Whether ``step`` begins by checking the state committed before it (0: never)."""
    return every > 0 and step % every == 0


def compare(step: int, position: tuple[int, ...], fingerprints: Mapping[int, Sequence[int]],
            names: Sequence[str]) -> IntegrityMismatch | None:
    """The verdict over one position's fingerprints, by group; ``names`` names the tensors."""
    counts = Counter(tuple(fingerprint) for fingerprint in fingerprints.values())
    if len(counts) <= 1:
        return None
    common, agreeing = counts.most_common(1)[0]
    groups = sorted(fingerprints)
    if 2 * agreeing > len(groups):
        majority = tuple(group for group in groups if tuple(fingerprints[group]) == common)
        suspects = tuple(group for group in groups if group not in majority)
    else:
        majority, suspects = (), tuple(groups)
    differing = [index for index, values in enumerate(zip(*fingerprints.values())) if len(set(values)) > 1]
    return IntegrityMismatch(step, position, suspects, majority,
                             tuple(names[index] for index in differing[:NAMED_TENSORS]))


def suspect_groups(mismatches: Iterable[IntegrityMismatch]) -> frozenset[int]:
    """Every group some position found suspect."""
    return frozenset(group for mismatch in mismatches for group in mismatch.suspects)

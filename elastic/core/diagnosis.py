"""Who failed a step: pure reasoning over what the ranks reported. No Ray.

A dead actor is its own culprit. A rank that raised an error about itself (not about a
peer) is a culprit. A step that ran past its deadline is blamed on the unfinished rank
that made the least progress: ranks blocked in a collective wait *after* entering the
module that needs the hung rank, so the hung rank lags them. Errors that only say a peer
went away are collateral. Groups whose own world failed mid-compute, or that are still
blocked in it, must rebuild it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from elastic.core.compute_replay import ComputeMismatch
from elastic.core.integrity import IntegrityMismatch, suspect_groups
from elastic.core.protocol import Failure, RankActivity, RankOutcome, describe_error

class Cause(StrEnum):
    """Why a rank or a group failed, as the driver names it: one word per cause, the same in
    the events, the metrics' ``cause`` label and the summary."""

    DEATH = "death"
    HANG = "hang"
    # The rank raised about itself: its own compute, I/O or hooks (the user's code, or the device).
    OWN_ERROR = "own-error"
    # The rank's data (or the dataset's code) failed: no fresh process reads it differently.
    OWN_DATA = "own-data"
    # The user's own code raised (not the device, memory or a peer): no fresh process runs it differently.
    OWN_CODE = "own-code"
    # Every rank that failed blames a peer, and none died or hung: the transport itself.
    COLLECTIVE_ERROR = "collective-error"
    # A control call (commit, heal, restore, rebuild, checkpoint staging) failed on a rank
    # that still answers: it is replaced like any failed rank.
    CONTROL_ERROR = "control-error"
    # Replicas disagreed about their committed state: the suspect groups heal, no rank is evicted.
    INTEGRITY_MISMATCH = "integrity-mismatch"
    # A victim blocked in its own group's collectives after a peer failed: replaced, not at fault.
    STUCK_IN_COLLECTIVE = "stuck-in-collective"
    # Slow by its hardware: replaced or its group evicted by the straggler policy.
    STRAGGLER = "straggler"
    # Its device computed wrong values, which a spot check's replay on other ranks did not
    # reproduce: replaced, and the state taken back to where the last clean check left it.
    SILENT_CORRUPTION = "silent-corruption"


@dataclass(frozen=True)
class Diagnosis:
    culprits: dict[int, Cause]
    broken_groups: frozenset[int]
    errors: dict[int, str]
    stuck: tuple[int, ...] = ()
    corrupt: frozenset[int] = frozenset()  # groups whose state failed the integrity check, or a spot check

    @property
    def cause(self) -> Cause:
        causes = set(self.culprits.values())
        for cause in (Cause.DEATH, Cause.HANG, Cause.OWN_DATA, Cause.OWN_CODE, Cause.OWN_ERROR, Cause.CONTROL_ERROR,
                      Cause.SILENT_CORRUPTION):
            if cause in causes:
                return cause
        return Cause.INTEGRITY_MISMATCH if self.corrupt else Cause.COLLECTIVE_ERROR


def least_advanced(activities: Iterable[RankActivity]) -> list[int]:
    """The unfinished ranks furthest behind (the hang's culprits)."""
    unfinished = [a for a in activities if not a.finished]
    if not unfinished:
        return []
    lowest = min(a.order() for a in unfinished)
    return sorted(a.global_rank for a in unfinished if a.order() == lowest)


def diagnose(
    *,
    dead: Iterable[int],
    outcomes: Mapping[int, RankOutcome],
    hung: Iterable[int],
    stuck: Iterable[int] = (),
    group_of: Mapping[int, int],
) -> Diagnosis:
    culprits = {rank: Cause.DEATH for rank in dead}
    culprits.update({rank: Cause.HANG for rank in hung if rank not in culprits})
    for rank, outcome in outcomes.items():
        if not outcome.ok and not outcome.blames_peers and outcome.failure != Failure.NO_STATE and rank not in culprits:
            culprits[rank] = {Failure.OWN_DATA: Cause.OWN_DATA, Failure.OWN_CODE: Cause.OWN_CODE}.get(outcome.failure,
                                                                                          Cause.OWN_ERROR)
    broken = {group_of[rank] for rank in culprits}
    broken |= {group_of[rank] for rank, outcome in outcomes.items() if outcome.group_broken}
    broken |= {group_of[rank] for rank in stuck}
    stuck = list(stuck)
    errors = {rank: describe_error(outcome.error, 300) for rank, outcome in outcomes.items() if not outcome.ok}
    stuck = tuple(sorted(rank for rank in stuck if rank not in culprits))
    return Diagnosis(culprits, frozenset(broken), errors, stuck)


def diagnose_control_failure(*, failed_on: Iterable[int], dead: Iterable[int], group_of: Mapping[int, int],
                             error: str) -> Diagnosis:
    """A control call (heal, restore, staging) failed on ``failed_on``: the ranks that no
    longer answer (``dead``) are culprits, and so are the ranks it failed on, whose state is
    now unknown."""
    dead = set(dead)
    failed = set(failed_on) - dead
    culprits = {rank: Cause.DEATH if rank in dead else Cause.CONTROL_ERROR for rank in sorted(dead | failed)}
    return Diagnosis(culprits, frozenset(group_of[rank] for rank in culprits), dict.fromkeys(culprits, error))


def diagnose_mismatch(mismatches: Iterable[IntegrityMismatch]) -> Diagnosis:
    """Replicas disagreed: the suspect groups rebuild and heal from the others (or, when
    every group is suspect, from a tier below); every rank is healthy, none is evicted."""
    suspects = suspect_groups(mismatches)
    return Diagnosis({}, suspects, {}, corrupt=suspects)


def diagnose_compute(found: Iterable[ComputeMismatch], group_of: Callable[[int], int]) -> Diagnosis:
    """A spot check did not reproduce some groups' work: each suspect rank is evicted (the one
    named, or with two groups both of the pair); every group's state since the last clean check
    is suspect (the wrong gradients went into every group's update), which the caller takes back."""
    found = list(found)
    culprits = {rank: Cause.SILENT_CORRUPTION for mismatch in found for rank in mismatch.suspect_ranks}
    groups = frozenset(group for mismatch in found for group in mismatch.mismatched)
    return Diagnosis(culprits, frozenset(group_of(rank) for rank in culprits), {}, corrupt=groups)


def merged(diagnoses: Iterable[Diagnosis]) -> Diagnosis:
    """One diagnosis of several failures seen together (groups that failed to start)."""
    culprits, broken, errors = {}, set(), {}
    for diagnosis in diagnoses:
        culprits.update(diagnosis.culprits)
        broken |= diagnosis.broken_groups
        errors.update(diagnosis.errors)
    return Diagnosis(culprits, frozenset(broken), errors)

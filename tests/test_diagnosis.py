"""Failure attribution over plain reports, without a cluster."""

from elastic.core.diagnosis import Cause, diagnose, least_advanced
from elastic.core.protocol import Phase, RankActivity, RankOutcome


def activity(rank: int, phase: str, micro_batch: int = 0, step: int = 5) -> RankActivity:
    return RankActivity(rank, step, Phase(phase), micro_batch, module_entries=0, phase_age_s=1.0)


def test_the_hang_is_blamed_on_the_rank_furthest_behind():
    ranks = [activity(0, "compute", 1), activity(1, "compute", 0), activity(2, "replicate"), activity(3, "done")]
    assert least_advanced(ranks) == [1]


def test_in_a_pipeline_the_stage_stuck_computing_is_blamed_not_the_stages_waiting_for_it():
    # Stage 0 ran ahead (more chunks entered) and waits for stage 1's gradients; stage 2 never
    # got its input. Only stage 1 is inside a chunk of compute.
    ranks = [RankActivity(0, 5, Phase.STAGE_WAIT, 0, module_entries=3, phase_age_s=2.0),
             RankActivity(1, 5, Phase.COMPUTE, 0, module_entries=1, phase_age_s=2.0),
             RankActivity(2, 5, Phase.STAGE_WAIT, 0, module_entries=0, phase_age_s=2.0)]
    assert least_advanced(ranks) == [1]


def test_a_rank_that_already_failed_its_step_is_not_the_hung_one():
    # Rank 2 gave up on the cross-group all-reduce at its own deadline a moment before the
    # driver probed: it is through with the step, its error report on the way.
    ranks = [activity(0, "compute", 1), activity(1, "compute", 0), activity(2, "failed"), activity(3, "replicate")]
    assert least_advanced(ranks) == [1]


def test_a_hang_breaks_only_the_hung_rank_group():
    group_of = {0: 0, 1: 0, 2: 1, 3: 1}
    reports = {
        2: RankOutcome(2, 5, error="CollectiveTimedOut: rank 2", failure="released"),
        3: RankOutcome(3, 5, error="CollectiveAborted: rank 3", failure="released"),
    }
    diagnosis = diagnose(dead=[], outcomes=reports, hung=[1], stuck=[0], group_of=group_of)
    assert diagnosis.culprits == {1: Cause.HANG}
    assert diagnosis.broken_groups == frozenset({0})


def test_a_ranks_own_failures_name_what_they_point_at():
    group_of = {0: 0, 1: 0, 2: 1, 3: 1}
    reports = {
        0: RankOutcome(0, 5, error="ValueError: bad (at train.py:3 in f)", failure="own-code"),
        1: RankOutcome(1, 5, error="DataError: token 300", failure="own-data"),
        2: RankOutcome(2, 5, error="RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED", failure="own-compute"),
        3: RankOutcome(3, 5, error="CollectiveFailed: peer", failure="collective"),
    }
    diagnosis = diagnose(dead=[], outcomes=reports, hung=[], group_of=group_of)
    assert diagnosis.culprits == {0: Cause.OWN_CODE, 1: Cause.OWN_DATA, 2: Cause.OWN_ERROR}  # rank 3 blames a peer
    assert diagnosis.cause == Cause.OWN_DATA

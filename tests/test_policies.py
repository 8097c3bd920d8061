"""Control-plane policies on plain data and a fake clock."""

from elastic.core.policies import FIRST_COPY_BYTES_PER_S, ScalingPolicy, catch_up_pays, expected_copy_s


def test_a_group_evicted_as_a_straggler_is_not_regrown_until_its_cooldown_ends():
    scaling = ScalingPolicy(min_groups=1, max_groups=3)
    assert scaling.wants_more(2, now=0.0)
    scaling.hold_back_one(until=100.0)
    assert not scaling.wants_more(2, now=50.0)
    assert scaling.wants_more(1, now=50.0)
    assert scaling.wants_more(2, now=100.0)


def test_the_ceiling_never_drops_below_the_minimum():
    scaling = ScalingPolicy(min_groups=2, max_groups=2)
    scaling.hold_back_one(until=100.0)
    assert scaling.wants_more(1, now=0.0)
    assert not scaling.wants_more(2, now=0.0)


def test_a_copy_is_foreseen_from_the_parameters_until_the_run_has_timed_one():
    assert expected_copy_s(None, 0) is None  # nothing built reported its parameters
    # 1 MB of parameters, 3 MB of state with an Adam's moments: a few milliseconds
    assert expected_copy_s(None, 10**6) == 3 * 10**6 / FIRST_COPY_BYTES_PER_S < 0.02
    assert not catch_up_pays(expected_copy_s(None, 10**6), 1.0, live=1, joining=1)
    # 4 GB of parameters (a 70 B model's shard at 64 ranks): the copy outlasts many steps
    assert catch_up_pays(expected_copy_s(None, 4 * 10**9), 1.0, live=1, joining=1)
    assert expected_copy_s(2.5, 10**6) == 2.5  # the run's own copy, once timed, is what counts


def test_a_catch_up_pays_where_the_copy_outlasts_the_joining_groups_share_of_the_steps_it_spans():
    # unmeasured: catch up, what a large state needs
    assert catch_up_pays(None, 1.0, live=1, joining=1)
    # a copy of 10 ms against 1 s steps: the live groups would take a half step's samples for it
    assert not catch_up_pays(0.01, 1.0, live=1, joining=1)
    # a copy of 30 s: at 7 live groups and 1 joining, an eighth of the rate for 30 steps, 3.75 s
    assert catch_up_pays(30.0, 1.0, live=7, joining=1)
    # one group of two joining: half the rate for the copy's whole steps, against all of it
    assert catch_up_pays(2.5, 1.0, live=1, joining=1) and not catch_up_pays(0.4, 1.0, live=1, joining=1)

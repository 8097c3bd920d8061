"""Control-plane policies on plain data and a fake clock."""

from elastic.core.policies import ScalingPolicy


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

"""Warm spares: the pure choice and bundle bookkeeping, then the controller's use of them
on the fake fleet (fake clock: the times asserted are the fake clock's, not the machine's)."""

from __future__ import annotations

import time

import pytest

from elastic.core.events import EventKind, EventLog
from elastic.core.spares import SPARES, Slots, Spare, choose_spares
from elastic.driver.spare_keeper import SpareKeeper
from tests.fake_fleet import FakeClock, Kill
from tests.test_controller_scenarios import Scenario

START_S = 3.0  # a process start on the fake clock: three steps of 1 s


@pytest.fixture(autouse=True)
def fake_time_only(monkeypatch):
    def real_sleep(seconds):
        raise AssertionError(f"a scenario slept {seconds} s of real time")
    monkeypatch.setattr(time, "sleep", real_sleep)


# the choice


def test_ready_spares_are_taken_first_and_one_on_another_node_before_one_on_the_lost_ranks():
    spares = [Spare(0, True, "a"), Spare(1, False), Spare(2, True, "b")]
    assert choose_spares([5], spares, {5: "a"}) == {5: 2}
    assert choose_spares([5], spares, {5: "b"}) == {5: 0}
    assert choose_spares([4, 5, 6, 7], spares, {}) == {4: 0, 5: 2, 6: 1}  # the starting one last; 7 starts afresh
    assert choose_spares([1], [], {}) == {}
    # a GPU group packed on node "a" (its TP runs over NVLink) takes the spare there first
    assert choose_spares([5], spares, {5: "a"}, near={5: "a"}) == {5: 0}


class TwoReadySpares:
    """Spares 0 on node "a" and 1 on node "b", both ready."""

    def reserve_spares(self):
        pass

    def start_spares(self, count):
        return []

    def spares(self):
        return [Spare(0, True, "a"), Spare(1, True, "b")]


@pytest.mark.parametrize("on_gpus, taken", [(True, 1), (False, 0)])
def test_on_gpus_a_group_keeps_to_its_node_and_on_cpus_the_lost_ranks_node_is_avoided(on_gpus, taken):
    clock = FakeClock()
    keeper = SpareKeeper(2, on_gpus, TwoReadySpares(), EventLog(clock), clock)
    keeper.tend(groups_live=True, step=0)
    # rank 1 of the group of ranks 0 and 1, both on node "b"
    assert keeper.take([1], [0, 1], {0: "b", 1: "b"}, step=5) == {1: taken}


def test_a_spare_keeps_its_bundle_and_the_home_it_replaced_takes_the_next_spare():
    slots = Slots()
    slots.add_placement(0, 2)
    slots.add_placement(SPARES, 1)
    placed = lambda placement: True  # noqa: E731
    assert slots.for_rank(0, (0, 0), placed) == (0, 0) and slots.for_rank(1, (0, 1), placed) == (0, 1)
    assert slots.for_spare(7, placed) == (SPARES, 0)
    assert slots.for_spare(8, placed) is None  # every bundle is taken
    slots.leave(rank=1)  # rank 1 is lost; the spare takes its place where it is
    slots.spare_takes_place(7, 1)
    assert slots.of_rank[1] == (SPARES, 0)
    assert slots.for_spare(8, placed) == (0, 1)  # the refill goes where rank 1 was
    # rank 1 lost again with no spare left free: its home holds the spare, so it starts in any
    # vacant bundle, and with none at home all the same (its process waits there)
    slots.leave(rank=1)
    assert slots.for_rank(1, (0, 1), placed) == (SPARES, 0)


def test_a_placement_given_up_with_another_groups_rank_in_it_is_released_when_that_rank_leaves():
    slots = Slots()
    slots.add_placement(0, 1)
    slots.add_placement(1, 1)
    placed = lambda placement: True  # noqa: E731
    slots.for_rank(0, (0, 0), placed)
    slots.for_spare(3, placed)  # none vacant
    slots.leave(rank=0)
    slots.for_spare(3, placed)
    slots.spare_takes_place(3, 1)  # group 1's rank lives in group 0's bundle
    assert slots.give_up(0) is False and slots.vacant(placed) == [(1, 0)]
    assert slots.releasable() == []
    slots.leave(rank=1)
    assert slots.releasable() == [0]


# the controller with spares


def recovery_scenario(tmp_path, spares: int, kills: dict) -> Scenario:
    scenario = Scenario(tmp_path, groups=2, shard=2, steps=40, start_s=START_S,
                        config={"scaling__spares": spares})
    scenario.fleet.faults = kills
    assert scenario.run() == "completed"
    assert scenario.committed_steps() == list(range(40))
    return scenario


def whole_again_s(scenario: Scenario, rank: int) -> list[float]:
    """From each failure of ``rank`` to its group's next join, on the fake clock."""
    failed = [e["t"] for e in scenario.kinds(EventKind.RANK_FAILED) if e["rank"] == rank]
    group = rank // scenario.topology.ranks_per_group
    joined = [e["t"] for e in scenario.kinds(EventKind.GROUP_JOINED) if e["group"] == group]
    return [min(t for t in joined if t >= at) - at for at in failed]


def test_a_lost_rank_takes_a_ready_spare_and_its_group_is_whole_again_without_a_process_start(tmp_path):
    with_spare = recovery_scenario(tmp_path / "a", 1, {10: [Kill(rank=3)]})
    without = recovery_scenario(tmp_path / "b", 0, {10: [Kill(rank=3)]})

    assert with_spare.fleet.spares_reserved and not without.fleet.spares_reserved
    assert with_spare.fleet.spares_taken == [(3, 0)]
    assert with_spare.fleet.starts == [0, 1, 2, 3]  # no process started for rank 3
    assert without.fleet.starts == [0, 1, 2, 3, 3]
    [taken] = with_spare.kinds(EventKind.SPARE_TAKEN)
    assert (taken["spare"], taken["rank"], taken["was_ready"]) == (0, 3, True)
    # the spare taken is started again: spare 1 becomes ready in the background
    assert [e["spare"] for e in with_spare.kinds(EventKind.SPARE_READY)] == [0, 1]
    # from the kill to the group's join: the process start is gone from it
    [spare_s], [fresh_s] = whole_again_s(with_spare, 3), whole_again_s(without, 3)
    assert spare_s <= 2.0 < START_S <= fresh_s


def test_a_second_loss_takes_the_spare_started_again_after_the_first(tmp_path):
    scenario = recovery_scenario(tmp_path, 1, {10: [Kill(rank=3)], 25: [Kill(rank=0)]})
    assert scenario.fleet.spares_taken == [(3, 0), (0, 1)]
    assert scenario.fleet.starts == [0, 1, 2, 3]
    assert all(seconds <= 2.0 for seconds in whole_again_s(scenario, 3) + whole_again_s(scenario, 0))


def test_a_spare_lost_while_waiting_is_started_again_and_one_whose_warm_up_raised_is_not(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=30, start_s=START_S, config={"scaling__spares": 1})
    lose = {8: ("process died", False), 18: ("ImportError: no module named mymodel", True)}
    scenario.controller.step_listeners.append(
        lambda record: scenario.fleet.lose_spare(min(scenario.fleet.spare_ready_at), *lose[record.step])
        if record.step in lose else None)
    assert scenario.run() == "completed"

    lost = scenario.kinds(EventKind.SPARE_LOST)
    assert [(e["spare"], e["restarting"]) for e in lost] == [(0, True), (1, False)]
    assert "ImportError" in lost[1]["error"]
    assert scenario.fleet.spares_started == 2  # none after the warm-up error
    assert scenario.committed_steps() == list(range(30))


def test_a_straggler_is_replaced_by_a_ready_spare(tmp_path):
    scenario = Scenario(tmp_path, groups=4, shard=1, steps=40, stragglers=True, start_s=START_S,
                        config={"scaling__spares": 1})
    scenario.controller.step_listeners.append(
        lambda record: scenario.fleet.slow.update({2: 1.6}) if record.step == 9 else None
    )
    assert scenario.run() == "completed"

    [decided] = scenario.kinds(EventKind.STRAGGLER_DECIDED)
    assert (decided["action"], decided["rank"]) == ("replace", 2)
    assert scenario.fleet.spares_taken == [(2, 0)]
    assert scenario.fleet.starts == [0, 1, 2, 3]

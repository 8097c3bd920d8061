"""The controller's protocol, scenario by scenario, against a fake fleet on a fake clock.

No Ray and no torch work: each scenario runs the real controller (and, where it saves, the
real checkpoint coordinator and catalog on a temporary directory) in milliseconds. What the
Ray tests prove end to end (losses equal to a fault-free run), these pin down as decisions:
who is evicted and why, which groups stay live and are healed from, when checkpoints start,
defer, fail and commit.
"""

from __future__ import annotations

import time

import pytest

from checkpointing.catalog import CheckpointCatalog
from checkpointing.lease import LeaseLost, RunLease
from checkpointing.storage import StorageOptions
from elastic.driver.checkpoint_coordinator import CheckpointCoordinator, CheckpointsFailing
from elastic.driver.controller import Controller, TrainingStopped
from elastic.driver.records import StepResult
from elastic.driver.recovery_timing import RECOVERY_PARTS
from elastic.core.data_plan import PADDING_INDEX, epoch_order, rank_share
from elastic.core.events import EventKind, EventLog, console_line
from elastic.core.goodput import TimeLedger
from elastic.core.protocol import BuildOutcome
from elastic.core.topology import Topology
from elastic.fleet.api import CallFailed, RanksLost
from tests.fake_fleet import STATE_BYTES, CollectiveError, FakeClock, FakeFleet, Flip, Hang, Kill
from tests.tiny import tiny_config

DATASET_LEN = 10_000


class Scenario:
    def __init__(self, tmp_path, *, groups=2, shard=1, steps=12, min_groups=1, checkpoint_every=0,
                 max_consecutive_failures=3, stragglers=False, lease_ttl_s=None, max_recoveries=100,
                 config: dict | None = None, eval_len=0, dataset_len=DATASET_LEN, resume=False,
                 **fleet_options):
        overrides = {"stragglers__enabled": stragglers, "fault_tolerance__max_recoveries": max_recoveries,
                     **(config or {})}
        if checkpoint_every:
            overrides |= {"checkpoint__every": checkpoint_every,
                          "checkpoint__max_consecutive_failures": max_consecutive_failures}
        self.config = tiny_config(tmp_path, groups=groups, shard=shard, steps=steps, min_groups=min_groups,
                                  capacity_timeout_s=30, **overrides)
        self.clock = FakeClock()
        self.topology = Topology(shard, 1, groups)
        self.fleet = FakeFleet(self.topology, self.clock, **fleet_options)
        self.events = EventLog(self.clock)
        self.ledger = TimeLedger(self.clock)
        self.records: list[dict] = []
        self.checkpoints = None
        self.lease = None
        if lease_ttl_s:  # never renewed: it runs out lease_ttl_s into the run
            self.lease = RunLease(str(tmp_path / "run"), StorageOptions(), lease_ttl_s, clock=self.clock)
            self.lease.acquire()
        if checkpoint_every:
            catalog = CheckpointCatalog(str(tmp_path / "run"), StorageOptions(), checkpoint_every, keep=10)
            self.checkpoints = CheckpointCoordinator(catalog, self.fleet, self.events, self.ledger, self.topology,
                                                     "hash", max_consecutive_failures,
                                                     self.config.checkpoint.upload_timeout_s, self.clock,
                                                     lease=self.lease)
        self.controller = Controller(self.config, self.fleet, dataset_len, self.events, self.ledger,
                                     clock=self.clock, sleep=self.clock.sleep, on_step=[self.records.append],
                                     checkpoints=self.checkpoints, eval_len=eval_len,
                                     resume=self.checkpoints.latest() if resume else None)

    def run(self) -> str:
        return str(self.controller.run())  # the line summary.json keeps

    def kinds(self, kind: EventKind) -> list[dict]:
        return self.events.of_kind(kind)

    def committed_steps(self) -> list[int]:
        return [record.step for record in self.records]

    def live_groups_by_step(self) -> list[int]:
        return [record.live_groups for record in self.records]


@pytest.fixture(autouse=True)
def fake_time_only(monkeypatch):
    """A scenario waits on the fake clock only: a real sleep anywhere under it is a defect
    (how long the suite takes is measured, not asserted)."""
    def real_sleep(seconds):
        raise AssertionError(f"a scenario slept {seconds} s of real time")
    monkeypatch.setattr(time, "sleep", real_sleep)


def test_fault_free_run_commits_every_step_once(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2)
    assert scenario.run() == "completed"
    assert scenario.committed_steps() == list(range(12))
    assert scenario.live_groups_by_step() == [2] * 12
    assert scenario.fleet.kills == [] and scenario.kinds(EventKind.STEP_DISCARDED) == []
    # every rank of every live group ran every step: one run, handed to all four ranks
    assert [sorted(specs) for specs in scenario.fleet.segments] == [[0, 1, 2, 3]]
    assert [(spec.first_step, spec.stop_step) for spec in (runs[0] for runs in scenario.fleet.segments)] == [(0, 12)]


def message_kinds(fleet) -> list[str]:
    return [type(message).__name__ for _, message in fleet.delivered]


def test_the_groups_records_reach_the_driver_in_one_message_per_interval_for_the_whole_run(tmp_path):
    scenario = Scenario(tmp_path, groups=4, shard=2, steps=40, step_s=0.1)
    assert scenario.run() == "completed"
    assert scenario.committed_steps() == list(range(40))
    kinds = message_kinds(scenario.fleet)
    # after the first step, then about once a second (10 steps); each group's first rank sends
    # what it holds when the run ends, and every rank its end
    assert kinds.count("SegmentRecords") == 4
    assert kinds.count("GroupRecords") == 4 and kinds.count("SegmentEnd") == 8
    assert {rank for rank, message in scenario.fleet.delivered if type(message).__name__ == "SegmentRecords"} == {0}
    for record in scenario.records:  # every rank's times, every step
        assert sorted(record.rank_times) == list(range(8))
        assert record.group_samples == scenario.records[0].group_samples


def test_a_failure_between_two_run_messages_commits_each_step_once_from_the_groups_own(tmp_path):
    scenario = Scenario(tmp_path, groups=4, shard=2, steps=40, step_s=0.1)
    scenario.fleet.faults = {15: [Kill(rank=5, after_s=0.05)]}
    assert scenario.run() == "completed"
    assert scenario.committed_steps() == list(range(40))
    [failed] = scenario.kinds(EventKind.RANK_FAILED)
    assert (failed["rank"], failed["step"]) == (5, 15)
    # steps 11-14 reached the driver in the groups' own messages, the first run's last
    first_run = message_kinds(scenario.fleet)[:message_kinds(scenario.fleet).index("SegmentEnd")]
    assert "GroupRecords" in first_run
    assert [record.live_ranks for record in scenario.records] == [8] * 40


def test_a_rank_death_heals_its_group_from_the_live_one(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.faults = {3: [Kill(rank=1, after_s=0.5)]}
    assert scenario.run() == "completed"

    [failed] = scenario.kinds(EventKind.RANK_FAILED)
    assert (failed["rank"], failed["cause"], failed["step"]) == (1, "death", 3)
    assert [(e["rank"], e["cause"]) for e in scenario.kinds(EventKind.RANK_EVICTED)] == [(1, "death")]
    [discarded] = scenario.kinds(EventKind.STEP_DISCARDED)
    assert discarded["broken_groups"] == [0]
    assert scenario.fleet.starts.count(1) == 2 and scenario.fleet.starts.count(0) == 1  # only the dead rank restarts
    assert scenario.fleet.copies == [(2, 0), (3, 1)]  # group 0 healed from group 1, position by position
    [healed] = scenario.kinds(EventKind.GROUP_HEALED)
    assert (healed["rank_to_rank_bytes"], healed["object_store_bytes"]) == (2 * STATE_BYTES, 0)
    assert scenario.kinds(EventKind.HEAL_FALLBACK) == []
    [recovered] = scenario.kinds(EventKind.RECOVERED)
    assert recovered["cause"] == "death" and recovered["step"] == 4
    assert recovered["detect_s"] == pytest.approx(0.5)
    # the parts add up to the whole: here the kill's 0.5 s, the drain, and the step run again
    assert sum(recovered[part] for part in RECOVERY_PARTS) == pytest.approx(recovered["total_s"])
    assert recovered["first_step_s"] == pytest.approx(1.0) and recovered["other_s"] == pytest.approx(0.0)
    assert scenario.committed_steps() == list(range(12))  # step 3 reran once
    # the replacement started at once, so group 0 was healed before step 3 ran again
    assert scenario.live_groups_by_step() == [2] * 12


def builds_report_parameters(fleet: FakeFleet, parameter_bytes: int) -> None:
    """Every rank built reports ``parameter_bytes`` of parameters, from which the driver foresees a copy."""
    build = fleet.build

    def build_reporting(ranks, world_build):
        pending = build(ranks, world_build)
        for rank, call in pending.refs.items():
            call.result = BuildOutcome(rank, 0.1, "node-0", parameter_bytes=parameter_bytes)
        return pending

    fleet.build = build_reporting


def catch_up_segments(scenario: Scenario) -> list[dict]:
    """The specs, by rank, of the segments that carried a ``CatchUp``."""
    return [specs for specs in scenario.fleet.segments if next(iter(specs.values())).catch_up is not None]


@pytest.mark.parametrize("before_first_step", [False, True], ids=["catch-up", "before-first-step"])
def test_a_group_joining_while_the_other_steps_takes_the_state_in_the_segment_with_no_copy_at_the_boundary(
        tmp_path, before_first_step):
    # Nothing known of the copy: the group catches up while the other steps. The built ranks
    # reporting 1 MB of parameters: the first copy is foreseen at milliseconds, and a catch-up
    # would cost the live group the joining group's samples for a whole step; the copy goes over
    # the next segment's replicate group all the same, before its first step.
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.faults = {3: [Kill(rank=1, after_s=0.5)]}
    calls = []
    copy_state = scenario.fleet.copy_state
    scenario.fleet.copy_state = lambda pairs: calls.append(pairs) or copy_state(pairs)
    if before_first_step:
        builds_report_parameters(scenario.fleet, 10**6)
    assert scenario.run() == "completed"

    assert calls == []  # no copy at a boundary, where every group would wait for it over a pair group of its own
    [joining] = catch_up_segments(scenario)
    spec = next(iter(joining.values()))
    assert spec.catch_up.sources == {0: 2, 1: 3} and spec.catch_up.groups == {0}
    assert spec.catch_up.before_first_step is before_first_step
    assert set(joining) == {0, 1, 2, 3}  # group 0 steps in that segment from its first step
    samples = {record.step: record.group_samples for record in scenario.controller.history.step_results}
    first = spec.first_step
    batch = spec.global_batch
    if before_first_step:  # its share from the first step
        assert samples[first] == {0: batch // 2, 1: batch // 2}
    else:  # the segment's first step: group 0 takes no samples while its state lands; then its share
        assert samples[first] == {0: 0, 1: batch} and samples[first + 1] == {0: batch // 2, 1: batch // 2}
    [healed] = scenario.kinds(EventKind.GROUP_HEALED)
    assert (healed["group"], healed["source_group"], healed["caught_up_steps"]) == (0, 1, 0)
    assert (healed["overlapped"], healed["before_first_step"]) == (not before_first_step, before_first_step)
    assert healed["caught_up_at"] == (first if before_first_step else first + 1)
    assert healed["rank_to_rank_bytes"] == 2 * STATE_BYTES and healed["object_store_bytes"] == 0
    assert scenario.committed_steps() == list(range(12))


@pytest.mark.parametrize("before_first_step", [False, True], ids=["catch-up", "before-first-step"])
def test_a_catch_up_whose_copy_fails_heals_at_the_boundary_and_then_through_the_object_store(tmp_path,
                                                                                             before_first_step):
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.faults = {3: [Kill(rank=1, after_s=0.5)]}
    if before_first_step:  # a state foreseen to copy in a moment: taken before the segment's first step
        builds_report_parameters(scenario.fleet, 10**6)
    scenario.fleet.catch_up_failures = {1: "ChecksumMismatch: bucket 2 of 9 arrived with checksum 7, sent with 5"}
    scenario.fleet.heal_fallbacks = {1: "rank 1: ChecksumMismatch: bucket 2 of 9 arrived with checksum 7, sent with 5"}
    assert scenario.run() == "completed"

    # the catch-up's copy failed: group 0 held no state, built again and healed at the boundary
    discarded = scenario.kinds(EventKind.STEP_DISCARDED)
    assert [(e["step"], e["broken_groups"], e["culprits"]) for e in discarded] == [(3, [0], {1: "death"}), (3, [0], {})]
    assert "HealFailed" in discarded[1]["errors"][1]
    assert scenario.fleet.copies == [(2, 0), (3, 1), (2, 0), (3, 1)]  # the catch-up's, then the boundary's
    [catching_up] = catch_up_segments(scenario)
    assert next(iter(catching_up.values())).catch_up.before_first_step is before_first_step

    [fallback] = scenario.kinds(EventKind.HEAL_FALLBACK)
    assert (fallback["group"], fallback["source"], fallback["target"]) == (0, 3, 1)
    assert "ChecksumMismatch" in fallback["reason"] and fallback["bytes"] == STATE_BYTES
    assert console_line(fallback).startswith("rank 1 of group 0 healed through the object store")
    [healed] = scenario.kinds(EventKind.GROUP_HEALED)
    assert (healed["rank_to_rank_bytes"], healed["object_store_bytes"]) == (STATE_BYTES, STATE_BYTES)
    assert scenario.committed_steps() == list(range(12))


def test_a_hang_is_blamed_on_the_least_progressed_rank_and_its_blocked_peer_replaced(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.faults = {5: [Hang(rank=2)]}
    assert scenario.run() == "completed"

    [deadline] = scenario.kinds(EventKind.STEP_DEADLINE)
    assert deadline["hung"] == [2] and deadline["step"] == 5
    evicted = [(e["rank"], e["cause"]) for e in scenario.kinds(EventKind.RANK_EVICTED)]
    assert evicted == [(2, "hang"), (3, "stuck-in-collective")]
    assert scenario.fleet.kills == [2, 3]  # the hung rank before the drain, its blocked peer at eviction: once each
    assert scenario.kinds(EventKind.STEP_DISCARDED)[0]["broken_groups"] == [1]
    assert scenario.fleet.copies == [(0, 2), (1, 3)]  # group 0 kept its state and healed group 1
    assert scenario.kinds(EventKind.RECOVERED)[0]["cause"] == "hang"
    assert scenario.committed_steps() == list(range(12))


def test_a_peer_blocked_on_a_living_rank_that_left_the_step_is_released_not_replaced(tmp_path):
    # As a pipeline stage waits for activations from a neighbour that failed out of the step
    # (alive, its connections open): silent after the abort's settle, released, then victim.
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.faults = {5: [Kill(rank=3, blocks=(2,))]}
    assert scenario.run() == "completed"

    assert scenario.fleet.releases == [[2]]
    assert [(e["rank"], e["cause"]) for e in scenario.kinds(EventKind.RANK_EVICTED)] == [(3, "death")]
    assert scenario.fleet.kills == [3] and scenario.fleet.starts.count(2) == 1  # rank 2 kept its process
    [discarded] = scenario.kinds(EventKind.STEP_DISCARDED)
    assert discarded["broken_groups"] == [1] and "Connection closed" in discarded["errors"][2]
    assert scenario.fleet.copies == [(0, 2), (1, 3)]  # its group rebuilt and healed whole
    assert scenario.committed_steps() == list(range(12))


def test_a_collective_error_evicts_the_rank_that_raised_it(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1)
    scenario.fleet.faults = {2: [CollectiveError(rank=1)]}
    assert scenario.run() == "completed"

    assert [(e["rank"], e["cause"]) for e in scenario.kinds(EventKind.RANK_FAILED)] == [(1, "own-error")]
    [discarded] = scenario.kinds(EventKind.STEP_DISCARDED)
    assert discarded["culprits"] == {1: "own-error"} and discarded["broken_groups"] == [1]
    assert "bad collective" in discarded["errors"][1]
    assert scenario.fleet.copies == [(0, 1)]


def test_overlapping_failures_heal_both_groups_from_live_ones(tmp_path):
    # The first group is still starting its replacement when the second loses a rank.
    scenario = Scenario(tmp_path, groups=3, shard=1, steps=16, start_s=3.5)
    scenario.fleet.faults = {3: [Kill(rank=0)], 4: [Kill(rank=1)]}
    assert scenario.run() == "completed"

    assert [e["rank"] for e in scenario.kinds(EventKind.RANK_FAILED)] == [0, 1]
    assert min(scenario.live_groups_by_step()) == 1  # only group 2 trained for a while
    # group 0 healed from group 2, the only live one; group 1, back later, from group 0
    assert scenario.fleet.copies == [(2, 0), (0, 1)]
    assert scenario.live_groups_by_step()[-1] == 3
    assert scenario.committed_steps() == list(range(16))
    generations = [record.generation for record in scenario.records]
    assert generations == sorted(generations)  # a new generation for each change, never back


def test_a_group_placed_later_grows_the_quorum_healed_from_the_live_one(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, capacity=1)
    scenario.controller.step_listeners.append(
        lambda record: setattr(scenario.fleet, "capacity", 2) if record.step == 3 else None
    )
    assert scenario.run() == "completed"

    assert scenario.live_groups_by_step()[:4] == [1, 1, 1, 1]
    assert scenario.live_groups_by_step()[-1] == 2
    joined = scenario.kinds(EventKind.GROUP_JOINED)
    assert [e["group"] for e in joined] == [0, 1]
    assert scenario.fleet.copies == [(0, 2), (1, 3)]
    assert scenario.committed_steps() == list(range(12))
    assert scenario.kinds(EventKind.STEP_DISCARDED) == []


def test_below_the_minimum_the_run_stops_after_the_capacity_timeout(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, min_groups=2)
    scenario.fleet.faults = {2: [Kill(rank=1)]}
    scenario.controller.step_listeners.append(lambda record: scenario.fleet.unplaceable.add(1))
    with pytest.raises(TrainingStopped, match=r"below the minimum of 2 .*groups waiting: \{1: 'placing'\}"):
        scenario.run()
    assert scenario.committed_steps() == [0, 1]
    waited = scenario.clock() - scenario.events.started_at
    assert 30 < waited < 40  # capacity_timeout_s, on the fake clock


def test_ranks_that_start_slowly_but_steadily_are_waited_for_and_said_as_they_come(tmp_path):
    # A busy host: each rank process comes up 60 s after the one before, so a group takes
    # 180 s to start, past the wait's limit (capacity 30 s + the first step's 120 s) counted
    # from its beginning, but never that long without one more rank up.
    scenario = Scenario(tmp_path, groups=2, shard=4, min_groups=2, start_stagger_s=60.0)
    assert scenario.run() == "completed"
    starting = [(e["group"], e["started"], e["ranks"]) for e in scenario.kinds(EventKind.GROUP_STARTING)]
    assert sorted(starting) == [(group, started, 4) for group in (0, 1) for started in range(4)]
    assert console_line(scenario.kinds(EventKind.GROUP_STARTING)[-1]) == "group 1: 3 of 4 rank processes started (120s)"
    built = scenario.kinds(EventKind.GROUP_BUILT)[0]
    assert console_line(built).startswith("group 0 built in 180s (rank processes started in 180s")


def test_committed_time_is_charged_as_each_step_commits_not_when_its_segment_ends(tmp_path):
    # Goodput and elastic_time_seconds{category="committed"} read the ledger at each step.
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=12)
    seen = []
    scenario.controller.step_listeners.append(lambda record: seen.append(scenario.ledger.seconds["committed"]))
    assert scenario.run() == "completed"
    assert seen[0] > 0 and all(later > earlier for earlier, later in zip(seen, seen[1:])), seen
    assert 0 < scenario.ledger.goodput() <= 1


def test_a_failed_step_is_said_before_the_rank_it_costs(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.faults = {4: [Kill(rank=3)]}
    assert scenario.run() == "completed"
    kinds = [event["kind"] for event in scenario.events.events]
    assert kinds.index(EventKind.STEP_DISCARDED) < kinds.index(EventKind.RANK_EVICTED)
    lines = [console_line(event) for event in scenario.events.events if console_line(event)]
    assert lines.index("step 4 failed (death, ranks [3])") < lines.index("rank 3 of group 1 replaced (death)")


def test_a_straggler_is_replaced_when_a_slot_is_spare(tmp_path):
    scenario = Scenario(tmp_path, groups=4, shard=1, steps=40, stragglers=True, spare_slot=True)
    scenario.controller.step_listeners.append(
        lambda record: scenario.fleet.slow.update({2: 1.6}) if record.step == 9 else None
    )
    assert scenario.run() == "completed"

    [decided] = scenario.kinds(EventKind.STRAGGLER_DECIDED)
    assert (decided["action"], decided["rank"]) == ("replace", 2)
    assert [(e["rank"], e["cause"]) for e in scenario.kinds(EventKind.RANK_EVICTED)] == [(2, "straggler")]
    assert scenario.fleet.starts.count(2) == 2 and (0, 2) in scenario.fleet.copies
    assert scenario.kinds(EventKind.STEP_DISCARDED) == []  # replaced at a boundary: nothing rerun
    assert scenario.committed_steps() == list(range(40))
    assert scenario.records[-1].step_s == pytest.approx(1.0)  # the replacement runs at full speed


def test_a_straggler_in_the_group_that_uploads_a_checkpoint_is_replaced_once_the_upload_ends(tmp_path):
    """Replacing the rank kills its process, and with it the upload it runs: the replacement
    waits for the checkpoint to commit instead of failing it."""
    scenario = Scenario(tmp_path, groups=4, shard=1, steps=40, stragglers=True, spare_slot=True, checkpoint_every=12,
                        upload_s=12.0)
    scenario.controller.step_listeners.append(
        lambda record: scenario.fleet.slow.update({0: 1.6}) if record.step == 9 else None
    )
    assert scenario.run() == "completed"
    [decided] = scenario.kinds(EventKind.STRAGGLER_DECIDED)
    assert (decided["action"], decided["rank"]) == ("replace", 0)
    [uploaded] = [e for e in scenario.kinds(EventKind.CHECKPOINT_COMMITTED) if e["step"] == 12]
    assert uploaded["group"] == 0 and decided["t"] < uploaded["t"]  # decided while rank 0 uploaded
    [evicted] = scenario.kinds(EventKind.RANK_EVICTED)
    assert (evicted["rank"], evicted["cause"]) == (0, "straggler") and evicted["t"] >= uploaded["t"]
    assert scenario.kinds(EventKind.CHECKPOINT_FAILED) == []
    assert scenario.committed_steps() == list(range(40))


def test_checkpoints_commit_when_due(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=10, checkpoint_every=4, upload_s=0.5)
    assert scenario.run() == "completed"
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_STARTED)] == [4, 8, 10]
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_COMMITTED)] == [4, 8, 10]
    assert all(e["group"] == 0 for e in scenario.kinds(EventKind.CHECKPOINT_COMMITTED))
    assert scenario.checkpoints.latest().step == 10


def test_a_checkpoint_due_while_one_uploads_is_deferred_to_the_next_free_boundary(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=12, checkpoint_every=2, upload_s=3.5)
    assert scenario.run() == "completed"
    started = [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_STARTED)]
    deferred = scenario.kinds(EventKind.CHECKPOINT_DEFERRED)
    assert started == [2, 6, 10, 12]  # each upload spans about 3.5 steps
    # the last one: the final save waits the upload out, then saves step 12
    assert [(e["step"], e["in_flight_step"]) for e in deferred] == [(4, 2), (8, 6), (12, 10)]
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_COMMITTED)] == started


def test_a_driver_held_up_past_the_step_deadline_blames_no_one_for_the_records_sent_meanwhile(tmp_path):
    """The driver away from the streams longer than the step deadline (a listener that blocks,
    as tests/test_elastic_grow.py's does while a node starts; a commit to slow storage; a
    loaded host) is not the groups' silence: what they sent meanwhile is read before a hang
    is judged."""
    scenario = Scenario(tmp_path, groups=2, shard=2, steps=30, checkpoint_every=10, step_s=0.1)
    held_at = []

    def hold(event):
        if event["kind"] == EventKind.CHECKPOINT_COMMITTED and not held_at:
            held_at.append(event["step"])
            scenario.clock.sleep(6 * scenario.config.fault_tolerance.min_deadline_s)

    scenario.events.listeners.append(hold)
    assert scenario.run() == "completed"
    assert held_at == [10]
    assert scenario.kinds(EventKind.STEP_DEADLINE) == [] and scenario.kinds(EventKind.STEP_DISCARDED) == []
    assert scenario.fleet.kills == [] and scenario.committed_steps() == list(range(30))


def test_failed_saves_back_off_to_the_next_due_boundary_and_stop_the_run_when_they_persist(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=30, checkpoint_every=3, max_consecutive_failures=3)
    scenario.fleet.fail_uploads = True
    with pytest.raises(CheckpointsFailing, match="3 checkpoint saves failed in a row"):
        scenario.run()
    failed = scenario.kinds(EventKind.CHECKPOINT_FAILED)
    assert [e["consecutive"] for e in failed] == [1, 2, 3]
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_STARTED)] == [3, 6, 9]  # never every step
    assert "storage unreachable" in failed[0]["error"]
    assert scenario.kinds(EventKind.CHECKPOINT_COMMITTED) == []


def test_a_driver_that_lost_its_lease_commits_nothing_more(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=30, checkpoint_every=4, lease_ttl_s=6.5)
    with pytest.raises(LeaseLost, match="expired"):
        scenario.run()
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_COMMITTED)] == [4]
    assert scenario.committed_steps()[-1] < 12  # it stopped at the first commit after the expiry
    committed = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if (p / "manifest.json").exists()]
    assert committed == ["step-00000004"]


def test_an_upload_that_never_ends_fails_its_save_at_the_deadline_and_the_next_due_save_goes_ahead(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, steps=60, checkpoint_every=10,
                        config={"checkpoint__upload_timeout_s": 15.0})
    scenario.fleet.stuck_steps = {20}  # as a stalled mount: the upload writes part of its files, then hangs
    assert scenario.run() == "completed"

    [failed] = scenario.kinds(EventKind.CHECKPOINT_FAILED)
    started = next(e for e in scenario.kinds(EventKind.CHECKPOINT_STARTED) if e["step"] == 20)
    assert (failed["step"], failed["consecutive"]) == (20, 1)
    assert "checkpoint.upload_timeout_s (15 s)" in failed["error"]
    assert 15.0 <= failed["t"] - started["t"] < 16.0  # seen between steps, not at the next boundary
    assert scenario.fleet.abandoned == [(0, 1)]  # the saving group's ranks killed their uploads
    assert scenario.kinds(EventKind.CHECKPOINTS_DELETED)[0]["steps"] == [20]
    assert not (tmp_path / "run" / "checkpoints" / "step-00000020").exists()
    # 30 fell due while 20 hung; once 20 failed, the next due save started
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_DEFERRED)] == [30]
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_STARTED)] == [10, 20, 40, 50, 60]
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_COMMITTED)] == [10, 40, 50, 60]


def test_uploads_that_keep_hanging_stop_the_run_after_max_consecutive_failures(tmp_path):
    scenario = Scenario(tmp_path, groups=1, steps=100, checkpoint_every=10, max_consecutive_failures=3,
                        config={"checkpoint__upload_timeout_s": 5.0})
    scenario.fleet.stuck_steps = set(range(10, 101, 10))
    scenario.fleet.control_faults = {"abandon_checkpoint": [(0, "raise")]}  # the first abandon is not confirmed
    with pytest.raises(CheckpointsFailing, match="3 checkpoint saves failed in a row, the last at step 30"):
        scenario.run()
    failed = scenario.kinds(EventKind.CHECKPOINT_FAILED)
    assert [(e["step"], e["consecutive"]) for e in failed] == [(10, 1), (20, 2), (30, 3)]
    assert all("checkpoint.upload_timeout_s (5 s)" in e["error"] for e in failed)
    assert "ranks [0] did not confirm they stopped it" in failed[0]["error"]
    assert scenario.fleet.abandoned == [(0,)] * 2
    assert scenario.kinds(EventKind.CHECKPOINT_COMMITTED) == []


def test_an_upload_hanging_past_the_grace_period_fails_the_final_checkpoint_with_a_failed_save(tmp_path):
    scenario = Scenario(tmp_path, groups=1, steps=12, checkpoint_every=10,
                        config={"checkpoint__upload_timeout_s": 600.0, "checkpoint__grace_s": 5.0})
    scenario.fleet.stuck_steps = {10}
    assert scenario.run().startswith("completed, final checkpoint missed (step 12): see the checkpoint-failed events")
    [failed] = scenario.kinds(EventKind.CHECKPOINT_FAILED)
    assert failed["step"] == 10 and "checkpoint.grace_s" in failed["error"]
    assert scenario.fleet.abandoned == [(0,)]
    assert [e["step"] for e in scenario.kinds(EventKind.FINAL_CHECKPOINT_MISSED)] == [12]


def test_a_driver_that_lost_its_lease_stages_and_uploads_nothing(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=30, checkpoint_every=4, lease_ttl_s=3.5)
    with pytest.raises(LeaseLost, match="expired"):
        scenario.run()  # the lease ran out before the first save was due
    assert scenario.fleet.saves == [] and scenario.kinds(EventKind.CHECKPOINT_STARTED) == []
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_heal_source_dying_mid_copy_is_a_new_failure_and_the_run_restarts_from_the_initial_state(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.faults = {3: [Kill(rank=1, after_s=0.5)]}
    scenario.fleet.catch_up_failures = {0: "RuntimeError: Connection closed by peer"}  # then healed at the boundary
    scenario.fleet.control_faults = {"import_state": [(2, "die")]}  # group 1, the only source, loses rank 2
    assert scenario.run() == "completed"

    failed = scenario.kinds(EventKind.RANK_FAILED)
    assert [(e["rank"], e["cause"]) for e in failed] == [(1, "death"), (2, "death")]
    assert failed[1]["during"] == "atboundary" and "died during import_state" in failed[1]["error"]
    # no live copy and no checkpoint: the seed's initial state is the restore point, not a stop
    [restart] = scenario.kinds(EventKind.RESTORED_INITIAL_STATE)
    assert restart["rolled_back_steps"] == 3 and sorted(restart["groups"]) == [0, 1]
    assert scenario.committed_steps() == [0, 1, 2, *range(12)]  # steps 0-2 rerun from the initial state
    assert [record.step for record in scenario.controller.history.step_results] == list(range(12))


def test_both_copies_of_a_shard_lost_with_the_memory_tier_off_rerun_from_step_0_before_a_checkpoint(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, checkpoint_every=5, config={"checkpoint__memory_every": 0})
    scenario.fleet.faults = {3: [Kill(rank=0, after_s=0.3), Kill(rank=2, after_s=0.5)]}
    assert scenario.run() == "completed"
    [restart] = scenario.kinds(EventKind.RESTORED_INITIAL_STATE)
    assert restart["rolled_back_steps"] == 3
    assert scenario.committed_steps() == [0, 1, 2, *range(12)]
    assert [e["step"] for e in scenario.kinds(EventKind.CHECKPOINT_COMMITTED)] == [5, 10, 12]


def test_a_flipped_bit_is_found_at_the_next_check_and_the_odd_group_heals_from_the_majority(tmp_path):
    scenario = Scenario(tmp_path, groups=3, shard=2, steps=15, config={"integrity__every": 5})
    scenario.fleet.faults = {7: [Flip(rank=3)]}  # group 1, position (0, 1, 0, 0)
    assert scenario.run() == "completed"

    [found] = scenario.kinds(EventKind.INTEGRITY_MISMATCH)
    assert (found["step"], found["position"], found["suspects"], found["majority"]) == (10, [0, 1, 0, 0], [1], [0, 2])
    [discarded] = scenario.kinds(EventKind.STEP_DISCARDED)
    assert (discarded["step"], discarded["cause"], discarded["broken_groups"]) == (10, "integrity-mismatch", [1])
    # every rank is healthy: none is evicted or restarted; group 1 rebuilds and heals from group 0
    assert scenario.fleet.kills == [] and scenario.kinds(EventKind.RANK_FAILED) == []
    assert scenario.fleet.copies == [(0, 2), (1, 3)] and scenario.fleet.corrupt == set()
    assert scenario.fleet.restores == []
    assert scenario.committed_steps() == list(range(15))  # step 10 ran again; nothing rolled back
    [recovered] = scenario.kinds(EventKind.RECOVERED)
    assert recovered["cause"] == "integrity-mismatch"


def test_with_two_groups_both_are_suspect_and_restore_the_newest_checkpoint_the_check_verified(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, steps=14, checkpoint_every=4, config={"integrity__every": 5})
    scenario.fleet.faults = {7: [Flip(rank=2)]}
    assert scenario.run() == "completed"

    [found] = scenario.kinds(EventKind.INTEGRITY_MISMATCH)
    assert (found["step"], found["suspects"], found["majority"]) == (10, [0, 1], [])
    # the check at step 5 passed, at step 10 it failed: the checkpoint of step 8 may hold the
    # corruption (one group saved it, either may be the odd one), the one of step 4 cannot
    [restored] = scenario.kinds(EventKind.RESTORED_FROM_CHECKPOINT)
    assert (restored["step"], restored["rolled_back_steps"], sorted(restored["groups"])) == (4, 6, [0, 1])
    assert scenario.fleet.corrupt == set() and scenario.fleet.kills == []
    assert scenario.committed_steps() == [*range(10), *range(4, 14)]
    assert scenario.controller.history.steps_rolled_back == 6


def test_both_copies_of_a_shard_lost_come_back_from_their_buddies_memory_losing_no_step(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, checkpoint_every=4, config={"checkpoint__memory_every": 1})
    scenario.fleet.faults = {6: [Kill(rank=0, after_s=0.3), Kill(rank=2, after_s=0.5)]}
    assert scenario.run() == "completed"

    assert scenario.fleet.buddies == {0: 3, 1: 2, 2: 1, 3: 0}  # another group, another position
    [restored] = scenario.kinds(EventKind.RESTORED_FROM_MEMORY)
    # the state at step 6 (after step 5): ranks 1 and 3 from their own copies, ranks 0 and 2
    # (fresh processes) from their buddies' (3 and 1)
    assert (restored["step"], restored["rolled_back_steps"], restored["from_buddies"]) == (6, 0, [0, 2])
    [plan] = scenario.fleet.memory_restores
    assert (plan.own, plan.transfers) == ((1, 3), ((3, 0), (1, 2)))
    assert scenario.fleet.restores == []  # nothing read from storage
    assert scenario.kinds(EventKind.RESTORED_FROM_CHECKPOINT) == []
    assert scenario.committed_steps() == list(range(12))  # step 6 reran; none before it


def test_a_single_group_that_loses_a_rank_rolls_back_at_most_memory_every_steps(tmp_path):
    scenario = Scenario(tmp_path, groups=1, shard=2, steps=14, checkpoint_every=10,
                        config={"checkpoint__memory_every": 4})
    scenario.fleet.faults = {7: [Kill(rank=1, after_s=0.3)]}
    assert scenario.run() == "completed"

    [restored] = scenario.kinds(EventKind.RESTORED_FROM_MEMORY)
    assert (restored["step"], restored["rolled_back_steps"], restored["from_buddies"]) == (4, 3, [1])
    assert scenario.fleet.restores == []
    assert scenario.committed_steps() == [*range(7), *range(4, 14)]


def test_a_rank_and_its_buddy_lost_together_fall_back_to_the_checkpoint(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, checkpoint_every=4, config={"checkpoint__memory_every": 1})
    # rank 0's copy lives on rank 3: both gone, and rank 2 with them (group 1 broken too)
    scenario.fleet.faults = {6: [Kill(rank=0, after_s=0.3), Kill(rank=3, after_s=0.4), Kill(rank=2, after_s=0.5)]}
    assert scenario.run() == "completed"

    assert scenario.kinds(EventKind.RESTORED_FROM_MEMORY) == []
    [restored] = scenario.kinds(EventKind.RESTORED_FROM_CHECKPOINT)
    assert restored["step"] == 4


def test_each_cross_group_rebuild_is_a_new_build_that_the_next_segment_carries_over_its_groups(tmp_path):
    """The ranks enter the cross-group groups the segment's spec names: each rebuild a new build
    over the groups it was made for, a boundary that changes nothing (the checkpoints) keeps
    it, and a build the quorum changed again before any segment ran (the survivors' after the
    kill, when the replacement joined before they stepped) is never entered: one regroup."""
    scenario = Scenario(tmp_path, groups=3, shard=1, steps=12, checkpoint_every=3)
    scenario.fleet.faults = {4: [Kill(rank=2, after_s=0.5)]}
    assert scenario.run() == "completed"
    segments = [next(iter(specs.values())) for specs in scenario.fleet.segments]
    rebuilt = {event["build"]: tuple(event["groups"]) for event in scenario.kinds(EventKind.GROUPS_REBUILT)}
    assert rebuilt == {1: (0, 1, 2), 2: (0, 1), 3: (0, 1, 2)}
    assert [(spec.first_step, spec.replicas_build) for spec in segments] == [(0, 1), (3, 1), (4, 3), (6, 3), (9, 3)]
    assert all(spec.groups == rebuilt[spec.replicas_build] for spec in segments)
    assert scenario.committed_steps() == list(range(12))


def test_a_death_as_the_survivors_enter_their_new_cross_group_groups_replaces_only_the_dead_rank(tmp_path):
    scenario = Scenario(tmp_path, groups=3, shard=1)
    scenario.fleet.faults = {3: [Kill(rank=0, after_s=0.5)]}

    def dies_as_the_step_is_redone(event):  # the survivors enter the new build's groups as its segment starts
        if event["kind"] == EventKind.RANK_EVICTED and event["rank"] == 0:
            scenario.fleet.faults[3] = [Kill(rank=2, after_s=0.0)]

    scenario.events.listeners.append(dies_as_the_step_is_redone)
    assert scenario.run() == "completed"
    assert [(e["rank"], e["cause"]) for e in scenario.kinds(EventKind.RANK_EVICTED)] == [(0, "death"), (2, "death")]
    assert scenario.kinds(EventKind.RESTORED_INITIAL_STATE) == []  # group 1 stayed live and healed both
    assert scenario.committed_steps() == list(range(12))
    assert scenario.live_groups_by_step()[-1] == 3


def test_a_rank_raising_in_a_boundary_call_is_replaced_and_its_group_healed(tmp_path):
    # Steps need no control call any more; the heal of a group joining at a boundary is one.
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=12, checkpoint_every=4, capacity=1)
    scenario.controller.step_listeners.append(
        lambda record: setattr(scenario.fleet, "capacity", 2) if record.step == 3 else None)
    scenario.fleet.catch_up_failures = {1: "RuntimeError: Connection closed by peer"}  # then healed at the boundary
    scenario.fleet.control_faults = {"import_state": [(1, "raise")]}  # group 1's first heal at a boundary
    assert scenario.run() == "completed"
    [failed] = scenario.kinds(EventKind.RANK_FAILED)
    assert (failed["rank"], failed["cause"]) == (1, "control-error")
    assert scenario.fleet.copies == [(0, 1), (0, 1)]  # the catch-up's, then the boundary heal after the one raised
    assert scenario.committed_steps() == list(range(12))
    # one recovery, opened by the catch-up's failure and extended by the heal's, until the next commit
    assert [e["cause"] for e in scenario.kinds(EventKind.RECOVERED)] == ["collective-error"]


def test_every_control_call_failing_is_bounded_by_the_recovery_budget(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1, steps=12, max_recoveries=3)
    scenario.fleet.faults = {2: [Kill(rank=0, after_s=0.5)]}
    scenario.fleet.catch_up_failures = {0: "RuntimeError: Connection closed by peer"}  # then healed at the boundary

    def every_heal_fails(pairs):
        raise CallFailed([pairs[0][1]], "RuntimeError: import failed", "import_state")

    scenario.fleet.copy_state = every_heal_fails
    with pytest.raises(TrainingStopped, match="a control call failed while .* after 3 recoveries"):
        scenario.run()
    # the kill and the first failed heal at a boundary (the catch-up's failed copy blames no rank)
    assert len(scenario.kinds(EventKind.RANK_FAILED)) == 2


HOOK_ERROR = "AttributeError: 'Transformer' object has no attribute 'blocks' (at train.py:12 in parallelize)"


def test_hooks_that_fail_on_every_rank_stop_the_run_at_once_evicting_no_one(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2)
    scenario.fleet.hook_errors = dict.fromkeys(range(4), HOOK_ERROR)
    with pytest.raises(TrainingStopped) as stopped:
        scenario.run()
    assert str(stopped.value) == (f"groups [0, 1] failed to start: ranks [0, 1, 2, 3] raised the same error: "
                                  f"{HOOK_ERROR} (the code or the data, not the cluster; fix it and resume)")
    assert scenario.fleet.starts == [0, 1, 2, 3] and scenario.fleet.kills == []
    assert scenario.kinds(EventKind.RANK_FAILED) == [] and scenario.clock() - 1000 < 5  # no retries, no waiting


def test_a_hook_that_fails_on_one_rank_stops_when_its_fresh_process_fails_the_same_way(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=1)
    scenario.fleet.hook_errors = {1: HOOK_ERROR}
    with pytest.raises(TrainingStopped, match=r"^groups \[1\] failed to start: the same error again on fresh "
                                              r"processes: AttributeError"):
        scenario.run()
    assert scenario.fleet.starts.count(1) == 2  # replaced once, as any failed rank is


def test_a_group_whose_rendezvous_fails_is_started_again(tmp_path):
    """A failed build that is not the hooks' (a rendezvous timing out on a loaded node) is
    retried like any failure, not taken for an error in the user's code."""
    scenario = Scenario(tmp_path, groups=2, shard=1)
    scenario.fleet.control_faults = {"build": [(0, "raise")]}
    assert scenario.run() == "completed"
    assert [event["group"] for event in scenario.kinds(EventKind.GROUP_START_FAILED)] == [0]
    assert scenario.committed_steps() == list(range(12))


def test_each_commit_carries_its_steps_scheduled_lr_and_clipping_factor(tmp_path):
    clip = {"optimizer__warmup_steps": 3, "optimizer__schedule": "cosine", "optimizer__clip_grad_norm": 0.5}
    scenario = Scenario(tmp_path, groups=2, shard=2, config=clip, grad_sq_norm=2.0)
    assert scenario.run() == "completed"
    schedule = scenario.config.lr_schedule
    norm = 2.0  # each of a group's two ranks holds half of the squared norm 4
    scale = 0.5 / (norm + 1e-6)
    for record in scenario.records:
        assert record.lr == schedule.lr(record.step)
        assert record.grad_norm == pytest.approx(norm) and record.grad_clip_scale == pytest.approx(scale)
    # the ranks compute each step's factor from the schedule and the clipping bound they were handed
    for specs in scenario.fleet.segments:
        assert {spec.schedule for spec in specs.values()} == {schedule}
        assert {spec.clip_grad_norm for spec in specs.values()} == {0.5}


def test_a_discarded_step_is_committed_at_its_own_lr_when_it_reruns(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, config={"optimizer__schedule": "linear"})
    scenario.fleet.faults = {3: [Kill(rank=1, after_s=0.5)]}
    assert scenario.run() == "completed"
    schedule = scenario.config.lr_schedule
    # the failed run discarded step 3 (nothing of it committed); the next run starts at step 3,
    # and every rank takes step 3's factor from the same schedule
    assert [specs[0].first_step for specs in scenario.fleet.segments] == [0, 3]
    assert scenario.committed_steps() == list(range(12))
    assert [record.lr for record in scenario.records] == [schedule.lr(step) for step in range(12)]
    assert all(spec.schedule == schedule for spec in scenario.fleet.segments[1].values())


def test_evaluation_runs_every_n_steps_and_after_the_last_split_across_live_groups(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, config={"eval__every": 5, "eval__samples": 24}, eval_len=100)
    assert scenario.run() == "completed"
    evals = scenario.controller.history.eval_results
    assert [record.step for record in evals] == [5, 10, 12]
    assert all(record.samples == 24 for record in evals)
    eval_requests = scenario.fleet.evaluations
    assert len(eval_requests) == 3
    for requests in eval_requests:
        samples = sorted(i for request in requests.values() for mb in request.micro_batches for i in mb if i >= 0)
        # every held-out sample once per TP row; shard positions of both groups cover 0..23
        assert samples == list(range(24))
        assert all(request.global_tokens == 24 * scenario.config.data.seq_len for request in requests.values())
    assert scenario.committed_steps() == list(range(12))
    assert [e["step"] for e in scenario.kinds(EventKind.EVALUATED)] == [5, 10, 12]
    assert scenario.ledger.breakdown()["evaluation"] > 0


def test_a_failed_evaluation_recovers_and_runs_again_without_discarding_a_step(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, config={"eval__every": 5}, eval_len=100)
    scenario.fleet.faults = {5: [Kill(rank=1, after_s=0.2)]}  # step 5's first dispatch is the evaluation
    assert scenario.run() == "completed"
    [discarded] = scenario.kinds(EventKind.EVAL_DISCARDED)
    assert discarded["step"] == 5 and discarded["cause"] == "death"
    assert scenario.kinds(EventKind.STEP_DISCARDED) == [] and scenario.controller.history.steps_discarded == 0
    assert [record.step for record in scenario.controller.history.eval_results] == [5, 10, 12]
    assert scenario.committed_steps() == list(range(12))


def test_a_restore_gives_each_rank_the_generators_saved_at_its_position(tmp_path):
    scenario = Scenario(tmp_path, groups=2, shard=2, checkpoint_every=4, config={"checkpoint__memory_every": 0})
    scenario.fleet.faults = {6: [Kill(rank=0, after_s=0.3), Kill(rank=2, after_s=0.5)]}
    assert scenario.run() == "completed"
    [restored] = scenario.kinds(EventKind.RESTORED_FROM_CHECKPOINT)
    assert restored["step"] == 4
    [generators] = scenario.fleet.restored_generators
    # group 0 (ranks 0, 1) saved; shard position p of every group gets rank p's stream
    assert generators == {rank: {"cpu": f"generator of rank {rank % 2}".encode()} for rank in range(4)}
    assert scenario.kinds(EventKind.RNG_RESEEDED) == []


class SampleLedger:
    """Which samples the ranks trained in each committed step, computed with the ranks' own
    planning (``rank_share``) from the segment specs the controller handed them."""

    def __init__(self, scenario: Scenario):
        self.scenario = scenario
        self.trained: dict[int, tuple[int, dict[int, list[int]]]] = {}  # step -> (epoch, samples by group); a rerun overwrites
        self.cursor_after: dict[int, object] = {}
        scenario.controller.step_listeners.append(self.on_step)

    def on_step(self, record: StepResult) -> None:
        step, controller = record.step, self.scenario.controller
        spec = next(iter(self.scenario.fleet.segments[-1].values()))  # the run that committed it
        cursor = spec.cursor if step == spec.first_step else self.cursor_after[step - 1]
        shard = self.scenario.topology.shard
        by_group = {group: [index for shard_index in range(shard)
                            for micro_batch in rank_share(spec, step, cursor, group, shard_index, shard).micro_batches
                            for index in micro_batch if index != PADDING_INDEX]
                    for group in spec.groups}
        share = rank_share(spec, step, cursor, spec.groups[0], 0, shard)
        self.trained[step] = (share.epoch, by_group)
        self.cursor_after[step] = controller.history.cursor

    def committed_by_group(self) -> list[tuple[int, dict[int, list[int]]]]:
        return [self.trained[record.step] for record in self.scenario.controller.history.step_results]

    def committed(self) -> list[tuple[int, list[int]]]:
        return [(epoch, [index for samples in by_group.values() for index in samples])
                for epoch, by_group in self.committed_by_group()]


def test_every_sample_of_an_epoch_is_trained_once_across_kills_a_grow_a_shrink_and_a_resume(tmp_path):
    dataset_len = 100  # 12 steps of 8 an epoch; the 4-sample tail is skipped
    first = Scenario(tmp_path, groups=3, shard=2, steps=30, checkpoint_every=6, capacity=2, dataset_len=dataset_len)
    fleet = first.fleet

    def cluster(record: StepResult) -> None:
        if record.step == 7:
            fleet.capacity = 3  # a third group is placed: grow
        if record.step == 17:
            fleet.unplaceable.add(2)  # group 2's rank dies at step 19 and cannot be placed again: shrink

    first.controller.step_listeners.append(cluster)
    fleet.faults = {12: [Kill(rank=1, after_s=0.4)], 19: [Kill(rank=4, after_s=0.3)]}
    ledger = SampleLedger(first)
    assert first.run() == "completed"
    assert max(first.live_groups_by_step()) == 3 and first.live_groups_by_step()[-1] == 2
    assert len(first.kinds(EventKind.STEP_DISCARDED)) == 2

    resumed = Scenario(tmp_path, groups=3, shard=2, steps=50, checkpoint_every=6, capacity=2,
                       dataset_len=dataset_len, resume=True)
    resumed.fleet.faults = {36: [Kill(rank=2, after_s=0.5)]}
    second = SampleLedger(resumed)
    assert resumed.run() == "completed"
    assert [record.step for record in resumed.controller.history.step_results] == list(range(30, 50))

    history = ledger.committed() + second.committed()
    assert len(history) == 50
    by_epoch: dict[int, list[int]] = {}
    for epoch, samples in history:
        by_epoch.setdefault(epoch, []).extend(samples)
    assert sorted(by_epoch) == [0, 1, 2, 3, 4]
    seed = first.config.seed
    for epoch, samples in by_epoch.items():
        assert len(samples) == len(set(samples)), f"epoch {epoch}: a sample trained twice"
        # exactly the epoch's order up to where training stands in it: nothing skipped
        assert set(samples) == set(epoch_order(dataset_len, seed, epoch)[: len(samples)].tolist())
    assert [len(by_epoch[epoch]) for epoch in range(4)] == [96] * 4  # whole epochs, less the tail


def test_a_diloco_learner_dropped_inside_a_round_has_its_samples_trained_once_by_the_others(tmp_path):
    """``sync.lost_learner = "drop"``: what a learner trained of its round before it was lost is
    not in the round's outer step, so those samples go back into the data plan, and the next
    steps train them first: over the epochs every sample is trained once. Group 1 is dropped
    twice in one round (back from the round's start in between): its first steps go back once."""
    dataset_len = 100  # 12 steps of 8 an epoch; the 4-sample tail is skipped
    scenario = Scenario(tmp_path, groups=3, steps=36, dataset_len=dataset_len,
                        config={"sync__mode": "diloco", "sync__outer_every": 4, "sync__lost_learner": "drop"})
    scenario.fleet.faults = {6: [Kill(rank=1, after_s=0.4)], 7: [Kill(rank=1, after_s=0.4)], 10: [Kill(rank=2, after_s=0.4)]}
    ledger = SampleLedger(scenario)
    assert scenario.run() == "completed"
    dropped = scenario.kinds(EventKind.LEARNER_DROPPED)
    assert [(event["step"], event["groups"], event["round_start"]) for event in dropped] == [(6, [1], 4), (7, [1], 4), (10, [2], 8)]
    assert not scenario.kinds(EventKind.ROUND_REDONE) and scenario.controller.history.steps_rolled_back == 0
    by_epoch: dict[int, list[int]] = {}
    for step, (epoch, by_group) in enumerate(ledger.committed_by_group()):
        lost = {group for event in dropped for group in event["groups"] if event["round_start"] <= step < event["step"]}
        by_epoch.setdefault(epoch, []).extend(index for group, samples in by_group.items() if group not in lost
                                              for index in samples)
    assert all(event["returned_samples"] > 0 for event in dropped)
    for epoch, samples in by_epoch.items():
        assert len(samples) == len(set(samples)), f"epoch {epoch}: a sample trained twice"
        assert set(samples) == set(epoch_order(dataset_len, scenario.config.seed, epoch)[: len(samples)].tolist())
    assert [len(by_epoch[epoch]) for epoch in range(2)] == [96] * 2


def test_every_sample_of_every_source_of_a_mixture_is_trained_once_across_a_kill_a_resize_and_a_resume(
        tmp_path, s3_server):
    """A Parquet source on S3 and a JSONL source on local disk, mixed 2:1: the ledger of the
    mixture's samples, mapped to each source's own, never trains a source's sample twice in
    one pass over that source, nor passes one by; the data plan's cursor alone tells how many
    of each were trained."""
    pq = pytest.importorskip("pyarrow.parquet")
    import json

    import pyarrow as pa

    from elastic.data.mixture import at_epoch
    from elastic.setup.dataset import default_datasets, generate_corpus
    from elastic.setup.preflight import build_config

    documents = generate_corpus(12_000, 7).decode().split(". ")
    pq.write_table(pa.table({"text": documents[:150]}), tmp_path / "a.parquet", row_group_size=32)
    s3_server.filesystem().put(str(tmp_path / "a.parquet"), f"{s3_server.bucket}/a.parquet")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in documents[150:300]))
    mixture = default_datasets(build_config({
        "data": {"seq_len": 64, "sources": [{"path": s3_server.url("a.parquet"), "weight": 2},
                                            {"path": str(tmp_path / "b.jsonl"), "weight": 1}]},
        "global_batch": 8, "seed": 3,  # the scenario's
        "checkpoint": {"s3_endpoint_url": s3_server.endpoint_url}}))[0]
    dataset_len = len(mixture)
    first = Scenario(tmp_path, groups=3, shard=2, steps=24, checkpoint_every=6, capacity=3, dataset_len=dataset_len)
    first.fleet.faults = {9: [Kill(rank=1, after_s=0.4)]}
    first.controller.step_listeners.append(lambda record: record.step == 14 and first.fleet.unplaceable.add(2))
    first.fleet.faults[16] = [Kill(rank=4, after_s=0.3)]  # group 2 cannot come back: the run shrinks to 2
    ledger = SampleLedger(first)
    assert first.run() == "completed"
    assert first.live_groups_by_step()[0] == 3 and first.live_groups_by_step()[-1] == 2
    resumed = Scenario(tmp_path, groups=3, shard=2, steps=40, checkpoint_every=6, capacity=3,
                       dataset_len=dataset_len, resume=True)
    second = SampleLedger(resumed)
    assert resumed.run() == "completed"

    history = ledger.committed() + second.committed()
    assert len(history) == 40
    drawn: dict[tuple[int, int], list[int]] = {}  # (source, its own pass) -> its samples trained
    for epoch, samples in history:
        view = at_epoch(mixture, epoch)
        for index in samples:
            source, source_pass, sample = view.locate(index)
            drawn.setdefault((source, source_pass), []).append(sample)
    assert max(epoch for epoch, _ in history) >= 2  # the mixture went round more than twice
    assert {source for source, _ in drawn} == {0, 1}
    under_way = max(epoch for epoch, _ in history)  # the epochs before it are whole
    for (source, source_pass), samples in drawn.items():
        assert len(samples) == len(set(samples)), f"source {source}, pass {source_pass}: a sample trained twice"
        size = mixture.sizes[source]
        if (source_pass + 1) * size <= under_way * mixture.counts[source]:  # the pass lies in whole epochs
            assert len(samples) == size, f"source {source}, pass {source_pass}: samples passed by"
    trained = [sum(len(samples) for (s, _), samples in drawn.items() if s == source) for source in (0, 1)]
    assert abs(trained[0] / sum(trained) - 2 / 3) < 0.05
    assert mixture.trained_before(resumed.controller.history.cursor).tolist() == trained


def test_a_flip_between_checks_rolls_every_group_back_to_the_verified_copy_in_memory(tmp_path):
    # The flip at step 7 goes into every group's update through the gradient sums until the
    # check at step 10 finds it: the majority is not clean either. The check at step 5 passed
    # and every rank holds its copy of step 5: all three groups go back to it.
    scenario = Scenario(tmp_path, groups=3, shard=2, steps=15,
                        config={"integrity__every": 5, "checkpoint__memory_every": 5})
    scenario.fleet.faults = {7: [Flip(rank=3)]}
    assert scenario.run() == "completed"

    [found] = scenario.kinds(EventKind.INTEGRITY_MISMATCH)
    assert (found["step"], found["suspects"], found["majority"]) == (10, [1], [0, 2])
    [restored] = scenario.kinds(EventKind.RESTORED_FROM_MEMORY)
    assert (restored["step"], restored["rolled_back_steps"], sorted(restored["groups"])) == (5, 5, [0, 1, 2])
    assert scenario.fleet.copies == [] and scenario.fleet.corrupt == set() and scenario.fleet.kills == []
    assert scenario.committed_steps() == [*range(10), *range(5, 15)]


def test_a_group_joined_to_catch_up_heals_at_once_when_another_fails_to_start_before_the_run_steps(tmp_path):
    # Ranks 0 and 2 die in one step; their groups start again side by side. Group 0 is built
    # and joins to catch up in the next segment, but group 2's build loses its rank first: the
    # run recovers before it steps again, so group 0 takes its state at this boundary.
    scenario = Scenario(tmp_path, groups=3, shard=1)
    scenario.fleet.faults = {3: [Kill(rank=0, after_s=0.5), Kill(rank=2, after_s=0.5)]}
    build = scenario.fleet.build

    def build_losing_rank_2_once(ranks, world_build):
        if 2 in list(ranks) and scenario.fleet.starts.count(2) == 2:
            scenario.fleet.alive_ranks.discard(2)
            raise RanksLost([2], "ranks [2] died during build", "build")
        return build(ranks, world_build)

    scenario.fleet.build = build_losing_rank_2_once
    assert scenario.run() == "completed"

    [start_failed] = scenario.kinds(EventKind.GROUP_START_FAILED)
    assert start_failed["group"] == 2
    healed = scenario.kinds(EventKind.GROUP_HEALED)
    assert [(e["group"], e.get("overlapped", False)) for e in healed][0] == (0, False)
    assert scenario.fleet.copies[0] == (1, 0)  # at the boundary, from group 1, before any segment
    catching_up = [next(iter(specs.values())).catch_up for specs in scenario.fleet.segments]
    assert all(catch_up is None or 0 not in catch_up.groups for catch_up in catching_up)
    assert scenario.committed_steps() == list(range(12))
    assert scenario.live_groups_by_step()[-1] == 3


def test_a_boundary_mid_segment_is_asked_of_one_rank_whatever_the_number_of_groups(tmp_path):
    # Two groups placed of four, two more once capacity comes: the join needs a boundary. One
    # rank is asked to pause; its flag goes through the cross-group sum and every group's vote
    # (real ranks: every test whose groups join mid-run, such as test_elastic_grow).
    scenario = Scenario(tmp_path, groups=4, shard=2, capacity=2)
    scenario.controller.step_listeners.append(
        lambda record: setattr(scenario.fleet, "capacity", 4) if record.step == 3 else None)
    assert scenario.run() == "completed"
    assert scenario.fleet.paused_ranks and all(len(ranks) == 1 for ranks in scenario.fleet.paused_ranks)
    assert scenario.live_groups_by_step()[-1] == 4
    assert scenario.committed_steps() == list(range(12))

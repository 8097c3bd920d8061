"""The driver's pure core, decision by decision: no Ray, no torch, milliseconds each."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.core.data_plan import PADDING_INDEX, DataCursor, group_weights, plan_step
from elastic.core.diagnosis import Cause, Diagnosis
from elastic.core.events import EventKind, EventLog
from elastic.core.faults import Fault, FaultSchedule, FaultSpecError, InjectedFault, InjectedSegmentSpec, parse_faults
from elastic.core.membership import (
    Broken,
    Built,
    GroupStage,
    IllegalTransition,
    Joined,
    Membership,
    Placed,
    Started,
    transition,
)
from elastic.core.policies import FailurePolicy, StepDeadline
from elastic.core.recovery import plan_recovery
from elastic.core.lr_schedule import LRSchedule
from elastic.core.protocol import SegmentSpec
from elastic.core.topology import Topology

def test_topology_numbers_ranks_by_group_then_stage_then_shard_then_cp_then_tp():
    topology = Topology(shard=2, tp=3, max_groups=4)
    assert topology.ranks_per_group == 6 and topology.max_ranks == 24
    assert list(topology.global_ranks(2)) == list(range(12, 18))
    assert topology.ranks_of([0, 3]) == [0, 1, 2, 3, 4, 5, 18, 19, 20, 21, 22, 23]
    rank = 2 * 6 + 1 * 3 + 2  # group 2, shard index 1, tp index 2
    assert topology.group_of(rank) == 2
    assert topology.group_rank(rank) == 5
    assert topology.position_of(rank) == (0, 1, 2, 0) and topology.shard_index(rank) == 1
    assert [topology.counts_loss(r) for r in topology.global_ranks(0)] == [True, False, False, True, False, False]
    assert [topology.stream_of(r) for r in topology.global_ranks(0)] == ["0", "0", "0", "1", "1", "1"]
    assert topology.record() == {"pp": 1, "shard": 2, "cp": 1, "tp": 3, "ep": 1, "max_groups": 4}

    staged = Topology(shard=2, tp=2, max_groups=2, pp=3)
    assert staged.ranks_per_group == 12
    rank = 12 + 2 * 4 + 1 * 2 + 1  # group 1, stage 2, shard index 1, tp index 1
    assert staged.position_of(rank) == (2, 1, 1, 0) and staged.group_rank(rank) == 11
    # the loss is the last stage's, once per shard position
    assert [r for r in staged.global_ranks(0) if staged.counts_loss(r)] == [8, 10]
    assert [staged.stream_of(r) for r in staged.global_ranks(0)][::2] == ["0", "1", "0.stage1", "1.stage1",
                                                                        "0.stage2", "1.stage2"]

    # cp ranks between shard and tp: each its own tokens' loss, the stream its shard position's
    split = Topology(shard=2, tp=2, max_groups=2, cp=2)
    assert split.ranks_per_group == 8
    rank = 8 + 1 * 4 + 1 * 2 + 0  # group 1, shard index 1, cp index 1, tp index 0
    assert split.position_of(rank) == (0, 1, 0, 1) and split.group_rank(rank) == 6
    assert [r for r in split.global_ranks(0) if split.counts_loss(r)] == [0, 2, 4, 6]
    assert [r for r in split.global_ranks(0) if split.saves_stream(r)] == [0, 4]
    assert [split.stream_of(r) for r in split.global_ranks(0)] == ["0"] * 4 + ["1"] * 4


def live_membership(groups: int, shard: int = 2) -> Membership:
    membership = Membership(Topology(shard, 1, groups))
    for _ in range(groups):
        group = membership.add_group()
        for change in (Placed(), Started(), Built()):
            membership.apply(group, change)
    membership.join(list(membership.groups))
    return membership


def test_a_new_group_starts_every_rank_and_joins_in_one_generation():
    membership = Membership(Topology(2, 1, 2))
    groups = [membership.add_group(), membership.add_group()]
    assert membership.groups[1].to_start == {2, 3}
    for change, stage in ((Placed(), GroupStage.STARTING), (Started(), GroupStage.BUILDING), (Built(), GroupStage.READY)):
        for group in groups:
            assert membership.apply(group, change).stage is stage
    assert membership.groups[1].to_start == frozenset() and membership.generation == 0
    membership.join(groups)
    assert membership.quorum().groups == (0, 1) and membership.generation == 1
    assert membership.quorum().replica_rank(1) == 1


def test_a_lost_rank_sends_its_group_back_to_placing_to_start_only_its_replacement():
    membership = live_membership(2)
    assert membership.lose_rank(3) == 1
    assert membership.groups[1].stage is GroupStage.PLACING and membership.groups[1].to_start == {3}
    assert membership.generation == 2 and membership.live_groups() == (0,)
    membership.lose_rank(2)  # a second loss while out of the quorum: no new generation
    assert membership.groups[1].to_start == {2, 3} and membership.generation == 2
    assert membership.waiting_groups() == {1: "placing"}


def test_a_broken_world_rebuilds_without_restarting_a_process():
    membership = live_membership(2)
    membership.apply(0, Broken())
    assert membership.groups[0].stage is GroupStage.PLACING and membership.groups[0].to_start == frozenset()
    assert membership.generation == 2


def test_the_lifecycle_refuses_moves_it_does_not_have():
    membership = Membership(Topology(1, 1, 1))
    group = membership.add_group()
    with pytest.raises(IllegalTransition, match="Built needs stage building, not placing"):
        membership.apply(group, Built())
    with pytest.raises(IllegalTransition):
        transition(membership.groups[group], Joined())


def test_removing_a_live_group_changes_the_generation():
    membership = live_membership(3)
    membership.remove_group(1)
    assert membership.live_groups() == (0, 2) and membership.generation == 2


def test_recovery_plan_evicts_culprits_then_stuck_ranks_and_keeps_healthy_groups():
    membership = live_membership(3)
    diagnosis = Diagnosis(culprits={1: Cause.DEATH}, broken_groups=frozenset({0}), errors={}, stuck=(0,))
    plan = plan_recovery(diagnosis, membership.topology, membership.live_groups())
    assert [(e.rank, e.group, e.cause, e.failed_the_step) for e in plan.evictions] == [
        (1, 0, Cause.DEATH, True), (0, 0, Cause.STUCK_IN_COLLECTIVE, False)
    ]
    assert plan.rebuilding == (0,) and plan.survivors == (1, 2) and plan.cause == Cause.DEATH


def test_recovery_plan_with_every_group_affected_has_no_survivors():
    membership = live_membership(2, shard=1)
    diagnosis = Diagnosis(culprits={0: Cause.HANG, 1: Cause.OWN_ERROR}, broken_groups=frozenset({0, 1}), errors={})
    plan = plan_recovery(diagnosis, membership.topology, membership.live_groups())
    assert plan.survivors == () and plan.affected_groups == {0, 1} and plan.cause == Cause.HANG


def test_step_deadline_follows_recent_steps():
    deadline = StepDeadline(factor=3.0, min_s=2.0, first_s=120.0)
    assert deadline.seconds() == 120.0 and deadline.typical_s() == 0.0
    for seconds in (0.1, 0.2, 0.3):
        deadline.record(seconds)
    assert deadline.seconds() == 2.0  # 3 x median 0.2 is below the floor
    for seconds in (5.0, 5.0, 5.0, 5.0):
        deadline.record(seconds)
    assert deadline.seconds() == 15.0 and deadline.typical_s() == 5.0


def test_failure_policy_allows_its_budget_of_recoveries():
    policy = FailurePolicy(max_recoveries=2)
    dead = Diagnosis({3: "death"}, frozenset({1}), {})
    assert [policy.refusal(step, dead) for step in range(2)] == [None, None]
    assert policy.refusal(2, dead) == "after 2 recoveries; raise fault_tolerance.max_recoveries"


def test_an_error_no_fresh_process_would_avoid_stops_the_run_instead_of_a_recovery():
    index_error = "IndexError: index out of range in self"
    one_rank = Diagnosis({2: Cause.OWN_ERROR}, frozenset({1}), {2: index_error})
    policy = FailurePolicy(max_recoveries=100)
    assert policy.refusal(7, one_rank) is None  # a first error: the rank is replaced
    assert policy.refusal(7, one_rank) == (f"the same error again on fresh processes: {index_error} (the code or "
                                           "the data, not the cluster; fix it and resume)")
    assert FailurePolicy(100).refusal(7, Diagnosis({0: Cause.OWN_ERROR, 3: Cause.OWN_ERROR}, frozenset({0, 1}),
                                                   {0: index_error, 3: index_error})).startswith(
        f"ranks [0, 3] raised the same error: {index_error}")
    in_code = "ValueError: bad (at train.py:3 in my_loss)"
    assert FailurePolicy(100).refusal(7, Diagnosis({2: Cause.OWN_CODE}, frozenset({1}), {2: in_code})) == (
        f"rank 2 raised an error in your code: {in_code} (the code or the data, not the cluster; fix it and resume)")
    data = Diagnosis({3: Cause.OWN_DATA, 1: Cause.DEATH}, frozenset({0, 1}),
                     {3: "DataError: sample 9 holds token id 300"})
    assert FailurePolicy(100).refusal(0, data).startswith("rank 3's data failed: DataError: sample 9 holds token id")
    # the same error at another step, or another error at the same step, is a fault like any other
    policy = FailurePolicy(max_recoveries=100)
    assert policy.refusal(7, one_rank) is None
    assert policy.refusal(8, one_rank) is None
    assert policy.refusal(8, Diagnosis({2: Cause.OWN_ERROR}, frozenset({1}), {2: "RuntimeError: ECC error"})) is None


def test_a_new_group_gets_a_typical_weight():
    assert group_weights((0, 1, 2), {0: 0.5, 1: 1.5}) == {0: 0.5, 1: 1.5, 2: 1.0}


def test_the_data_plan_pads_shard_positions_to_the_same_micro_batch_count():
    plan = plan_step(0, DataCursor(), dataset_len=100, global_batch=6, seed=1, group_weights={0: 1.0, 1: 1.0})
    assert plan.global_samples == 6 and plan.next_cursor == DataCursor(0, 6)
    shares = [plan.groups[g].micro_batches(shard_index, 2, 2) for g in (0, 1) for shard_index in (0, 1)]
    assert {len(share) for share in shares} == {1}
    samples = [i for share in shares for mb in share for i in mb if i != PADDING_INDEX]
    assert len(samples) == len(set(samples)) == 6


def test_fault_schedule_decorates_the_named_ranks_once():
    clock = iter([0.0] + [1.0] * 20).__next__
    events = EventLog(clock)
    topology = Topology(2, 1, 2)
    schedule = FaultSchedule([Fault("kill", rank=1, step=2, after=0.5), Fault("kill-group", group=1, step=3)],
                             topology, events, clock)
    spec = SegmentSpec(attempt=1, first_step=1, stop_step=2, cursor=DataCursor(), dataset_len=64, global_batch=8, seed=0,
                       group_weights={0: 1.0, 1: 1.0}, micro_batch=2, seq_len=8, schedule=LRSchedule(1e-3),
                       clip_grad_norm=None, deadline_s=10.0)
    requests = dict.fromkeys(range(4), spec)
    assert schedule.next_step_after(1) == 2 and schedule.next_step_after(2) == 3  # runs pause before each
    decorated = schedule.decorate(1, requests)
    assert all(isinstance(r, InjectedSegmentSpec) and r.faults == () for r in decorated.values())
    assert schedule.decorate(2, requests)[1].faults == (InjectedFault("kill", 1.0, 0.5),)
    assert schedule.decorate(2, requests)[1].faults == ()  # fired once
    group_faults = schedule.decorate(5, requests)
    assert [rank for rank, r in group_faults.items() if r.faults] == [2, 3]
    assert [e["ranks"] for e in events.of_kind(EventKind.FAULT_INJECTED)] == [[1], [2, 3]]
    assert group_faults[0].group_weights == spec.group_weights  # the spec itself is unchanged


@pytest.mark.parametrize("spec,key", [
    ("slow:rank=1,factor=nan,step=2", "factor"),
    ("slow:rank=1,factor=inf,step=2", "factor"),
    ("kill:rank=1,at=nan", "at"),
    ("kill:rank=1,at=inf", "at"),
    ("hang:rank=0,at=-inf", "at"),
    ("kill:rank=1,step=2,after=nan", "after"),
    ("kill:rank=1,step=nan", "step"),
    ("kill:rank=1,step=inf", "step"),
])
def test_fault_specs_refuse_nan_and_inf_naming_the_spec(spec, key):
    with pytest.raises(FaultSpecError) as caught:
        parse_faults(f"kill:rank=0,step=1;{spec}")
    message = str(caught.value)
    assert f"{key}=" in message and repr(spec) in message, message
    assert "finite number" in message or "is not a number" in message, message


def test_faults_and_recoveries_read_as_one_line_each():
    from elastic.core.events import console_line

    lines = [console_line(event) for event in (
        {"kind": "step-discarded", "step": 7, "cause": "death", "culprits": {3: "death"},
         "errors": {1: "RuntimeError: Connection closed by peer"}},  # a peer's: not the culprit's
        {"kind": "step-discarded", "step": 8, "cause": "own-error", "culprits": {2: "own-error"},
         "errors": {0: "RuntimeError: Connection closed by peer", 2: "ValueError: bad (at train.py:3 in f)"}},
        {"kind": "rank-evicted", "rank": 3, "group": 1, "cause": "death"},
        {"kind": "rank-evicted", "rank": 0, "group": 1, "cause": "stuck-in-collective"},
        {"kind": "recovered", "cause": "death", "step": 7, "total_s": 2.104},
        {"kind": "group-joined", "group": 1, "generation": 4},
        {"kind": "nonfinite-step", "step": 9, "loss": "nan", "grad_norm": "inf"},
        {"kind": "nonfinite-step", "step": 10, "loss": "5.2", "grad_norm": "inf", "overflow": True, "loss_scale": 32768.0},
        {"kind": "run-started", "run": "r"},
        {"kind": "run-started", "run": "r", "resume_from": 40, "steps": 60},
        {"kind": "run-started", "run": "r", "resume_from": 30, "steps": 30},  # the same command again
        {"kind": "checkpoint-skipped", "step": 50, "reason": "does not load"},
    )]
    assert lines == [
        "step 7 failed (death, ranks [3])",
        "step 8 failed (own-error, ranks [2]): ValueError: bad (at train.py:3 in f)",
        "rank 3 of group 1 replaced (death)",
        "rank 0 of group 1 replaced (stuck-in-collective: it waited for a peer that failed, and a process blocked in "
        "a collective cannot be freed; not at fault)",
        "recovered from death at step 7 in 2.1s",
        "group 1 joined (generation 4)",
        "step 9 discarded: loss nan, grad norm inf (not finite); run again",
        "step 10 discarded: fp16 gradients overflowed; loss scale lowered to 32768",
        None,
        "resuming from the checkpoint of step 40",
        "the run is complete: its checkpoint of step 30 ends its 30 steps, nothing is left to train; raise steps "
        "(--steps) above 30 to train it further, or give another run_name (--run-name) for a new run",
        "checkpoint of step 50 skipped: does not load",
    ]


def step_record(step: int, group: int, ranks_per_group: int = 2):
    from elastic.core.protocol import RankTimes, StepRecord

    ranks = tuple(range(group * ranks_per_group, (group + 1) * ranks_per_group))
    return StepRecord(step, group, 2.5, 1.0, 1.0, 0.1, 8, {0: 4, 2: 4}, DataCursor(0, 8 * (step + 1)), ranks,
                      tuple(RankTimes(data_s=0.01 * rank, compute_s=0.5 + rank, comm_s=0.02, wall_s=0.6 + rank + step)
                            for rank in ranks),
                      step_s=0.7 + group + step)


def test_a_run_message_carries_every_groups_figures_as_the_groups_own_records_would():
    from elastic.core.protocol import SegmentRecords
    from elastic.driver.records import RankArrays

    own = {group: [step_record(step, group) for step in (5, 6, 7)] for group in (2, 0)}
    message = SegmentRecords.of_groups(own)
    assert message.groups == (0, 2) and [record.step for record in message.records] == [5, 6, 7]
    topology = Topology(2, 1, 3)
    for index, step in enumerate((5, 6, 7)):
        one_step = SegmentRecords.of_groups({group: [records[index]] for group, records in own.items()})
        expected, got = RankArrays.of_records(one_step, 0, topology), RankArrays.of_records(message, index, topology)
        assert message.records[index] == one_step.records[0]
        assert message.step_s[index].tolist() == [own[0][index].step_s, own[2][index].step_s]
        assert got.ranks.tolist() == [0, 1, 4, 5]
        for name in ("ranks", "samples"):
            assert getattr(got, name).tolist() == getattr(expected, name).tolist()
        assert [times.tolist() for times in got.times] == [times.tolist() for times in expected.times]
        assert got.times.wall_s.tolist() == [time.wall_s for group in (0, 2) for time in own[group][index].times]


def test_first_ranks_that_gathered_different_steps_are_refused():
    from elastic.core.protocol import SegmentRecords, record_row

    records = tuple(step_record(step, 0) for step in (5, 6))
    rows = [[record_row(record) for record in records], [record_row(step_record(step, 1)) for step in (6, 7)]]
    with pytest.raises(ValueError, match="different steps"):
        SegmentRecords.from_rows(records, np.array(rows))


def test_the_loss_scale_halves_on_an_overflow_and_doubles_after_its_interval_of_commits():
    from elastic.core.loss_scale import MIN_SCALE, LossScale, restored_loss_scale, saved_loss_scale

    scale = LossScale(8.0, growth_interval=3)
    assert scale.after_overflow() == LossScale(4.0, 0, 3)
    grown = scale.after_commit().after_commit()
    assert grown == LossScale(8.0, 2, 3) and grown.after_commit() == LossScale(16.0, 0, 3)
    assert grown.after_overflow().good_steps == 0
    floor = LossScale(2.0).after_overflow().after_overflow()
    assert floor.value == MIN_SCALE and floor.exhausted
    assert restored_loss_scale(saved_loss_scale(grown), LossScale(1024.0, growth_interval=3)) == grown
    assert restored_loss_scale({}, scale) is scale and restored_loss_scale(saved_loss_scale(grown), None) is None


def test_a_compute_fault_names_how_often_and_how_wrong_and_nothing_else_takes_those_keys():
    [wrong] = parse_faults("compute:rank=2,step=3,every=4,relative=0.001")
    assert (wrong.kind, wrong.rank, wrong.step, wrong.every, wrong.relative) == ("compute", 2, 3, 4, 0.001)
    [flipped] = parse_faults("compute:rank=2,step=3")
    assert (flipped.every, flipped.relative) == (1, 0.0)
    for spec in ("kill:rank=0,step=1,every=2", "compute:rank=0,step=1,every=0", "compute:rank=0,step=1,relative=2"):
        with pytest.raises(FaultSpecError, match="apply to compute"):
            parse_faults(spec)

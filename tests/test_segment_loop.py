"""The segment protocol of one rank (``elastic.core.segment_loop``), decision by decision: pure, milliseconds."""

from __future__ import annotations

from dataclasses import replace

from elastic.core.data_plan import DataCursor
from elastic.core.lr_schedule import LRSchedule
from elastic.core.protocol import SegmentSpec, StepRecord
from elastic.core.segment_loop import RankSegmentLoop, SendRecords, memory_snapshot_due

START = 100.0


def segment_spec(groups: int = 2, first_step: int = 0, stop_step: int = 10, memory_every: int = 0) -> SegmentSpec:
    return SegmentSpec(attempt=1, first_step=first_step, stop_step=stop_step, cursor=DataCursor(), dataset_len=64,
                       global_batch=8, seed=0, group_weights=dict.fromkeys(range(groups), 1.0), micro_batch=2, seq_len=8,
                       schedule=LRSchedule(1e-3), clip_grad_norm=None, deadline_s=10.0, records_interval_s=1.0,
                       memory_every=memory_every)


def record(step: int) -> StepRecord:
    return StepRecord(step, 0, 1.0, 1.0, 1.0, 1e-3, 8, {0: 4, 1: 4}, DataCursor(position=8 * (step + 1)), (0, 1),
                      ((0.0, 0.1, 0.0, 0.1),) * 2)


def steps(loop: RankSegmentLoop, starts: list[float], step_s: float, pause_at: int | None = None) -> list:
    """Each step starts at its time and commits ``step_s`` later; the report asked is the
    one every group agrees on (this loop's own, as if the others asked the same)."""
    decided = []
    for step, start in enumerate(starts, loop.spec.first_step):
        report = loop.step_starts(start)
        decided.append(loop.committed(record(step), step == pause_at, report, start + step_s))
    return decided


def sent_steps(decided: list) -> list[tuple[int, ...] | None]:
    return [None if after.send is None else tuple(r.step for r in after.send.records) for after in decided]


def test_the_records_go_out_after_the_first_step_then_once_per_interval_gathered():
    loop = RankSegmentLoop(segment_spec(), leads_group=True, now=START)
    decided = steps(loop, [START + 0.25 * step for step in range(7)], step_s=0.25)
    # steps start at 0.0, 0.25, 0.5, 0.75 | 1.0, 1.25, 1.5: the first of each interval asks
    assert sent_steps(decided) == [(0,), None, None, None, (1, 2, 3, 4), None, None]
    assert all(after.send.gathered for after in decided if after.send is not None)
    assert not any(after.segment_ends for after in decided)


def test_a_record_carries_the_whole_loop_period_as_its_step_time():
    loop = RankSegmentLoop(segment_spec(), leads_group=True, now=START)
    loop.step_starts(START + 0.5)  # the run's first step starts after its prefetch
    after = loop.committed(record(0), False, True, START + 2.0)
    assert after.send.records[0].step_s == 2.0
    loop.step_starts(START + 2.0)
    loop.committed(record(1), False, False, START + 2.25)
    assert loop.held()[0].step_s == 0.25


def test_a_run_of_one_group_sends_its_own_records():
    loop = RankSegmentLoop(segment_spec(groups=1), leads_group=True, now=START)
    [after] = steps(loop, [START], step_s=0.25)
    assert after.send == SendRecords((replace(record(0), step_s=0.25),), gathered=False)


def test_the_last_step_ends_the_run_and_each_group_sends_its_own():
    loop = RankSegmentLoop(segment_spec(first_step=3, stop_step=6), leads_group=True, now=START)
    decided = steps(loop, [START, START + 0.25, START + 0.5], step_s=0.25)
    assert [after.segment_ends for after in decided] == [False, False, True]
    assert sent_steps(decided) == [(3,), None, (4, 5)]
    assert decided[-1].send.gathered is False


def test_an_agreed_pause_ends_the_run_after_its_step():
    loop = RankSegmentLoop(segment_spec(), leads_group=True, now=START)
    decided = steps(loop, [START + 0.25 * step for step in range(3)], step_s=0.25, pause_at=1)
    assert [after.segment_ends for after in decided[:2]] == [False, True]
    assert sent_steps(decided[:2]) == [(0,), (1,)]


def test_a_rank_that_does_not_lead_its_group_never_asks_nor_sends_and_ends_with_it():
    loop = RankSegmentLoop(segment_spec(stop_step=3), leads_group=False, now=START)
    assert not loop.step_starts(START)
    decided = [loop.committed(record(step), False, True, START + step) for step in range(3)]
    assert sent_steps(decided) == [None, None, None]
    assert [after.segment_ends for after in decided] == [False, False, True]
    assert loop.held() == ()


def test_the_records_held_at_a_failure_go_out_once():
    loop = RankSegmentLoop(segment_spec(), leads_group=True, now=START)
    steps(loop, [START + 0.25 * step for step in range(3)], step_s=0.25)
    assert [r.step for r in loop.held()] == [1, 2]
    assert loop.held() == ()


def test_the_memory_snapshots_fall_on_multiples_of_memory_every():
    assert [step for step in range(1, 10) if memory_snapshot_due(segment_spec(memory_every=3), step)] == [3, 6, 9]
    assert not any(memory_snapshot_due(segment_spec(), step) for step in range(1, 10))

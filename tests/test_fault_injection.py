"""The rank's side of fault injection (``workers.fault_injection``), in a process of its own: a
kill with ``after=`` lands in the step it was fired in, however short that step is."""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch import nn

from elastic.core.data_plan import DataCursor
from elastic.core.faults import FaultSpecError, InjectedFault, InjectedSegmentSpec, parse_faults
from elastic.core.lr_schedule import LRSchedule
from elastic.testing.gloo_ranks import rank_processes
from workers.fault_injection import InjectedFaults
from workers.world import SlowLink

AFTER_S = 0.5


def short_step_then_its_sum(done) -> None:
    spec = InjectedSegmentSpec(attempt=1, first_step=12, stop_step=20, cursor=DataCursor(), dataset_len=64, global_batch=8,
                               seed=0, group_weights={0: 1.0, 1: 1.0}, micro_batch=2, seq_len=8,
                               schedule=LRSchedule(1e-3), clip_grad_norm=None, deadline_s=10.0,
                               faults=(InjectedFault("kill", after_s=AFTER_S),))
    plan = InjectedFaults(seed=0, global_rank=1, world=None).plan(spec, nn.Linear(2, 2))
    plan.after_compute(0.001)  # a step far shorter than the delay
    plan.before_cross_group_sum()
    done.value = 1  # the step would have reached its sum, and the death a later step


def test_a_delayed_kill_dies_in_the_step_it_was_fired_in_however_short():
    context = rank_processes()
    done = context.Value("i", 0)
    rank = context.Process(target=short_step_then_its_sum, args=(done,))
    rank.start()
    rank.join(timeout=60)
    assert rank.exitcode == 1 and done.value == 0, (rank.exitcode, done.value)


def test_a_slow_device_adds_its_work_inside_the_forward(monkeypatch):
    """``slow-device`` burns inside the forward, right after each block's own (where FSDP2's
    peers would wait for it in the next block's all-gather): ``factor - 1`` times the step's
    work, which is about ``STEP_OVER_FORWARD`` forwards. On a fake CPU clock, so the figures are
    exact whatever else the machine runs."""
    from workers import fault_injection

    now = [0.0]
    happened: list[tuple[str, float]] = []

    class Block(nn.Linear):
        def forward(self, inputs):
            now[0] += 0.01  # this block's own work, in CPU seconds
            happened.append(("forward", 0.01))
            return super().forward(inputs)

    def burn(seconds: float) -> None:
        now[0] += seconds
        happened.append(("burn", seconds))

    monkeypatch.setattr(fault_injection.time, "thread_time", lambda: now[0])
    monkeypatch.setattr(fault_injection, "burn_cpu", burn)
    model = nn.Sequential(Block(4, 4), Block(4, 4))
    fault_injection.slow_blocks(model, factor=1.5)
    model(torch.randn(2, 4))
    burn_s = 0.5 * fault_injection.STEP_OVER_FORWARD * 0.01
    assert [kind for kind, _ in happened] == ["forward", "burn", "forward", "burn"]
    assert [seconds for kind, seconds in happened if kind == "burn"] == pytest.approx([burn_s, burn_s])


class DoneWork:
    """A collective already complete, as loopback's are."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def test_a_slow_link_carries_each_payload_after_the_ones_before_it():
    link = SlowLink(bytes_per_s=10e6)
    megabyte = [torch.zeros(250_000)]  # 1 MB of float32: 0.1 s at 10 MB/s
    started = time.perf_counter()
    first, second = link.carry(megabyte, DoneWork()), link.carry(megabyte, DoneWork())
    assert not first.is_completed() and not second.is_completed()
    first.wait()
    assert 0.1 <= time.perf_counter() - started < 0.2 and not second.is_completed()
    second.wait()
    assert time.perf_counter() - started >= 0.2 and second.is_completed()


@pytest.mark.parametrize("text, parsed", [
    ("slow-link:group=1,step=0,rate=1e6", {"kind": "slow-link", "group": 1, "rate": 1e6}),
    ("slow-link:group=1,step=0", "slow-link needs it"),
    ("slow-link:group=1,step=0,rate=0", "rate=BYTES_PER_S > 0"),
    ("slow:rank=1,step=0,factor=2,rate=1e6", "applies to slow-link"),
    ("kill:rank=1,step=7,during=outer-step", {"kind": "kill", "rank": 1, "step": 7, "during": "outer-step"}),
    ("kill:rank=1,step=7,during=inner-step", "use during=outer-step"),
    ("kill:rank=1,step=7,after=0.5,during=outer-step", "applies to kill, without after"),
    ("hang:rank=1,step=7,during=outer-step", "applies to kill, without after"),
])
def test_a_slow_links_rate_and_a_kill_inside_the_outer_step_parse_or_are_refused_naming_the_fix(text, parsed):
    if isinstance(parsed, dict):
        [fault] = parse_faults(text)
        assert {key: getattr(fault, key) for key in parsed} == parsed
        return
    with pytest.raises(FaultSpecError, match=re.escape(parsed)):
        parse_faults(text)


def test_a_kill_inside_the_outer_step_waits_for_it():
    """Fired at its segment's start, the kill waits: the rank dies at its outer step's first
    collective, not before."""
    spec = InjectedSegmentSpec(attempt=1, first_step=4, stop_step=8, cursor=DataCursor(), dataset_len=64, global_batch=8,
                               seed=0, group_weights={0: 1.0}, micro_batch=2, seq_len=8, schedule=LRSchedule(1e-3),
                               clip_grad_norm=None, deadline_s=10.0, faults=(InjectedFault("kill", during="outer-step"),))
    plan = InjectedFaults(seed=0, global_rank=0, world=None).plan(spec, nn.Linear(2, 2))
    plan.before_cross_group_sum()  # the inner steps go on
    assert plan.dies_in_outer_step

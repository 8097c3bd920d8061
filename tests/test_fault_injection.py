"""The rank's side of fault injection (``workers.fault_injection``), in a process of its own: a
kill with ``after=`` lands in the step it was fired in, however short that step is."""

from __future__ import annotations

from torch import nn

from elastic.core.data_plan import DataCursor
from elastic.core.faults import InjectedFault, InjectedRunSpec
from elastic.core.lr_schedule import LRSchedule
from elastic.testing.gloo_ranks import rank_processes
from workers.fault_injection import InjectedFaults

AFTER_S = 0.5


def short_step_then_its_sum(done) -> None:
    spec = InjectedRunSpec(run=1, first_step=12, stop_step=20, cursor=DataCursor(), dataset_len=64, global_batch=8,
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

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


def test_a_slow_device_adds_its_work_inside_the_forward():
    """``slow-device`` burns inside the forward (where FSDP2's peers would wait for it in the
    next all-gather), ``factor - 1`` times the step's work, which is about
    ``STEP_OVER_FORWARD`` forwards. Timed in this thread's CPU seconds, as the burn is."""
    import time

    import torch

    from workers.fault_injection import STEP_OVER_FORWARD, slow_blocks

    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))
    inputs = torch.randn(1024, 512)  # tens of milliseconds: a timer's noise is small beside it

    def forward_s() -> float:
        started = time.thread_time()
        with torch.no_grad():
            model(inputs)
        return time.thread_time() - started

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the forward's work in this thread, where the burn is timed
    try:
        plain = min(forward_s() for _ in range(3))
        slow_blocks(model, factor=1.5)
        slowed = min(forward_s() for _ in range(3))
    finally:
        torch.set_num_threads(threads)
    # 2.5 forwards' work; 2 even where one forward's timing ran a quarter long
    assert slowed >= 0.8 * (1 + 0.5 * STEP_OVER_FORWARD) * plain

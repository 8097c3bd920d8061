"""The at-scale simulation (``elastic.simulation``, ``bench/at_scale.py``): every design's
ledger adds up to the wall time, a trace without failures is all training, and single
failures cost what each design's figures say they cost."""

from __future__ import annotations

import pytest

from elastic.simulation.designs import MODELS, STATE_BYTES_PER_PARAMETER, Costs, Design, Job, replay
from elastic.simulation.failure_mix import (
    GPUS_PER_NODE,
    LLAMA3_GPU_HOURS,
    Failure,
    FailureKind,
    draw_failures,
    rates_per_gpu_hour,
)

DAY_S = 86_400.0
JOB = Job(MODELS["70b"], 4096)  # 32 groups of 128 GPUs


def test_the_mix_is_llama_3s_419_interruptions_and_a_trace_follows_its_rate():
    rates = rates_per_gpu_hour()
    interruptions = sum(rate for kind, rate in rates.items() if kind != FailureKind.SLOW_GPU)
    assert interruptions * LLAMA3_GPU_HOURS == pytest.approx(419)
    trace = draw_failures(16_384, 54 * DAY_S, seed=1)
    assert 419 * 0.85 < sum(failure.kind != FailureKind.SLOW_GPU for failure in trace) < 419 * 1.15
    assert [failure.at_s for failure in trace] == sorted(failure.at_s for failure in trace)
    assert all(failure.gpu % GPUS_PER_NODE == 0 for failure in trace if failure.kind == FailureKind.NODE_LOST)


@pytest.mark.parametrize("design", list(Design))
def test_every_ledger_adds_up_to_the_wall_time_and_no_failure_is_all_training(design):
    wall_s = 7 * DAY_S
    ledger = replay(JOB, draw_failures(JOB.gpus, wall_s, seed=2, scale=20.0), design, wall_s, spare_gpus=16)
    assert ledger.failures > 50
    assert min(ledger.trained_s, ledger.lost_s, ledger.down_s) >= 0
    assert ledger.trained_s + ledger.lost_s + ledger.down_s == pytest.approx(wall_s, rel=1e-12)
    assert ledger.ettr < 1.0
    clean = replay(JOB, [], design, wall_s)
    assert (clean.ettr, clean.lost_s, clean.down_s) == (1.0, 0.0, 0.0)


def test_a_gpu_lost_costs_ours_its_step_the_regroup_and_one_groups_time_away():
    costs = Costs()
    wall_s = DAY_S
    lost = [Failure(1000.0, FailureKind.GPU_LOST, gpu=5)]
    regroup_s = costs.regroup_s + costs.world_init_s_per_rank * JOB.groups
    group_s = (costs.world_init_s_per_rank * JOB.model.group_gpus
               + STATE_BYTES_PER_PARAMETER * JOB.model.parameters / JOB.model.group_gpus / costs.heal_bandwidth)
    with_spare = replay(JOB, lost, Design.OURS, wall_s, spare_gpus=8, costs=costs)
    assert with_spare.decisions == 1 and with_spare.spares_short == 0
    assert with_spare.lost_s < JOB.step_s  # the step it struck, redone
    assert with_spare.down_s == pytest.approx(regroup_s + (costs.spare_takeover_s + group_s) / JOB.groups)
    without = replay(JOB, lost, Design.OURS, wall_s, spare_gpus=0, costs=costs)
    assert without.spares_short == 1
    assert without.down_s == pytest.approx(
        regroup_s + (costs.node_replacement_s + costs.process_start_s + group_s) / JOB.groups)


def test_restart_the_world_trains_again_what_it_trained_since_its_last_checkpoint_and_waits_out_a_hang():
    costs = Costs()
    at_s = costs.checkpoint_every_s + 500.0
    nodes = JOB.gpus / GPUS_PER_NODE
    restart_s = (costs.world_restart_s + costs.world_init_s_per_rank * JOB.gpus
                 + STATE_BYTES_PER_PARAMETER * JOB.model.parameters / (nodes * costs.checkpoint_read_per_node))
    death = replay(JOB, [Failure(at_s, FailureKind.SOFTWARE, 3)], Design.RESTART_THE_WORLD, DAY_S, costs=costs)
    assert death.lost_s == pytest.approx(500.0)
    assert death.down_s == pytest.approx(restart_s)
    hang = replay(JOB, [Failure(at_s, FailureKind.HANG, 3)], Design.RESTART_THE_WORLD, DAY_S, costs=costs)
    assert hang.down_s == pytest.approx(costs.collective_timeout_s + restart_s)


def test_a_silent_corruption_costs_ours_a_groups_heal_and_the_others_nothing_they_see():
    corruption = [Failure(1000.0, FailureKind.SILENT_CORRUPTION, 7)]
    ours = replay(JOB, corruption, Design.OURS, DAY_S)
    assert 0 < ours.down_s < 1.0 and ours.lost_s == 0
    for design in (Design.RESTART_THE_WORLD, Design.GROUP_RESTART):
        assert replay(JOB, corruption, design, DAY_S).ettr == 1.0

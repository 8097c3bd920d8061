"""The learning-rate schedule and the clipping decision: pure functions of the step and norm."""

from __future__ import annotations

import math

import pytest

from elastic.setup.config import ConfigError
from elastic.core.gradient_clipping import clip_coefficient, global_norm
from elastic.core.lr_schedule import LRSchedule
from tests.tiny import tiny_config


def test_warmup_then_cosine_decay_follow_the_formula_at_chosen_steps():
    schedule = LRSchedule(peak_lr=1e-3, warmup_steps=4, decay="cosine", decay_steps=24, min_ratio=0.1)
    assert schedule.lr(0) == pytest.approx(1e-3 * 1 / 5)
    assert schedule.lr(3) == pytest.approx(1e-3 * 4 / 5)
    assert schedule.lr(4) == pytest.approx(1e-3)  # the peak, once the warmup is over
    assert schedule.lr(14) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # halfway through the decay: cos(pi/2) = 0
    assert schedule.lr(9) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 5 / 20)))
    assert schedule.lr(24) == pytest.approx(1e-4)
    assert schedule.lr(10_000) == pytest.approx(1e-4)  # past the horizon it stays at the minimum


def test_linear_decay_and_constant_schedules():
    linear = LRSchedule(peak_lr=2.0, warmup_steps=0, decay="linear", decay_steps=10, min_ratio=0.0)
    assert [linear.lr(step) for step in (0, 5, 10, 11)] == pytest.approx([2.0, 1.0, 0.0, 0.0])
    constant = LRSchedule(peak_lr=3e-3, warmup_steps=2)
    assert [constant.lr(step) for step in range(4)] == pytest.approx([1e-3, 2e-3, 3e-3, 3e-3])


def test_the_config_resolves_the_horizon_to_the_run_length_unless_given(tmp_path):
    config = tiny_config(tmp_path, steps=50, optimizer__schedule="cosine", optimizer__warmup_steps=5)
    assert config.lr_schedule.decay_steps == 50
    pinned = tiny_config(tmp_path, steps=50, optimizer__schedule="cosine", optimizer__decay_steps=200)
    assert pinned.lr_schedule.decay_steps == 200


def test_a_warmup_that_leaves_nothing_to_decay_fails_naming_the_fields(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.warmup_steps=50 leaves no steps to decay over.*decay_steps"):
        tiny_config(tmp_path, steps=50, optimizer__schedule="linear", optimizer__warmup_steps=50)


def test_clipping_scales_only_norms_above_the_limit():
    assert global_norm({1: 16.0, 0: 9.0}) == 5.0
    assert clip_coefficient(5.0, None) == 1.0
    assert clip_coefficient(5.0, 10.0) == 1.0
    assert clip_coefficient(5.0, 1.0) == pytest.approx(1.0 / (5.0 + 1e-6))

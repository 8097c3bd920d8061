"""Steps whose loss or gradient norm is not finite: discarded by every rank, tried again,
and a run that keeps producing them stops as diverged, non-zero, with strict JSON. The
protocol against the fake fleet; the ranks' side on a real run in ``test_training``."""

from __future__ import annotations

import json
import math

from elastic.core.exits import Exit
from elastic.core.events import EventKind
from elastic.core.gradient_clipping import clip_coefficient
from elastic.core.policies import DivergencePolicy
from elastic.core.protocol import NonFinite
from elastic.outputs.summary import RunSummary, StepEntry
from tests.test_controller_scenarios import Scenario, fake_time_only  # noqa: F401 (autouse fixture)


def test_a_step_that_sums_to_nan_once_is_discarded_and_tried_again(tmp_path):
    scenario = Scenario(tmp_path, steps=8)
    scenario.fleet.nonfinite[3] = 1
    assert scenario.run() == "completed"
    assert scenario.committed_steps() == list(range(8))
    assert all(math.isfinite(record.loss) for record in scenario.records)
    [event] = scenario.kinds(EventKind.NONFINITE_STEP)
    assert (event["step"], event["loss"], event["grad_norm"]) == (3, "nan", "nan")
    assert scenario.controller.history.steps_discarded == 1
    first_steps = [next(iter(specs.values())).first_step for specs in scenario.fleet.segments]
    assert first_steps == [0, 3]  # the run stopped on it, and the next one ran it again


def test_a_run_that_keeps_summing_to_nan_stops_as_diverged_with_what_it_committed(tmp_path):
    scenario = Scenario(tmp_path, steps=8, config={"optimizer__max_nonfinite_steps": 3})
    scenario.fleet.nonfinite[5] = 100
    exit_reason = scenario.run()
    assert exit_reason.startswith("diverged: 3 steps in a row with a loss or gradient norm that is not finite")
    assert "step 5" in exit_reason and "optimizer.lr" in exit_reason
    assert Exit.parse(exit_reason).code == 1
    assert scenario.committed_steps() == list(range(5))
    assert len(scenario.kinds(EventKind.NONFINITE_STEP)) == 3


def test_committed_steps_between_nonfinite_ones_reset_the_count():
    policy = DivergencePolicy(max_nonfinite_steps=2)
    nan_step = NonFinite(4, math.nan, math.inf)
    assert policy.diverged(nan_step) is None
    policy.committed()
    assert policy.diverged(nan_step) is None
    assert str(policy.diverged(nan_step)).startswith("diverged: 2 steps in a row")


def test_the_summary_is_strict_json_whatever_floats_it_holds():
    summary = RunSummary(final_loss=math.nan, steps=[StepEntry(t=1.0, grad_norm=math.inf, loss=1.5)],
                         exit="diverged: ...")
    text = json.dumps(summary.written(), allow_nan=False)
    written = json.loads(text)
    assert (written["final_loss"], written["steps"][0]["grad_norm"], written["steps"][0]["loss"], written["exit"]) == (
        "nan", "inf", 1.5, "diverged: ...")
    read = RunSummary.read(text)  # and the schema reads the names back as the floats they were
    assert math.isnan(read.final_loss) and read.steps[0].grad_norm == math.inf


def test_clipping_does_not_pass_a_nan_norm_off_as_fine():
    assert math.isnan(clip_coefficient(math.nan, 1.0))
    assert clip_coefficient(math.inf, 1.0) == 0.0


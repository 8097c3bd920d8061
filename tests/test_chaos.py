"""Seeded chaos: overlapping kills, group kills and hangs on 2 groups x shard 2 with
checkpoints every 5 steps. Every schedule completes, and its losses equal the fault-free
run's: no fault may lose committed work or change the math."""

from __future__ import annotations

import random

import pytest

from elastic import ElasticTrainer
from tests.reference import max_relative_difference, reference_run
from tests.test_faults import FAST_DETECTION
from tests.tiny import tiny_config

STEPS = 16
SEED = 20261123


def schedules(count: int, seed: int) -> list[str]:
    """The schedule that once stopped a run (both copies of shard 0 lost before the first
    checkpoint), then random ones, each with a second fault on the same or the next step."""
    rng = random.Random(seed)
    pairs = [("kill", "hang"), ("hang", "kill-group"), ("kill-group", "kill"), ("kill", "kill")]
    found = ["kill:rank=2,step=2;kill:rank=0,step=3"]
    while len(found) < count:
        first = rng.randrange(1, STEPS - 3)
        faults = []
        for kind, step in zip(pairs[len(found) % len(pairs)], (first, first + rng.randrange(0, 2))):
            target = f"group={rng.randrange(2)}" if kind == "kill-group" else f"rank={rng.randrange(4)}"
            faults.append(f"{kind}:{target},step={step}")
        schedule = ";".join(faults)
        if faults[0] != faults[1] and schedule not in found:
            found.append(schedule)
    return found


@pytest.fixture(scope="module")
def fault_free_losses(tmp_path_factory):
    config = tiny_config(tmp_path_factory.mktemp("reference"), groups=2, shard=2, steps=STEPS)
    losses, _ = reference_run(config, STEPS)
    return losses


@pytest.mark.parametrize("inject", schedules(5, SEED))
def test_a_chaos_schedule_completes_with_the_fault_free_losses(ray_cluster, tmp_path, inject, fault_free_losses):
    config = tiny_config(tmp_path, groups=2, shard=2, steps=STEPS, checkpoint__every=5,
                         fault_tolerance__inject=inject, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert result.ok, (inject, result.exit)
    assert result.summary["steps_committed"] >= STEPS
    assert max_relative_difference(result.losses, fault_free_losses) <= 1e-5, inject

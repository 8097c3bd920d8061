"""A slow rank on real Ray actors: named, mitigated, and the committed losses unchanged."""

from elastic import ElasticTrainer
from elastic.core.events import EventKind
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import tiny_config

ONSET = 5


def test_slow_rank_is_named_and_mitigated_without_changing_the_losses(ray_cluster, tmp_path):
    steps = 60
    # 8 samples per rank per step, so compute (which the slowdown scales) outweighs the
    # fixed per-step costs of a tiny model.
    config = tiny_config(tmp_path, groups=2, shard=2, steps=steps, global_batch=32, micro_batch=4,
                         fault_tolerance__inject=f"slow:rank=1,factor=1.5,step={ONSET}")
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    detected = [e for e in events if e["kind"] == EventKind.STRAGGLER_DETECTED]
    assert {e["rank"] for e in detected} == {1}, detected
    assert detected[0]["step"] > ONSET  # how soon after the onset is bench/stragglers.py's figure
    mitigated = [e for e in events if e["kind"] == EventKind.STRAGGLER_MITIGATED]
    assert mitigated, events
    mitigated = mitigated[0]
    assert mitigated["step"] >= detected[0]["step"]
    assert mitigated.get("rank") == 1 or mitigated.get("group") == 0
    assert mitigated["predicted_gain"] > 0
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5

"""Fault tolerance in place, on real Ray actors: each detection path. Several at once, with the
committed losses and final parameters those of the fault-free run: tests/test_chaos.py."""

import pytest

from elastic import ElasticTrainer
from elastic.core.events import EventKind
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import FAST_DETECTION, tiny_config


def failed(summary):
    return [(e["rank"], e["cause"]) for e in summary["events"] if e["kind"] == EventKind.RANK_FAILED]


@pytest.mark.waits  # the hang waits out its deadline; both groups wait for each heal
def test_each_detection_path_names_the_culprit(ray_cluster, tmp_path):
    """A death, an error on the rank's own side of a collective and a hang, one after another
    in one run: each names its rank and cause, and no other rank. Both groups are required, so
    the run waits for each heal and every fault's rank is live at its step."""
    paths = [("kill", 3, "death", 5), ("fail-collective", 2, "own-error", 10), ("hang", 1, "hang", 15)]
    steps = 20
    inject = ";".join(f"{kind}:rank={rank},step={step}" for kind, rank, _, step in paths)
    config = tiny_config(tmp_path, groups=2, min_groups=2, shard=2, steps=steps, fault_tolerance__inject=inject,
                         **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    summary = result.summary
    assert result.ok, (result.exit, [e for e in summary["events"] if "checkpoint" not in e["kind"]])
    assert failed(summary) == [(rank, cause) for _, rank, cause, _ in paths]
    assert summary["steps_discarded"] >= len(paths)
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5
    recovered = [e for e in summary["events"] if e["kind"] == EventKind.RECOVERED]
    assert [e["cause"] for e in recovered] == [cause for _, _, cause, _ in paths]
    for event in recovered:
        assert event["total_s"] > 0 and {"detect_s", "rebuild_s", "heal_s"} <= set(event), event


def test_below_minimum_stops_with_a_clear_message(ray_cluster, tmp_path):
    config = tiny_config(tmp_path, groups=1, min_groups=1, shard=1, steps=5, scaling__cpus_per_rank=64.0)
    from elastic.setup.config import ConfigError

    with pytest.raises(ConfigError, match="but the cluster has"):
        ElasticTrainer(config).fit()


def test_sequence_parallel_ranks_lost_at_one_position_come_back_from_memory_with_the_single_process_losses(
        ray_cluster, tmp_path):
    """tp 2 shards the sequence between TP regions (the default): losing both copies of one
    TP position restores it from the memory tier, and the losses stay a single process's."""
    steps = 14
    config = tiny_config(tmp_path, groups=2, tp=2, steps=steps, fault_tolerance__inject="kill:rank=1,step=5;kill:rank=3,step=5",
                         checkpoint__memory_every=2, **FAST_DETECTION)
    assert config.sequence_parallel
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert sorted(failed(result.summary)) == [(1, "death"), (3, "death")]
    assert [e for e in result.summary["events"] if e["kind"] == EventKind.RESTORED_FROM_MEMORY]
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5

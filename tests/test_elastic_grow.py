"""Growing: a node added mid-run lets the second replica group place, heal and join, and the
committed steps are those of the fault-free reference, none lost or doubled.

The node joins the test run's Ray head (elastic/testing/ray_head.py). Until it does, a placement group
holds all of the head's free CPUs but the one a group needs (shard 2 x 0.5 CPU), so the second
group cannot place; the node is added as the first checkpoint commits, so the run has trained
on one group before it can grow."""

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group

from elastic import ElasticTrainer
from elastic.core.events import EventKind
from tests.events import on_events
from elastic.testing.paced import paced_model
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import tiny_config

pytestmark = pytest.mark.waits  # steps paced to 0.1 s while a node starts


def test_second_group_joins_when_a_node_is_added(ray_head, tmp_path):
    # Long enough for the node and the group's actors to start, short enough that float drift
    # from the reference's reduction order stays far below 1e-5 (it passes 1e-5 near step 300).
    # Ranks step on their own, so the steps are paced (0.1 s): the 100 steps after the node is
    # added last at least 10 s. The second group joined 5 s after the node was added on a quiet
    # 2-core machine and 8 s beside the noisy neighbour, about 20 steps later in both (steps
    # slow down while the node starts and the group heals).
    steps = 120
    config = tiny_config(tmp_path, groups=2, min_groups=1, shard=2, steps=steps, scaling__cpus_per_rank=0.5,
                         checkpoint__every=20, stragglers__enabled=False)
    hold = placement_group([{"CPU": ray.available_resources()["CPU"] - 1.0}])
    ray.get(hold.ready(), timeout=60)
    nodes = []

    def add_node(_committed):
        # The driver is held until the node has registered, so the steps left for the group to
        # place, start and heal do not also pay for the node's start on a loaded machine.
        if not nodes:
            nodes.append(ray_head.add_node(num_cpus=1))

    try:
        with on_events({EventKind.CHECKPOINT_COMMITTED: add_node}):
            result = ElasticTrainer(config, model_fn=paced_model(config, 0.1)).fit()
    finally:
        remove_placement_group(hold)
        for node in nodes:
            ray_head.remove_node(node)
    summary = result.summary
    assert result.ok, result.exit
    records = summary["steps"]
    assert [r["step"] for r in records] == list(range(steps)) and summary["steps_committed"] == steps
    assert summary["steps_discarded"] == 0

    [first_commit, *_] = [e for e in summary["events"] if e["kind"] == EventKind.CHECKPOINT_COMMITTED]
    [joined] = [e for e in summary["events"] if e["kind"] == EventKind.GROUP_JOINED and e["group"] == 1]
    assert joined["t"] > first_commit["t"], "the second group joined before the node was added"
    [healed] = [e for e in summary["events"] if e["kind"] == EventKind.GROUP_HEALED]
    assert (healed["group"], healed["source_group"]) == (1, 0)
    live = [r["live_groups"] for r in records]
    grown_at = live.index(2)
    assert first_commit["step"] < grown_at and set(live[:grown_at]) == {1} and set(live[grown_at:]) == {2}

    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5

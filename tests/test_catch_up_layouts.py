"""A group replaced while the other steps catches up, or takes the state before the next
segment's first step, at the layouts whose state is split within a group: pipeline stages (a
rank holds its stage's layers) and experts split over the ranks (a rank holds its experts, and
the routing bias moves by every group's routed tokens).
Real ranks on a real Ray; ``tests/test_catch_up.py`` holds the kept updates' replay over gloo."""

from __future__ import annotations

import pytest

from elastic import ElasticTrainer
from elastic.core import policies
from elastic.core.events import EventKind
from elastic.testing.losses import max_relative_difference
from elastic.testing.paced import paced_model
from tests.reference import reference_run
from tests.test_experts import BALANCED, EXPERTS
from tests.tiny import FAST_DETECTION, tiny_config
from workers.pipeline import split_transformer


@pytest.mark.parametrize("overlapped", [True, False], ids=["catch-up", "before-first-step"])
@pytest.mark.parametrize("layout", [{"scaling__pp": 2}, {"shard": 2, "scaling__ep": 2, **EXPERTS, **BALANCED}],
                         ids=["pp2", "ep2"])
def test_a_group_replaced_catches_up_while_the_other_steps_with_the_single_process_losses(
        ray_cluster, tmp_path, layout, overlapped, monkeypatch):
    # The tiny model's state is foreseen to copy in a moment: the group takes it before the next
    # segment's first step. Foreseen slow, as a large model's is, it catches up.
    if overlapped:
        monkeypatch.setattr(policies, "FIRST_COPY_BYTES_PER_S", 1.0)
    # min_groups 1: the surviving group goes on stepping while the killed rank's group is
    # rebuilt on the warm spare; steps paced so that the group is back well before the end.
    steps = 10
    config = tiny_config(tmp_path, groups=2, min_groups=1, steps=steps, scaling__spares=1,
                         fault_tolerance__inject="kill:rank=0,step=2", **FAST_DETECTION, **layout)
    split = {"split_fn": split_transformer} if "scaling__pp" in layout else {}
    result = ElasticTrainer(config, model_fn=paced_model(config, 0.25), **split).fit()
    events = result.summary["events"]
    assert result.ok, (result.exit, [e for e in events if "checkpoint" not in e["kind"]])
    [healed] = [e for e in events if e["kind"] == EventKind.GROUP_HEALED]
    assert (healed["group"], healed["source_group"], healed["overlapped"]) == (0, 1, overlapped), healed
    assert healed["before_first_step"] is not overlapped, healed
    assert healed["rank_to_rank_bytes"] > 0 and healed["object_store_bytes"] == 0, healed
    assert not [e for e in events if e["kind"].startswith("restored-")]
    assert [record["step"] for record in result.summary["steps"]] == list(range(steps))
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5

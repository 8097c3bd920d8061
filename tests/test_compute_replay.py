"""Silent errors in compute found by replay (``elastic.core.compute_replay``): the verdicts over
fingerprints, and real ranks on a real Ray whose device computes wrong (the ``compute`` fault):
committed silently without the spot checks, found, named, evicted and undone with them."""

from __future__ import annotations

import pytest

from elastic import ElasticTrainer
from elastic.core.compute_replay import ComputeMismatch, verdict
from elastic.core.events import EventKind
from elastic.testing.losses import max_relative_difference
from tests.reference import reference_run
from tests.tiny import FAST_DETECTION, tiny_config
from workers.pipeline import split_transformer

STEPS = 6


def test_a_rank_that_computes_wrong_is_named_among_three_groups_or_more_and_paired_among_two():
    groups = (0, 1, 2, 3)
    own = {0: 10, 1: 99, 2: 12, 3: 13}  # group 1's rank computed its own work wrong...
    replayed = {0: 10, 1: 11, 2: 98, 3: 13}  # ...and, replaying group 2's, that too
    found = verdict(7, (0, 0, 0, 0), own, replayed, groups)
    assert found == ComputeMismatch(7, (0, 0, 0, 0), (1, 2), (1,)) and found.named
    assert verdict(7, (0, 0, 0, 0), own, own, groups) is None
    # two groups replay each other: both pairs hold both groups, both are suspects
    paired = verdict(7, (0, 0, 0, 0), {0: 1, 1: 9}, {0: 8, 1: 2}, (0, 1))
    assert paired.suspects == (0, 1) and not paired.named


def ranks_per_group(tmp_path, layout: dict) -> int:
    return tiny_config(tmp_path / "probe", groups=2, **layout).scaling.topology.ranks_per_group


def events_of(result, kind: str) -> list[dict]:
    return [event for event in result.summary["events"] if event["kind"] == kind]


@pytest.mark.parametrize("groups,layout,errors", [
    (3, {}, ("",)),
    (2, {}, (",relative=0.001",)),
    (2, {"shard": 2, "tp": 2}, (",relative=0.001",)),
    (3, {"scaling__pp": 2, "micro_batch": 1}, ("",)),
], ids=["three-groups", "two-groups", "shard2-tp2", "pp2"])
def test_a_device_computing_wrong_is_found_by_replay_evicted_and_its_steps_undone(ray_cluster, tmp_path, groups,
                                                                                   layout, errors):
    """Group 1's rank at the first position computes wrong from step 3 (one flipped bit in what
    it hands the gradients' sum, or every value off by 1e-3). Step 3 is no spot check: its
    wrong gradients go into every group's update. Without the spot checks the run commits
    them silently; with them, the check at step 4 names the rank (with two groups, the pair of
    group 0's and group 1's), which is replaced, and every group goes back to before step 3: the
    losses of the same job in one process, as a clean run's."""
    split = {"split_fn": split_transformer} if "scaling__pp" in layout else {}
    every = {"integrity__replay_every": 2}
    clean, _ = reference_run(tiny_config(tmp_path / "clean", groups=groups, steps=STEPS, **layout), STEPS)
    culprit = ranks_per_group(tmp_path, layout)  # group 1's first rank
    for error in errors:
        inject = f"compute:rank={culprit},step=3{error}"
        if not layout:  # before: one run each of a flipped bit (3 groups) and a relative error (2)
            unchecked = ElasticTrainer(tiny_config(tmp_path / f"unchecked{error}", groups=groups, steps=STEPS,
                                                   integrity__replay_every=0, fault_tolerance__inject=inject)).fit()
            # without the checks the wrong gradients are committed, and nothing says so
            assert unchecked.ok and not events_of(unchecked, EventKind.STEP_DISCARDED), unchecked.exit
            assert max_relative_difference(unchecked.losses, clean) > 1e-8
        checked = ElasticTrainer(tiny_config(tmp_path / f"checked{error}", groups=groups, steps=STEPS, scaling__spares=1,
                                             fault_tolerance__inject=inject, **every, **layout, **FAST_DETECTION),
                                 **split).fit()
        assert checked.ok, checked.exit
        suspects = [culprit] if groups > 2 else [0, culprit]
        found = events_of(checked, EventKind.SILENT_CORRUPTION_FOUND)
        assert found and {(event["step"], tuple(event["suspects"]), event["named"]) for event in found} == {
            (4, tuple(suspects), groups > 2)}, found
        evicted = events_of(checked, EventKind.RANK_EVICTED)
        assert sorted((event["rank"], event["cause"]) for event in evicted) == [
            (rank, "silent-corruption") for rank in suspects]
        assert [record["step"] for record in checked.summary["steps"]] == list(range(STEPS))
        assert max_relative_difference(checked.losses, clean) <= 1e-5
        # the healthy checks before the fault reproduced every group's work (after it, whether a
        # check falls while every group is back depends on how soon the replacements are built)
        replayed = [event["step"] for event in events_of(checked, EventKind.STEP_REPLAYED)]
        assert replayed[:2] == [0, 2], replayed

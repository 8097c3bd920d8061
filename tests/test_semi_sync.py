"""Semi-synchronous training (``sync.mode = "diloco"``): each replica group a learner for a
round of inner steps, then one outer step over the groups' pseudo-gradients. Real ranks on a
real Ray, against DiLoCo written in one process (``tests/reference.py``); a learner killed at
each moment of a round redoes the round, with the clean run's losses."""

from __future__ import annotations

import os
import signal

import pytest

from elastic import ElasticTrainer
from elastic.core.events import EventKind
from elastic.testing.losses import max_relative_difference
from elastic.testing.paced import paced_model
from tests.reference import max_parameter_difference, reference_diloco, reference_run
from tests.test_experts import BALANCED, EXPERTS
from tests.tiny import FAST_DETECTION, tiny_config
from workers.pipeline import split_transformer

ROUNDS = {"sync__mode": "diloco", "sync__outer_every": 4}
STEPS = 12


def kinds(result) -> list[str]:
    return [event["kind"] for event in result.summary["events"]]


@pytest.mark.parametrize("layout", [{}, {"scaling__pp": 2}, {"shard": 2, "scaling__ep": 2, **EXPERTS, **BALANCED},
                                    {"shard": 2, "tp": 2}, {"sync__precision": "int4"}, {"sync__precision": "fp8"}],
                         ids=["one-rank-groups", "pp2", "ep2", "shard2-tp2", "int4", "fp8"])
def test_the_learners_train_as_diloco_in_one_process(ray_cluster, tmp_path, layout):
    config = tiny_config(tmp_path, groups=2, steps=STEPS, **ROUNDS, **layout)
    split = {"split_fn": split_transformer} if "scaling__pp" in layout else {}
    result = ElasticTrainer(config, keep_final_state=not layout, **split).fit()
    assert result.ok, result.exit
    reference, global_weights = reference_diloco(config, STEPS)
    assert max_relative_difference(result.losses, reference) <= 1e-5
    # the rounds are not every step's sum: the same job summing every step trains otherwise
    every_step, _ = reference_run(config, STEPS)
    assert max_relative_difference(reference, every_step) > 1e-3
    steps = result.summary["steps"]
    assert [record["step"] for record in steps if record["outer_step"]] == [3, 7, 11]
    inner = {record["cross_group_bytes"] for record in steps if not record["outer_step"]}
    outer = {record["cross_group_bytes"] for record in steps if record["outer_step"]}
    # inside a round only the step's row crosses groups; at its end, the pseudo-gradients too
    assert len(inner) == len(outer) == 1 and 0 < 100 * max(inner) < min(outer), (inner, outer)
    if "sync__precision" in layout:  # what crossed is the codes: fp32 pseudo-gradients train otherwise
        in_fp32, _ = reference_diloco(tiny_config(tmp_path, groups=2, steps=STEPS, **ROUNDS), STEPS)
        assert max_relative_difference(reference, in_fp32) > 1e-4
    if not layout:  # the global weights, compared whole: a group of one rank holds them so
        final = result.final_state[(0, 0, 0, 0)]
        # Sums in another order (micro-batches, the ring) move fp32 weights by ulps that Adam
        # carries on; a step lost or applied twice moves them by about the inner lr, 3e-3.
        assert max_parameter_difference(final, global_weights) <= 1e-4
        assert max(weight.abs().max().item() for weight in global_weights) > 0.1  # weights that say something


# Streaming DiLoCo: fragment 0 (the embeddings and block 1) syncs after each round's step 1,
# fragment 1 (block 0, the final norm and the output) after its step 3; both after every second
# round's, where the learners are alike: steps 7 and 15.
FRAGMENTS = {**ROUNDS, "sync__fragments": 2}


DELAYED = {"sync__sync_delay": 1, "sync__fragment_alpha": 0.5}


@pytest.mark.parametrize("layout", [{}, {"scaling__pp": 2, "sync__fragments": 4}, DELAYED,
                                    {"shard": 2, "tp": 2, "sync__precision": "int4", **DELAYED}],
                         ids=["one-rank-groups", "pp2-four-fragments", "delayed", "shard2-tp2-int4-delayed"])
def test_streaming_fragments_train_as_streaming_diloco_in_one_process(ray_cluster, tmp_path, layout):
    """At pp 2 with four fragments, each a step's turn, a stage holds two fragments and none of
    the other two. Delayed: each turn's exchange (but at steps 7 and 15) crosses during the next
    step and merges after it, each learner keeping half its own weights of the fragment."""
    steps = 16
    config = tiny_config(tmp_path, groups=2, steps=steps, **{**FRAGMENTS, **layout})
    split = {"split_fn": split_transformer} if "scaling__pp" in layout else {}
    result = ElasticTrainer(config, keep_final_state=layout in ({}, DELAYED), **split).fit()
    assert result.ok, result.exit
    reference, global_weights = reference_diloco(config, steps)
    # each rank codes its own shards at int4: blocks the one-process run cuts elsewhere
    assert max_relative_difference(result.losses, reference) <= (1e-2 if "sync__precision" in layout else 1e-5)
    whole_model, _ = reference_diloco(tiny_config(tmp_path, groups=2, steps=steps, **ROUNDS), steps)
    assert max_relative_difference(reference, whole_model) > 1e-4
    if "sync__sync_delay" in layout:  # merged later, mixed: not the undelayed fragments' run
        undelayed, _ = reference_diloco(tiny_config(tmp_path, groups=2, steps=steps, **FRAGMENTS), steps)
        assert max_relative_difference(reference, undelayed) > 1e-4
        exchanged = [record for record in result.summary["steps"] if record["outer_sum_s"]]
        # merged one step after each turn but the aligned ones, which are exchanged then
        assert [record["step"] for record in exchanged] == [2, 4, 6, 7, 10, 12, 14, 15], exchanged
    records = result.summary["steps"]
    turns = range(steps) if "scaling__pp" in layout else range(1, steps, 2)
    assert [record["step"] for record in records if record["outer_step"]] == list(turns)
    if "scaling__pp" in layout:
        return
    handed = {record["step"]: record["cross_group_bytes"] for record in records}
    row = handed[0]
    # a turn hands one fragment's pseudo-gradients; the last step of every second round both
    assert row < handed[1] < handed[7] and row < handed[3] < handed[7]
    assert handed[1] + handed[3] - row == handed[7] == handed[15] and handed[5] == handed[1]
    if layout in ({}, DELAYED):
        final = result.final_state[(0, 0, 0, 0)]
        assert max_parameter_difference(final, global_weights) <= 1e-4


@pytest.mark.parametrize("layout,inject,redone", [
    ({}, "kill:rank=0,step=10", (8, 2)),
    ({}, "kill:rank=0,step=9,during=outer-step", (8, 1)),
    pytest.param({"scaling__pp": 2}, "kill:rank=1,step=11;hang:rank=2,step=13", None,
                 marks=pytest.mark.waits),  # the hang waits out its deadline
    (DELAYED, "kill:rank=0,step=10", (8, 2)),
], ids=["after-a-fragments-turn", "inside-a-fragments-outer-step", "pp2-kill-and-hang", "a-delayed-exchange-in-flight"])
def test_a_learner_lost_between_fragments_turns_redoes_the_work_since_the_learners_were_alike(
        ray_cluster, tmp_path, layout, inject, redone):
    """Fragment 0 synced after step 9, its learners' other fragment not: the survivor goes back
    to step 8, where the learners were alike, and every step since is trained again. Delayed:
    fragment 0's exchange is crossing as the kill lands; the survivor's merge fails."""
    steps = 16
    config = tiny_config(tmp_path, groups=2, min_groups=1, steps=steps, scaling__spares=1,
                         fault_tolerance__inject=inject, **FRAGMENTS, **layout, **FAST_DETECTION)
    split = {"split_fn": split_transformer} if "scaling__pp" in layout else {}
    result = ElasticTrainer(config, **split).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    back_to = [(event["step"], event["rolled_back_steps"]) for event in events
               if event["kind"] in (EventKind.ROUND_REDONE, EventKind.RESTORED_FROM_MEMORY)]
    if redone:
        assert back_to == [redone], back_to
    else:
        assert back_to and {step for step, _ in back_to} == {8}, back_to
    assert [record["step"] for record in result.summary["steps"]] == list(range(steps))
    reference, _ = reference_diloco(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5


@pytest.mark.parametrize("kill_step", [6, 7, 8], ids=["inside-a-round", "at-a-rounds-last-step", "at-a-rounds-first"])
def test_a_learner_killed_redoes_the_round_with_the_clean_runs_losses(ray_cluster, tmp_path, kill_step):
    # min_groups 1: the survivor could go on alone; the round waits for its lost learner instead
    config = tiny_config(tmp_path, groups=2, min_groups=1, steps=STEPS, scaling__spares=1,
                         checkpoint__memory_every=4, fault_tolerance__inject=f"kill:rank=0,step={kill_step}",
                         **ROUNDS, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    redone = [event for event in events if event["kind"] == EventKind.ROUND_REDONE]
    if kill_step % 4:  # inside the round from step 4: the survivor goes back to its start
        assert [(event["step"], event["groups"], event["rolled_back_steps"]) for event in redone] == [
            (4, [1], kill_step - 4)]
    else:  # between rounds: nothing to redo, the group heals from its peer
        assert not redone
    [healed] = [event for event in events if event["kind"] == EventKind.GROUP_HEALED]
    assert (healed["group"], healed["source_group"]) == (0, 1)
    assert not [kind for kind in kinds(result) if kind.startswith("restored-")]
    assert [record["step"] for record in result.summary["steps"]] == list(range(STEPS))
    reference, _ = reference_diloco(config, STEPS)
    assert max_relative_difference(result.losses, reference) <= 1e-5


def test_a_rank_killed_inside_the_outer_step_fails_every_learners_exchange_and_the_round_is_redone(ray_cluster,
                                                                                                    tmp_path):
    """The kill lands after the round's last inner step committed, as the dying rank's first
    collective of the outer step is sent: every learner's exchange fails, every group is broken
    and takes the round's start from the memory tier, and the round is trained again."""
    config = tiny_config(tmp_path, groups=2, min_groups=1, steps=STEPS, scaling__spares=1,
                         checkpoint__memory_every=4, fault_tolerance__inject="kill:rank=0,step=7,during=outer-step",
                         **ROUNDS, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    # the round's last step is not committed: the survivor goes back to the round's start
    assert [e["step"] for e in events if e["kind"] == EventKind.STEP_DISCARDED] == [7]
    assert [(e["step"], e["groups"], e["rolled_back_steps"]) for e in events
            if e["kind"] == EventKind.RESTORED_FROM_MEMORY] == [(4, [1], 3)]
    assert [record["step"] for record in result.summary["steps"]] == list(range(STEPS))
    assert not [kind for kind in kinds(result) if kind in ("restored-from-checkpoint", "restored-initial-state")]
    reference, _ = reference_diloco(config, STEPS)
    assert max_relative_difference(result.losses, reference) <= 1e-5


def test_a_round_lost_before_the_memory_tier_holds_its_start_restarts_from_the_initial_state(ray_cluster, tmp_path):
    config = tiny_config(tmp_path, groups=2, steps=8, checkpoint__memory_every=8,
                         fault_tolerance__inject="kill:rank=1,step=2", **ROUNDS, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    assert EventKind.RESTORED_INITIAL_STATE in kinds(result)
    reference, _ = reference_diloco(config, 8)
    assert max_relative_difference(result.losses, reference) <= 1e-5


def test_every_learner_lost_inside_a_round_restores_the_checkpoint_at_its_start(ray_cluster, tmp_path):
    """Both copies of the position lost (each group's only rank killed at once): no memory tier
    holds the round's start, so every group restores the checkpoint saved there, or, where its
    upload was still in flight as the ranks died (a busy machine), the initial state."""
    config = tiny_config(tmp_path, groups=2, steps=STEPS, checkpoint__every=4, checkpoint__memory_every=4,
                         fault_tolerance__inject="kill:rank=0,step=6;kill:rank=1,step=6", **ROUNDS, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    restored = [(event["kind"], event["step"]) for event in events if event["kind"].startswith("restored-")]
    saved = EventKind.CHECKPOINT_FAILED not in kinds(result)
    assert restored == ([(EventKind.RESTORED_FROM_CHECKPOINT, 4)] if saved else
                        [(EventKind.RESTORED_INITIAL_STATE, 0)]), restored
    assert [record["step"] for record in result.summary["steps"]] == list(range(STEPS))
    reference, _ = reference_diloco(config, STEPS)
    assert max_relative_difference(result.losses, reference) <= 1e-5


@pytest.mark.waits  # paced steps
def test_a_stop_asked_inside_a_round_takes_effect_at_its_end(ray_cluster, tmp_path):
    """A stop (SIGTERM, as a preemption sends) asked as the driver hears of the first step, while
    the ranks are somewhere inside a round, stops the run at that round's end, whose state the
    final checkpoint holds. Steps paced: the run is far from its end when the stop comes."""
    steps = 40
    config = tiny_config(tmp_path, groups=2, steps=steps, **ROUNDS)

    def stop_after_first_step(result) -> None:
        if result.step == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    result = ElasticTrainer(config, model_fn=paced_model(config, 0.1), on_step=[stop_after_first_step]).fit()
    summary = result.summary
    assert summary["exit"] == "preempted", summary["exit"]
    stopped_at = len(summary["steps"])
    assert stopped_at % 4 == 0 and stopped_at < steps, stopped_at
    saved = [event["step"] for event in summary["events"] if event["kind"] == EventKind.CHECKPOINT_COMMITTED]
    assert saved[-1] == stopped_at, saved


def test_a_bit_flipped_between_rounds_is_found_and_every_learner_goes_back_to_the_verified_round_start(ray_cluster, tmp_path):
    """The integrity check compares the learners where they are equal, between rounds: the bit
    flips in group 1 as round 2 begins, and the check at its first step finds it."""
    config = tiny_config(tmp_path, groups=3, steps=STEPS, integrity__every=4,
                         fault_tolerance__inject="flip:rank=1,step=8", **ROUNDS, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    [found] = [event for event in result.summary["events"] if event["kind"] == EventKind.INTEGRITY_MISMATCH]
    assert (found["step"], found["suspects"], found["majority"]) == (8, [1], [0, 2])
    # the memory tier holds every rank's copy of the last round's start the check verified: every
    # group goes back to it (``StateSources.after_mismatch``), all at once or, where one group is
    # built again before the others (a busy machine), that one from memory and the others from it
    events = result.summary["events"]
    [restored] = [event for event in events if event["kind"] == EventKind.RESTORED_FROM_MEMORY]
    healed = {event["group"] for event in events if event["kind"] == EventKind.GROUP_HEALED and event["t"] >= restored["t"]}
    assert restored["step"] == 4 and set(restored["groups"]) | healed == {0, 1, 2}, (restored, healed)
    reference, _ = reference_diloco(config, STEPS)
    assert max_relative_difference(result.losses, reference) <= 1e-5


@pytest.mark.parametrize("rounds", [ROUNDS, FRAGMENTS], ids=["whole-model", "fragments"])
def test_a_resume_at_another_layout_carries_the_outer_momentum(ray_cluster, tmp_path, rounds):
    """Two rounds at one rank a group, checkpointed; two more after a resume with each group's
    state sharded over two ranks: the clean run's losses. The round after the resume ends with
    an outer step, whose momentum the last round's losses show (with fragments, each
    fragment's)."""
    first = tiny_config(tmp_path, groups=2, steps=8, checkpoint__every=8, **rounds)
    assert ElasticTrainer(first).fit().ok
    resumed = tiny_config(tmp_path, groups=2, shard=2, steps=16, checkpoint__every=8, **rounds)
    result = ElasticTrainer(resumed).fit()
    assert result.ok and result.summary["resumed_from_step"] == 8, result.exit
    reference, _ = reference_diloco(resumed, 16)
    assert max_relative_difference(result.losses, reference[8:]) <= 1e-5


@pytest.mark.waits  # the hang waits out its deadline
@pytest.mark.parametrize("layout", [{"scaling__pp": 2}, {"shard": 2, "scaling__ep": 2, **EXPERTS, **BALANCED}],
                         ids=["pp2", "ep2"])
def test_a_kill_and_a_hang_inside_rounds_at_split_layouts_keep_the_clean_runs_losses(ray_cluster, tmp_path, layout):
    """A stage (pp 2), or a rank holding half the experts (ep 2), killed inside the second round,
    and one of the other group hung inside the third: each round redone, the routing bias moved
    alike on every learner throughout."""
    config = tiny_config(tmp_path, groups=2, min_groups=1, steps=STEPS, scaling__spares=1, checkpoint__memory_every=4,
                         fault_tolerance__inject="kill:rank=1,step=5;hang:rank=2,step=9", **ROUNDS, **layout,
                         **FAST_DETECTION)
    split = {"split_fn": split_transformer} if "scaling__pp" in layout else {}
    result = ElasticTrainer(config, **split).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    assert sorted((e["step"], e["rank"], e["cause"]) for e in events if e["kind"] == EventKind.RANK_FAILED) == [
        (5, 1, "death"), (9, 2, "hang")]
    assert [(e["step"], e["rolled_back_steps"]) for e in events if e["kind"] == EventKind.ROUND_REDONE] == [
        (4, 1), (8, 1)]
    reference, _ = reference_diloco(config, STEPS)
    assert max_relative_difference(result.losses, reference) <= 1e-5


@pytest.mark.waits  # the hang waits out its deadline
def test_int4_pseudo_gradients_of_sharded_ranks_keep_the_learners_alike_and_a_redone_round_the_clean_runs(
        ray_cluster, tmp_path):
    """At shard 2 x tp 2 each rank codes its own shards: blocks the one-process DiLoCo, which codes
    whole parameters, cuts elsewhere. The learners still decode the same bytes (the integrity
    check at every round's end finds them alike), and a kill and a hang redo their rounds with
    the clean run's losses."""
    layout = {"shard": 2, "tp": 2, "sync__precision": "int4", "integrity__every": 4, **ROUNDS}
    clean = ElasticTrainer(tiny_config(tmp_path / "clean", groups=2, steps=STEPS, **layout)).fit()
    config = tiny_config(tmp_path / "faults", groups=2, min_groups=1, steps=STEPS, scaling__spares=1,
                         checkpoint__memory_every=4, fault_tolerance__inject="kill:rank=1,step=5;hang:rank=6,step=9",
                         **layout, **FAST_DETECTION)
    result = ElasticTrainer(config).fit()
    assert clean.ok and result.ok, (clean.exit, result.exit)
    assert EventKind.INTEGRITY_MISMATCH not in kinds(clean) + kinds(result)
    assert [e["step"] for e in result.summary["events"] if e["kind"] == EventKind.ROUND_REDONE] == [4, 8]
    assert max_relative_difference(result.losses, clean.losses) <= 1e-5
    reference, _ = reference_diloco(config, STEPS)  # other blocks: the codes' rounding, not a step's
    assert 0 < max_relative_difference(clean.losses, reference) <= 1e-2


def learners_of(result) -> list[list[int]]:
    """The groups that stepped at each committed step, as the run recorded them."""
    return [sorted(int(group) for group, samples in record["group_samples"].items() if samples)
            for record in result.summary["steps"]]


@pytest.mark.waits  # paced steps
@pytest.mark.parametrize("kill_step", [2, 5, 7], ids=["in-the-first-round", "one-step-into-a-round",
                                                      "at-a-rounds-last-step"])
def test_a_learner_dropped_inside_a_round_returns_its_samples_and_the_others_go_on(ray_cluster, tmp_path, kill_step):
    """``lost_learner = "drop"``: the survivor goes on from where it stands (nothing redone); the
    lost learner's samples of the round are the next steps' first; its group, back on the warm
    spare, joins the round from its start (the memory tier's copy), taking its share of the
    round's remaining steps; the outer step weighs each learner by its tokens of the round. The
    one-process DiLoCo with the same learners step by step trains the same losses."""
    # paced steps: the group comes back on the warm spare within a round or two, well before the end
    steps = 20
    config = tiny_config(tmp_path, groups=2, min_groups=1, steps=steps, scaling__spares=1, checkpoint__memory_every=4,
                         fault_tolerance__inject=f"kill:rank=0,step={kill_step}", sync__lost_learner="drop",
                         **ROUNDS, **FAST_DETECTION)
    result = ElasticTrainer(config, model_fn=paced_model(config, 0.2)).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    [dropped] = [event for event in events if event["kind"] == EventKind.LEARNER_DROPPED]
    round_start = kill_step - kill_step % 4
    assert (dropped["step"], dropped["groups"], dropped["round_start"]) == (kill_step, [0], round_start)
    assert dropped["returned_samples"] == (kill_step - round_start) * config.global_batch // 2
    assert EventKind.ROUND_REDONE not in kinds(result) and result.summary["steps_rolled_back"] == 0
    learners = learners_of(result)
    assert learners[-1] == [0, 1], learners
    if learners[kill_step] == [0, 1]:  # back within the round (on a busy machine, perhaps at the next)
        joined = [(event["step"], event["groups"], event["rolled_back_steps"], event["joined_round"])
                  for event in events if event["kind"] == EventKind.RESTORED_FROM_MEMORY]
        # the first round's start is the initial state, which a group holds as it is built
        assert joined == ([(round_start, [0], 0, True)] if round_start else [])
    assert [record["step"] for record in result.summary["steps"]] == list(range(steps))
    reference, _ = reference_diloco(config, steps, learners, dropped={kill_step: [0]})
    assert max_relative_difference(result.losses, reference) <= 1e-5

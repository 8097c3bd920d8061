"""Bad input fails before any actor starts, naming the field and the fix."""

import re

import pytest

from elastic.cli import build_parser, train_overrides
from elastic.core.outer_rounds import OuterRounds, fragment_of
from elastic.setup.capacity import check_capacity, on_cluster
from elastic.setup.config import CheckpointConfig, ConfigError, parse_config, replay_off
from elastic.setup.preflight import build_config, load_config


def fails(values, *fragments):
    with pytest.raises(ConfigError) as caught:
        build_config(values)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


def test_tp_must_divide_heads():
    fails({"scaling": {"tp": 3}}, "scaling.tp=3 does not divide model.n_heads=4", "choose tp in")


def test_tp_must_divide_hidden_size():
    fails({"scaling": {"tp": 2}, "model": {"n_heads": 2, "n_kv_heads": 2, "dim": 64, "ffn_hidden": 99}},
          "model.ffn_hidden=99")


def test_min_groups_above_max():
    fails({"scaling": {"min_groups": 3, "max_groups": 2}}, "scaling", "min_groups=3 is larger than max_groups=2")


def test_a_mixture_with_nothing_to_balance_its_experts_is_warned_of_at_start(tmp_path):
    from elastic.setup.config import unbalanced_experts

    mixture = {"storage": str(tmp_path), "model": {"experts": 4, "experts_per_token": 2, "expert_hidden": 32}}
    warning = unbalanced_experts(build_config(mixture))
    assert warning.startswith("model.experts=4 with neither a routing bias nor a balance loss")
    assert "model.expert_bias_rate (DeepSeek-V3: 0.001)" in warning
    for balanced in ({"expert_bias_rate": 0.001}, {"aux_loss_weight": 0.01}):
        assert unbalanced_experts(build_config(mixture | {"model": mixture["model"] | balanced})) is None
    assert unbalanced_experts(build_config({"storage": str(tmp_path)})) is None  # a dense model


def test_unknown_keys_name_the_key_they_most_likely_meant():
    fails({"scaling": {"shards": 2}}, "scaling.shards: unknown key; did you mean scaling.shard?")
    fails({"stepz": 2}, "stepz: unknown key; did you mean steps?")
    fails({"shard": 2}, "shard: unknown key; did you mean scaling.shard?")  # a section's field at the top
    fails({"fault_tolerence": {}}, "fault_tolerence: unknown key; did you mean fault_tolerance?")
    fails({"scaling": {"zzz": 1}}, "scaling.zzz: unknown key; remove it or check its spelling")


@pytest.mark.parametrize("field,section", [("shard", "scaling"), ("tp", "scaling"), ("steps", None), ("global_batch", None)])
@pytest.mark.parametrize("value", [0, -2])
def test_zero_or_negative_sizes(field, section, value):
    values = {section: {field: value}} if section else {field: value}
    fails(values, f"{section + '.' if section else ''}{field}", "use a positive value")


def test_unreadable_data_path(tmp_path):
    fails({"data": {"path": str(tmp_path / "missing" / "*.txt")}}, "data.path", "matches no readable file")


def test_readable_data_glob(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 100)
    assert build_config({"data": {"path": str(tmp_path / "*.txt")}}).data.path


def test_layout_larger_than_cluster():
    config = build_config({"scaling": {"min_groups": 2, "max_groups": 2, "shard": 2, "tp": 2, "cpus_per_rank": 1}})
    with pytest.raises(ConfigError, match=r"= 8 ranks need 8 CPU .* but the cluster has 2"):
        check_capacity(config, {"CPU": 2.0})


def test_spares_the_cluster_has_no_room_for_are_warned_of():
    from elastic.setup.capacity import spares_beyond_capacity

    config = build_config({"scaling": {"min_groups": 1, "max_groups": 2, "shard": 2, "tp": 2, "spares": 100}})
    assert spares_beyond_capacity(config, {"CPU": 2.0}) == (
        "scaling.spares = 100, but beside 8 ranks at cpus_per_rank=0.25 the cluster has room for 0 (2 CPU); the "
        "others start only if the cluster grows")
    assert spares_beyond_capacity(config.model_copy(update={"scaling": config.scaling.model_copy(
        update={"spares": 2})}), {"CPU": 4.0}) is None


def test_groups_the_cluster_has_no_room_for_are_warned_of_with_a_layout_that_fits():
    from elastic.setup.capacity import groups_beyond_capacity

    # The default two groups with two stages each: 16 ranks of a 2-CPU machine's 8
    config = build_config({"scaling": {"min_groups": 1, "max_groups": 2, "shard": 2, "tp": 2, "pp": 2}})
    assert groups_beyond_capacity(config, {"CPU": 2.0}) == (
        "scaling.max_groups = 2 groups of pp x shard x tp = 2 x 2 x 2 = 8 ranks, but the cluster has room for 1 "
        "(2 CPU at cpus_per_rank=0.25): the other 1 wait for capacity, started only if the cluster grows; --groups 1 "
        "trains on what is here")
    assert groups_beyond_capacity(config, {"CPU": 4.0}) is None


def test_bad_fault_spec():
    fails({"fault_tolerance": {"inject": "explode:rank=1,step=2"}}, "unknown kind 'explode'")
    fails({"fault_tolerance": {"inject": "kill:step=2"}}, "needs rank=N")


def test_fault_targets_must_lie_in_the_layout():
    layout = {"scaling": {"max_groups": 2, "shard": 2, "tp": 2}}
    fails({**layout, "fault_tolerance": {"inject": "kill:rank=8,step=1"}},
          "invalid config: fault_tolerance.inject: rank=8 is outside the run's 8 ranks", "from 0 to 7")
    fails({**layout, "fault_tolerance": {"inject": "kill-group:group=2,step=1"}}, "group=2", "from 0 to 1")
    inject = "kill:rank=7,step=1;kill-group:group=1,step=2;kill:rank=random,step=3;kill-group:group=random,step=4"
    assert build_config({**layout, "fault_tolerance": {"inject": inject}}).fault_tolerance.inject == inject


def test_storage_must_be_a_directory_this_process_can_write(tmp_path):
    (tmp_path / "file").write_text("")
    fails({"storage": str(tmp_path / "file" / "runs")}, "storage: ", "is a file, not a directory")
    fails({"storage": "foo://bar"}, "storage: unknown protocol 'foo'")
    assert build_config({"storage": str(tmp_path / "new" / "runs")}).storage == str(tmp_path / "new" / "runs")
    assert not (tmp_path / "new").exists()  # checked, not created: that is the run's to do


def test_parsing_reads_no_storage_nor_data_and_a_trainer_runs_the_preflight_it_skipped(tmp_path):
    from elastic.trainer import ElasticTrainer

    (tmp_path / "file").write_text("")
    unchecked = parse_config({"storage": str(tmp_path / "file" / "runs"), "data": {"path": str(tmp_path / "none.txt")}})
    with pytest.raises(ConfigError, match="^invalid config: storage: .* is a file, not a directory"):
        ElasticTrainer(unchecked)
    with pytest.raises(ConfigError, match="^invalid config: data.path: .*matches no readable file"):
        ElasticTrainer(parse_config({"data": {"path": str(tmp_path / "none.txt")}}))


def test_file_and_flags_merge(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('steps = 7\n[scaling]\nshard = 1\ntp = 1\n')
    args = build_parser().parse_args(["train", "--config", str(path), "--groups", "1:3", "--steps", "9"])
    config = load_config(args.config, train_overrides(args))
    assert (config.steps, config.scaling.min_groups, config.scaling.max_groups, config.scaling.shard) == (9, 1, 3, 1)
    yaml_path = tmp_path / "job.yaml"
    yaml_path.write_text("steps: 5\nscaling:\n  tp: 1\n")
    assert load_config(yaml_path).steps == 5


def test_unreadable_config_file(tmp_path):
    with pytest.raises(ConfigError, match="--config: cannot read"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize("name,content,problem", [
    ("job.yaml", b"- steps: 5\n", "holds a list at its top level"),
    ("job.yml", b"just text\n", "holds a str at its top level"),
    ("job.toml", "steps = 5 # caf\xe9\n".encode("utf-16"), "is not UTF-8 text"),
])
def test_config_files_must_be_utf8_mappings(tmp_path, name, content, problem):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=f"--config: .*{name} {problem}"):
        load_config(tmp_path / name)


def test_device_follows_the_cluster():
    auto = build_config({})
    assert on_cluster(auto, {"CPU": 16, "GPU": 8}).scaling.device == "cuda"
    assert on_cluster(auto, {"CPU": 16, "GPU": 8}).scaling.gpus_per_rank == 1
    assert on_cluster(auto, {"CPU": 16}).scaling.device == "cpu"
    assert on_cluster(auto, {"CPU": 16}).scaling.gpus_per_rank == 0
    cuda = build_config({"scaling": {"device": "cuda"}})
    assert on_cluster(cuda, {"CPU": 16, "GPU": 8}).scaling.gpus_per_rank == 1  # --device cuda: one GPU per rank
    half = build_config({"scaling": {"device": "cuda", "gpus_per_rank": 0.5, "gpu_collectives": "gloo"}})
    assert on_cluster(half, {"GPU": 8}).scaling.gpus_per_rank == 0.5
    cpu_only = build_config({"scaling": {"gpus_per_rank": 0}})
    assert on_cluster(cpu_only, {"GPU": 8}).scaling.device == "cpu"
    fails({"scaling": {"device": "cuda", "gpus_per_rank": 0}}, "scaling", "device='cuda' needs gpus_per_rank > 0")
    fails({"scaling": {"device": "cpu", "gpus_per_rank": 1}}, "scaling", "set gpus_per_rank = 0")
    fails({"scaling": {"device": "cuda", "gpus_per_rank": 0.5}}, "scaling", "gpu_collectives = 'gloo'")


def test_gpu_layout_larger_than_cluster():
    config = on_cluster(build_config({"scaling": {"device": "cuda", "cpus_per_rank": 1}}), {"CPU": 64, "GPU": 2})
    with pytest.raises(ConfigError, match=r"= 4 ranks need 4 GPU .* but the cluster has 2"):
        check_capacity(config, {"CPU": 64, "GPU": 2})


def test_compute_settings():
    config = build_config({"compute": {"precision": "bf16", "compile": True, "activation_checkpointing": "full",
                                       "replicate_precision": "bf16"}})
    assert config.compute.precision == "bf16" and config.compute.compile
    fails({"compute": {"precision": "fp8"}}, "compute.precision")
    fails({"compute": {"activation_checkpointing": "partial"}}, "compute.activation_checkpointing")
    selective = build_config({"compute": {"activation_checkpointing": "selective", "selective_checkpointing": 2}})
    assert selective.compute.selective_checkpointing == 2
    assert build_config({}).compute.selective_checkpointing == "op"
    fails({"compute": {"selective_checkpointing": 0}}, "compute.selective_checkpointing")
    fails({"compute": {"selective_checkpointing": "layer"}}, "compute.selective_checkpointing")


def test_sequence_parallelism_is_on_with_tp_where_a_single_process_would_compute_the_same():
    assert build_config({"scaling": {"tp": 2}}).sequence_parallel
    assert not build_config({"scaling": {"tp": 1}}).sequence_parallel
    assert not build_config({"scaling": {"tp": 2, "sequence_parallel": False}}).sequence_parallel
    # Unset, it stays off where it cannot hold: dropout, or a sequence tp does not divide.
    assert not build_config({"scaling": {"tp": 2}, "model": {"dropout": 0.1}}).sequence_parallel
    assert not build_config({"scaling": {"tp": 2}, "data": {"seq_len": 63}}).sequence_parallel
    # Asked for there, it is refused naming the field and the fix.
    fails({"scaling": {"tp": 2, "sequence_parallel": True}, "model": {"dropout": 0.1}},
          "scaling.sequence_parallel with model.dropout=0.1", "set model.dropout = 0 or scaling.sequence_parallel = false")
    fails({"scaling": {"tp": 2, "sequence_parallel": True}, "data": {"seq_len": 63}},
          "data.seq_len=63 divisible by scaling.tp=2", "scaling.sequence_parallel = false")


def test_checkpoint_failure_limit_is_positive():
    fails({"checkpoint": {"max_consecutive_failures": 0}}, "checkpoint.max_consecutive_failures")


def test_kill_after_applies_to_kills_only():
    assert build_config({"fault_tolerance": {"inject": "kill:rank=1,step=2,after=0.5"}})
    fails({"fault_tolerance": {"inject": "hang:rank=1,step=2,after=0.5"}}, "applies to kill and kill-group")


def test_checkpoints_upload_from_a_process_of_each_rank_on_gpus_by_default():
    assert CheckpointConfig().upload_in_process(uses_gpu=True)
    assert not CheckpointConfig().upload_in_process(uses_gpu=False)
    assert CheckpointConfig(upload="process").upload_in_process(uses_gpu=False)
    assert not CheckpointConfig(upload="thread").upload_in_process(uses_gpu=True)


@pytest.mark.parametrize("section,field", [("fault_tolerance", "collective_timeout_s"), ("checkpoint", "grace_s"),
                                           ("scaling", "cpus_per_rank"), ("scaling", "gpus_per_rank"),
                                           ("optimizer", "lr"), ("stragglers", "threshold")])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), "inf", "nan"])
def test_every_float_must_be_finite(section, field, value):
    fails({section: {field: value}}, f"{section}.{field}", "finite number", "inf and nan are not allowed")


def test_inf_in_a_config_file_is_refused(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[fault_tolerance]\ncollective_timeout_s = inf\n[checkpoint]\ngrace_s = nan\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert "fault_tolerance.collective_timeout_s: Input should be a finite number" in str(caught.value)
    assert "checkpoint.grace_s: Input should be a finite number" in str(caught.value)


@pytest.mark.parametrize("values,field,limit", [
    ({"fault_tolerance": {"collective_timeout_s": 10**9}}, "fault_tolerance.collective_timeout_s", "86400"),
    ({"fault_tolerance": {"min_deadline_s": 10**9}}, "fault_tolerance.min_deadline_s", "86400"),
    ({"fault_tolerance": {"first_step_deadline_s": 10**9}}, "fault_tolerance.first_step_deadline_s", "86400"),
    ({"fault_tolerance": {"capacity_timeout_s": 10**9}}, "fault_tolerance.capacity_timeout_s", "604800"),
    ({"fault_tolerance": {"deadline_factor": 10**6}}, "fault_tolerance.deadline_factor", "1000"),
    ({"fault_tolerance": {"max_recoveries": 10**9}}, "fault_tolerance.max_recoveries", "1000000"),
    ({"checkpoint": {"grace_s": 10**9}}, "checkpoint.grace_s", "86400"),
    ({"checkpoint": {"every": 10**12}}, "checkpoint.every", "1000000000"),
    ({"checkpoint": {"keep": 10**6}}, "checkpoint.keep", "1000"),
    ({"checkpoint": {"max_consecutive_failures": 10**6}}, "checkpoint.max_consecutive_failures", "1000"),
    ({"checkpoint": {"s3_max_attempts": 10**6}}, "checkpoint.s3_max_attempts", "100"),
    ({"stragglers": {"regrow_cooldown_s": 10**9}}, "stragglers.regrow_cooldown_s", "604800"),
    ({"stragglers": {"window": 10**6}}, "stragglers.window", "10000"),
    ({"stragglers": {"patience": 10**6}}, "stragglers.patience", "10000"),
    ({"scaling": {"max_groups": 10**6}}, "scaling.max_groups", "4096"),
    ({"scaling": {"shard": 10**6}}, "scaling.shard", "4096"),
    ({"scaling": {"tp": 128}}, "scaling.tp", "64"),
    ({"scaling": {"cpus_per_rank": 10**6}}, "scaling.cpus_per_rank", "1024"),
    ({"scaling": {"gpus_per_rank": 100}}, "scaling.gpus_per_rank", "16"),
    ({"model": {"vocab_size": 10**12}}, "model.vocab_size", "1048576"),
    ({"model": {"dim": 2**31}}, "model.dim", "65536"),
    ({"model": {"n_layers": 10**6}}, "model.n_layers", "1024"),
    ({"model": {"n_heads": 10**6}}, "model.n_heads", "1024"),
    ({"model": {"n_kv_heads": 10**6}}, "model.n_kv_heads", "1024"),
    ({"model": {"ffn_hidden": 2**31}}, "model.ffn_hidden", "262144"),
    ({"data": {"seq_len": 2**31}}, "data.seq_len", "1048576"),
    ({"data": {"corpus_tokens": 10**12}}, "data.corpus_tokens", "1000000000"),
    ({"steps": 10**12}, "steps", "1000000000"),
    ({"global_batch": 2**31}, "global_batch", "1048576"),
    ({"micro_batch": 2**31}, "micro_batch", "1048576"),
    ({"seed": 2**64}, "seed", "4294967296"),
    ({"metrics": {"port": 70000}}, "metrics.port", "65535"),
])
def test_every_size_and_time_has_an_upper_bound(values, field, limit):
    fails(values, f"{field}: Input should be less than", limit, "use a smaller value")


def test_the_largest_sizes_and_times_are_accepted():
    config = build_config({
        "steps": 10**9, "global_batch": 2**20, "micro_batch": 2**20, "seed": 2**32 - 1,
        "scaling": {"min_groups": 4096, "max_groups": 4096, "shard": 4096, "tp": 64},
        "model": {"vocab_size": 2**20, "dim": 2**16, "n_heads": 64, "ffn_hidden": 2**18, "n_layers": 1024},
        "data": {"seq_len": 2**20, "corpus_tokens": 10**9},
        "checkpoint": {"grace_s": 86400, "every": 10**9},
        "fault_tolerance": {"collective_timeout_s": 86400, "capacity_timeout_s": 604800},
        "metrics": {"port": 65535},
    })
    assert config.fault_tolerance.collective_timeout_s == 86400


def test_a_boolean_is_never_taken_for_a_number():
    fails({"steps": True}, "steps: true is a boolean, not what this field takes; give a value of its type")
    fails({"scaling": {"tp": True}}, "scaling.tp: true is a boolean")
    fails({"steps": {"x": 1}}, "steps: Input should be a valid integer, got {'x': 1}; give a number")
    assert build_config({"compute": {"compile": True}}).compute.compile is True


def test_seed_is_not_negative():
    fails({"seed": -1}, "seed", "use a positive value")


@pytest.mark.parametrize("name", ["héllo", "run٣", "ｒｕｎ", "naïve-run", "run name", "a/b", ".", "..", ".hidden", ""])
def test_run_names_are_ascii_letters_digits_dash_underscore_dot(name):
    fails({"run_name": name}, "run_name: ", "only ASCII letters, digits, '-', '_' and '.'")


def test_run_names_may_hold_dots_and_are_bounded_in_length():
    assert build_config({"run_name": "llama-7b_run.2"}).run_name == "llama-7b_run.2"
    fails({"run_name": "r" * 129}, "run_name: String should have at most 128 characters")


def test_tp_divisor_message_is_short_and_names_the_nearest_sizes():
    with pytest.raises(ConfigError) as caught:
        build_config({"model": {"vocab_size": 50257}})
    message = str(caught.value)
    assert "scaling.tp=2 does not divide model.vocab_size=50257; choose tp in [1]" in message
    assert "nearest: 50256 or 50258" in message
    assert len(message) < 300, message


def test_tp_suggestions_divide_every_size():
    # 3, 6 and 12 divide n_heads but not the vocabulary, so they are no choice for tp
    fails({"scaling": {"tp": 8}, "model": {"vocab_size": 1 << 20, "n_heads": 12, "dim": 96, "ffn_hidden": 384}},
          "scaling.tp=8 does not divide model.n_heads=12; choose tp in [1, 2, 4] ", "nearest: 8 or 16")


def test_inject_nan_is_refused_naming_the_spec():
    fails({"fault_tolerance": {"inject": "slow:rank=1,factor=nan,step=2"}},
          "factor='nan' in 'slow:rank=1,factor=nan,step=2' is not a finite number")


def test_a_yaml_alias_bomb_and_a_huge_value_are_refused_in_one_short_line(tmp_path):
    """Nine lines whose aliases stand for 9**9 values: refused for their expansion, which is
    counted without expanding it; and a refused value of any size is shown cut short."""
    anchors = "abcdefghi"
    lines = ["steps:", f"  - &{anchors[0]} [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    lines += [f"  - &{name} [{', '.join([f'*{before}'] * 9)}]" for before, name in zip(anchors, anchors[1:])]
    (tmp_path / "bomb.yaml").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"^--config: .*bomb.yaml expands to more than 100,000 values") as refused:
        load_config(tmp_path / "bomb.yaml")
    assert "\n" not in str(refused.value)
    huge = [1] * 9
    for _ in range(8):  # 9**9 values, shared: a message that formatted them whole would not end
        huge = [huge] * 9
    with pytest.raises(ConfigError, match=r"^invalid config: steps: Input should be a valid integer, got \[\[") as refused:
        parse_config({"steps": huge})
    assert len(str(refused.value)) < 200


def test_cpu_offload_is_refused_where_fsdp2_does_not_hold_the_state_or_the_gradients_cannot_be_summed():
    with pytest.raises(ConfigError, match=r"compute.offload needs FSDP2, which a group of one rank"):
        parse_config({"scaling": {"shard": 1, "tp": 1}, "compute": {"offload": True}})
    with pytest.raises(ConfigError, match=r"compute.offload with scaling.ep=2: the split experts"):
        parse_config({"scaling": {"shard": 2, "tp": 1, "ep": 2}, "compute": {"offload": True},
                      "model": {"experts": 4}})
    config = parse_config({"scaling": {"shard": 2, "tp": 1, "max_groups": 2, "device": "cuda"},
                           "compute": {"offload": True}})
    with pytest.raises(ConfigError, match=r"compute.offload with scaling.max_groups=2 on GPUs"):
        check_capacity(config, {"CPU": 64, "GPU": 8})
    one_group = parse_config({"scaling": {"shard": 2, "tp": 1, "max_groups": 1, "device": "cuda"},
                              "compute": {"offload": True}})
    check_capacity(one_group, {"CPU": 64, "GPU": 8})


DILOCO = {"mode": "diloco", "outer_every": 4}


def test_diloco_rounds_the_state_intervals_left_at_their_defaults_up_to_whole_rounds():
    config = parse_config({"sync": DILOCO, "checkpoint": {"every": 8}})
    assert (config.checkpoint.every, config.checkpoint.memory_every, config.integrity.every, config.eval.every) == (
        8, 4, 12, 0)
    assert config.sync.outer_rounds.every == 4
    assert parse_config({}).sync.outer_rounds is None
    assert parse_config({"sync": {**DILOCO, "precision": "int4"}}).sync.outer_rounds.precision == "int4"
    # with fragments the learners are alike every ``fragments`` rounds: the intervals are those
    fragments = parse_config({"sync": {**DILOCO, "fragments": 2}, "steps": 16, "model": {"n_layers": 2}})
    assert (fragments.checkpoint.every, fragments.checkpoint.memory_every, fragments.integrity.every) == (24, 8, 16)


def test_streaming_fragments_sync_in_turn_and_all_at_once_where_the_learners_align():
    rounds = OuterRounds(every=8, lr=0.7, momentum=0.9, fragments=4)
    turns = {step: rounds.syncs_after(step) for step in range(40) if rounds.syncs_after(step)}
    assert turns == {1: (0,), 3: (1,), 5: (2,), 7: (3,), 9: (0,), 11: (1,), 13: (2,), 15: (3,), 17: (0,), 19: (1,),
                     21: (2,), 23: (3,), 25: (0,), 27: (1,), 29: (2,), 31: (0, 1, 2, 3), 33: (0,), 35: (1,), 37: (2,),
                     39: (3,)}
    assert (rounds.aligned_every, rounds.at_boundary(32), rounds.at_boundary(8), rounds.start_of(30)) == (
        32, True, False, 0)
    uneven = OuterRounds(every=10, lr=0.7, momentum=0.9, fragments=4)
    assert [step for step in range(10) if uneven.syncs_after(step)] == [1, 4, 6, 9]
    whole = OuterRounds(every=4, lr=0.7, momentum=0.9)
    assert [step for step in range(12) if whole.syncs_after(step)] == [3, 7, 11] and whole.syncs_after(3) == (0,)
    names = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.1._checkpoint_wrapped_module.norm.weight",
             "layers.2.feed_forward.w1.weight", "norm.weight", "output.weight"]
    assert fragment_of(names, 2) == [0, 1, 0, 1, 1, 1]
    assert fragment_of(names, 4) == [0, 1, 2, 3, 3, 3]
    assert fragment_of(names[3:], 4) == [3, 3, 3]  # a later pipeline stage: the blocks' numbers decide


@pytest.mark.parametrize("values, refused", [
    ({"sync": {**DILOCO, "fragments": 8}, "steps": 64}, "sync.outer_every=4 gives sync.fragments=8 a turn each"),
    ({"sync": {**DILOCO, "sync_delay": 1}}, "sync.sync_delay=1 and sync.fragments=1: a round's only outer step"),
    ({"sync": {**DILOCO, "fragment_alpha": 0.5}}, "sync.fragment_alpha=0.5 and sync.fragments=1"),
    ({"sync": {**DILOCO, "fragments": 2, "sync_delay": 2}, "steps": 64},
     "sync.sync_delay=2: a fragment's outer step must merge before the next fragment's turn, at least 2 steps later"),
    ({"sync": {**DILOCO, "outer_every": 8, "fragments": 8}, "steps": 128, "model": {"n_layers": 2}},
     "sync.fragments=8 cuts the model's 2 blocks, its embeddings and its output, 4 parts; lower sync.fragments"),
    ({"sync": {**DILOCO, "fragments": 2, "lost_learner": "drop"}, "steps": 64}, "set sync.lost_learner = \"redo\""),
    ({"sync": {**DILOCO, "fragments": 2}, "steps": 64, "checkpoint": {"memory_every": 4}},
     "checkpoint.memory_every=4: the learners hold the run's state only where every fragment syncs; make each a "
     "multiple of sync.outer_every x sync.fragments = 8"),
    ({"sync": {**DILOCO, "quorum": 3}}, "sync.quorum and sync.grace_s"),
    ({"sync": DILOCO, "compute": {"precision": "fp16"}}, "compute.precision=fp16"),
    ({"sync": DILOCO, "steps": 10}, "steps=10 is not a whole number of rounds of sync.outer_every=4; train 12 steps"),
    ({"sync": DILOCO, "integrity": {"every": 10}}, "integrity.every=10: the learners hold the run's state only "
                                                   "between rounds; make each a multiple of sync.outer_every=4"),
])
def test_diloco_refuses_in_one_line_what_it_cannot_hold(values, refused):
    with pytest.raises(ConfigError, match=re.escape(refused)) as error:
        parse_config(values)
    assert len(str(error.value).splitlines()) <= 2 and "sync.mode=diloco with" in str(error.value)


def test_a_kill_inside_the_outer_step_needs_diloco():
    with pytest.raises(ConfigError, match=re.escape("during=outer-step kills a rank inside DiLoCo's outer step; set "
                                                    "sync.mode = diloco")):
        parse_config({"fault_tolerance": {"inject": "kill:rank=0,step=3,during=outer-step"}})
    assert parse_config({"sync": DILOCO, "fault_tolerance": {"inject": "kill:rank=0,step=3,during=outer-step"}})


@pytest.mark.parametrize("values, said", [
    ({"scaling": {"max_groups": 3}, "sync": DILOCO, "steps": 64},
     "sync.mode=diloco: the learners hold different weights inside a round"),
    ({"scaling": {"max_groups": 3}, "model": {"dropout": 0.1}}, "model.dropout=0.1: a replay draws other random"),
])
def test_spot_checks_where_they_cannot_name_a_culprit_are_off_and_the_start_says_so(values, said):
    """A config saved whole (every field given) runs anywhere: the checks are off where they
    cannot hold, and a warning line says why."""
    warning = replay_off(parse_config({**values, "integrity": {"replay_every": 5}}))
    assert warning.startswith("integrity.replay_every=5: no spot checks, since ") and said in warning, warning
    assert replay_off(parse_config({})) is None  # two groups: each replays the other
    assert replay_off(parse_config({"scaling": {"max_groups": 1}, "model": {"dropout": 0.1}})) is None  # no replica

"""Bad input fails before any actor starts, naming the field and the fix."""

import pytest

from elastic.cli import build_parser, train_overrides
from elastic.config import CheckpointConfig, ConfigError, build_config, check_capacity, load_config, on_cluster


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


def test_unknown_keys():
    fails({"scaling": {"shards": 2}}, "scaling.shards: unknown key")
    fails({"stepz": 2}, "stepz: unknown key")


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


def test_bad_fault_spec():
    fails({"fault_tolerance": {"inject": "explode:rank=1,step=2"}}, "unknown kind 'explode'")
    fails({"fault_tolerance": {"inject": "kill:step=2"}}, "needs rank=N")


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


def test_device_follows_the_cluster():
    auto = build_config({})
    assert on_cluster(auto, {"CPU": 16, "GPU": 8}).scaling.device == "cuda"
    assert on_cluster(auto, {"CPU": 16, "GPU": 8}).scaling.gpus_per_rank == 1
    assert on_cluster(auto, {"CPU": 16}).scaling.device == "cpu"
    assert on_cluster(auto, {"CPU": 16}).scaling.gpus_per_rank == 0
    cuda = build_config({"scaling": {"device": "cuda"}})
    assert on_cluster(cuda, {"CPU": 16, "GPU": 8}).scaling.gpus_per_rank == 1  # --device cuda: one GPU per rank
    half = build_config({"scaling": {"device": "cuda", "gpus_per_rank": 0.5}})
    assert on_cluster(half, {"GPU": 8}).scaling.gpus_per_rank == 0.5
    cpu_only = build_config({"scaling": {"gpus_per_rank": 0}})
    assert on_cluster(cpu_only, {"GPU": 8}).scaling.device == "cpu"
    fails({"scaling": {"device": "cuda", "gpus_per_rank": 0}}, "scaling", "device='cuda' needs gpus_per_rank > 0")
    fails({"scaling": {"device": "cpu", "gpus_per_rank": 1}}, "scaling", "set gpus_per_rank = 0")


def test_gpu_layout_larger_than_cluster():
    config = on_cluster(build_config({"scaling": {"device": "cuda", "cpus_per_rank": 1}}), {"CPU": 64, "GPU": 2})
    with pytest.raises(ConfigError, match=r"= 4 ranks need 4 GPU .* but the cluster has 2"):
        check_capacity(config, {"CPU": 64, "GPU": 2})


def test_compute_settings():
    config = build_config({"compute": {"precision": "bf16", "compile": True, "activation_checkpointing": "full",
                                       "replicate_precision": "bf16"}})
    assert config.compute.precision == "bf16" and config.compute.compile
    fails({"compute": {"precision": "fp16"}}, "compute.precision")
    fails({"compute": {"activation_checkpointing": "selective"}}, "compute.activation_checkpointing")


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

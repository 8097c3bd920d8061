"""Bad input fails before any actor starts, naming the field and the fix."""

import pytest

from elastic.cli import build_parser, train_overrides
from elastic.config import ConfigError, build_config, check_capacity, load_config


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

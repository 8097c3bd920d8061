"""Model presets: valid configs with the published shapes, overridable, failing fast on a
bad name; the memory estimate's counts against the model's own tensors; docs/presets.md
equal to what the estimate prints."""

from pathlib import Path

import pytest
import ray
import torch

import elastic.trainer
from elastic.cli import build_parser, main, train_overrides
from elastic.core.topology import Topology
from elastic.setup.config import ConfigError, ModelConfig
from elastic.setup.hooks import model_args
from elastic.setup.preset_tables import host_memory_table, memory_table, shapes_table
from elastic.setup.memory_estimate import activation_bytes, memory_per_rank, parameter_count
from elastic.setup.preflight import build_config, load_config
from elastic.setup.presets import PRESETS
from elastic.testing.memory import SavedBytes, held_storages
from workers.model import Transformer

DOCS = Path(__file__).parent.parent / "docs" / "presets.md"

# The largest tp each preset's sizes (heads, kv heads, dim, ffn, vocabulary) allow up to 8.
FITTING_TP = {"tiny": 4, "llama-125m": 4, "llama3-1b": 8, "llama3-8b": 8, "llama3-70b": 8, "llama3-405b": 8,
              "mixtral-8x7b": 8, "mixtral-8x22b": 8, "qwen3-30b-a3b": 4, "qwen3-235b-a22b": 4}
# llama3-*: the parameter counts published for Llama 3.2 1B, Llama 3 8B and 70B, and Llama 3.1 405B.
EXPECTED_PARAMETERS = {
    "tiny": pytest.approx(139_584),
    "llama-125m": pytest.approx(125e6, abs=15e6),
    "llama3-1b": 1_235_814_400,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    # Mixtral 8x7B and 8x22B as published
    "mixtral-8x7b": 46_702_792_704,
    "mixtral-8x22b": 140_630_071_296,
    # Qwen3-30B-A3B and Qwen3-235B-A22B as their safetensors hold them
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
}


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_builds_a_config_whose_model_has_the_published_parameter_count(preset):
    config = build_config({"model": {"preset": preset}, "scaling": {"tp": FITTING_TP[preset]}})
    with torch.device("meta"):
        model = Transformer(model_args(config))
    count = sum(param.numel() for param in model.parameters())
    assert count == parameter_count(config.model) == EXPECTED_PARAMETERS[preset]


def test_tiny_is_the_model_defaults():
    assert ModelConfig(preset="tiny").model_dump() == ModelConfig().model_dump()


def test_given_fields_override_the_preset():
    model = build_config({"model": {"preset": "llama-125m", "n_layers": 2}}).model
    assert (model.n_layers, model.dim, model.vocab_size) == (2, 768, 32000)


def test_preset_flag_fills_what_the_config_file_leaves_out(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[model]\nn_layers = 2\n")
    args = build_parser().parse_args(["train", "--config", str(path), "--preset", "llama3-1b"])
    model = load_config(args.config, train_overrides(args)).model
    assert (model.n_layers, model.dim, model.kv_heads, model.tie_embeddings) == (2, 2048, 8, True)


def test_the_recorded_settings_hold_the_shape_not_the_preset_name():
    by_name = build_config({"model": {"preset": "llama-125m"}}).model_dump(mode="json")
    spelled_out = build_config({"model": PRESETS["llama-125m"]}).model_dump(mode="json")
    assert by_name == spelled_out and "preset" not in by_name["model"]


def test_unknown_preset_names_the_field_and_the_choices():
    with pytest.raises(ConfigError) as caught:
        build_config({"model": {"preset": "nope"}})
    assert "model.preset: unknown preset 'nope'; choose one of tiny, llama-125m, llama3-1b, llama3-8b" in str(caught.value)


def test_a_preset_keeps_the_layout_checks():
    with pytest.raises(ConfigError, match=r"scaling.tp=8 does not divide model.n_heads=12"):
        build_config({"model": {"preset": "llama-125m"}, "scaling": {"tp": 8}})


def test_cli_unknown_preset_fails_before_anything_starts(monkeypatch, capsys):
    def must_not_start(*args, **kwargs):
        pytest.fail("a bad preset got as far as starting the trainer")

    monkeypatch.setattr(ray, "init", must_not_start)
    monkeypatch.setattr(elastic.trainer, "ElasticTrainer", must_not_start)
    assert main(["train", "--preset", "nope", "--quiet"]) == 2
    assert "model.preset: unknown preset 'nope'; choose one of" in capsys.readouterr().err


@pytest.mark.parametrize("qwen3", [False, True], ids=["llama", "qwen3-heads"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activation_estimate_counts_what_autograd_saves(dtype, qwen3):
    # GQA, and every width distinct, so a term counted with the wrong width shows (Qwen3's
    # heads wider than dim / n_heads, with their query-key norms). Dropout stays off: on CPU
    # it saves a mask in the input's dtype, on CUDA the estimated one byte.
    heads = {"head_dim": 24, "qk_norm": True} if qwen3 else {}
    config = build_config({
        "model": {"vocab_size": 96, "dim": 128, "n_layers": 2, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 320,
                  **heads},
        "data": {"seq_len": 16},
    })
    model = Transformer(model_args(config)).to(dtype)
    batch, seq = 3, 16
    with SavedBytes(held_storages(model), floating_only=True) as saved:
        model(torch.randint(0, 96, (batch, seq)))
    estimate = activation_bytes(
        config.model, tp=1, tokens=batch * seq, compute=dtype.itemsize, activation_checkpointing=False
    )
    assert saved.total == estimate


def test_zero_2_holds_every_blocks_gathered_weights_and_offload_holds_no_state_on_the_device():
    model = ModelConfig(preset="llama3-8b")
    layout, batch = Topology(shard=8, tp=1), dict(seq_len=4096, micro_batch=1)
    zero_3 = memory_per_rank(model, layout, **batch)
    zero_2 = memory_per_rank(model, layout, **batch, reshard_after_forward=False)
    gathered_block = 2 * 218_112_000 / 2**30  # a Llama 3 8B block's weights in bf16
    assert zero_2["unsharded"] - zero_3["unsharded"] == pytest.approx((model.n_layers - 2) * gathered_block, rel=1e-3)
    offloaded = memory_per_rank(model, layout, **batch, offload=True)
    assert offloaded["parameters"] == offloaded["gradients"] == offloaded["optimizer"] == 0
    assert offloaded["total"] == pytest.approx(zero_3["total"] - zero_3["parameters"] - zero_3["gradients"]
                                               - zero_3["optimizer"])


def test_shards_split_the_states_and_logits_stay_whole():
    model = ModelConfig(preset="llama3-8b")
    whole = memory_per_rank(model, Topology(shard=1, tp=1), seq_len=4096, micro_batch=1)
    split = memory_per_rank(model, Topology(shard=8, tp=4), seq_len=4096, micro_batch=1)
    for state in ("parameters", "gradients", "optimizer"):
        assert split[state] == pytest.approx(whole[state] / 32, rel=1e-3)
    assert split["logits"] == whole["logits"]
    # TP splits attention and feed-forward activations, not the norms'.
    assert whole["activations"] / 4 < split["activations"] < whole["activations"]
    checkpointed = memory_per_rank(model, Topology(shard=8, tp=4), seq_len=4096, micro_batch=1,
                                   activation_checkpointing=True)
    assert checkpointed["activations"] < split["activations"] / 8
    assert split["total"] == pytest.approx(sum(value for name, value in split.items() if name != "total"))


def test_docs_tables_are_what_the_estimate_prints():
    text = DOCS.read_text()
    assert shapes_table() in text, "docs/presets.md is stale: paste `python -m elastic.setup.preset_tables` into it"
    assert memory_table() in text, "docs/presets.md is stale: paste `python -m elastic.setup.preset_tables` into it"
    assert host_memory_table() in text, "docs/presets.md is stale: paste `python -m elastic.setup.preset_tables` into it"

"""RoPE as Llama 3 publishes it: the base and Llama 3.1's frequency scaling from the config,
equal to Meta's reference arithmetic and to HuggingFace's Llama; the presets carry the
published settings."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from elastic.export import huggingface_model
from elastic.setup.config import ModelConfig
from elastic.setup.errors import ConfigError
from elastic.setup.preflight import build_config
from workers.model import ModelArgs, RopeScaling, Transformer, scaled_frequencies


def meta_reference(freqs: list[float], factor: float, low_freq_factor: float, high_freq_factor: float,
                   old_context_len: int) -> list[float]:
    """Llama 3.1's apply_scaling, element by element, as Meta's reference code writes it."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    new_freqs = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            new_freqs.append(freq)
        elif wavelen > low_freq_wavelen:
            new_freqs.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            new_freqs.append((1 - smooth) * freq / factor + smooth * freq)
    return new_freqs


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1 405B's, Llama 3.2 1B's
def test_the_scaled_frequencies_are_metas_in_all_three_bands(factor):
    head_dim, theta = 128, 500000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaled = scaled_frequencies(inv_freq, RopeScaling(factor=factor))
    expected = meta_reference(inv_freq.tolist(), factor, 1.0, 4.0, 8192)
    torch.testing.assert_close(scaled, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    ratios = (inv_freq / scaled).tolist()
    assert ratios[0] == 1.0 and ratios[-1] == pytest.approx(factor)  # kept, stretched
    assert any(1.0 < ratio < factor * (1 - 1e-9) for ratio in ratios)  # and blended between


def test_the_reference_model_with_llama3_rope_computes_what_huggingface_model_computes(tmp_path):
    transformers = pytest.importorskip("transformers")
    # wavelengths 6.3, 168 and 4,443 positions: one kept, one blended, one stretched
    args = ModelArgs(dim=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=32, rope_theta=500000.0,
                     rope_scaling=RopeScaling(factor=8.0, low_freq_factor=0.05, high_freq_factor=4.0,
                                              original_max_len=64))
    torch.manual_seed(0)
    ours = Transformer(args)
    state, config = huggingface_model(ours.state_dict(), args)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    llama = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    unscaled = Transformer(ModelArgs(**{**args.__dict__, "rope_scaling": None}))
    unscaled.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        torch.testing.assert_close(llama(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
    assert (unscaled.freqs - ours.freqs).abs().max() > 0.5  # the scaling moves the rotations it is compared on


def test_the_llama3_presets_carry_the_published_rope_settings():
    assert ModelConfig(preset="tiny").rope_theta == 10000.0 and ModelConfig(preset="tiny").rope_scaling is None
    for preset in ("llama3-1b", "llama3-8b", "llama3-70b", "llama3-405b"):
        assert ModelConfig(preset=preset).rope_theta == 500000.0, preset
    assert ModelConfig(preset="llama3-8b").rope_scaling is None and ModelConfig(preset="llama3-70b").rope_scaling is None
    assert ModelConfig(preset="llama3-1b").rope_scaling.factor == 32.0
    scaling = ModelConfig(preset="llama3-405b").rope_scaling
    assert (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_len) == (
        8.0, 1.0, 4.0, 8192)


def test_rope_scaling_with_its_bands_reversed_is_refused_naming_the_fields(tmp_path):
    with pytest.raises(ConfigError, match="model.rope_scaling.*high_freq_factor=1.0 must be above low_freq_factor=2.0"):
        build_config({"storage": str(tmp_path), "model": {
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 1.0}}})

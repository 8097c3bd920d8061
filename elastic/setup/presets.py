"""The named model shapes: standard Llama shapes, with their RoPE settings, and the Mixtral
mixtures of experts (Llama's attention, eight SwiGLU experts a layer, two a token), as presets
of the ``model`` section.

``model.preset`` fills the shape fields the config leaves out (see ``ModelConfig``). This
table is plain data, below the config that reads it; what each shape costs in memory is
``elastic.setup.memory_estimate``.
"""

from __future__ import annotations

from typing import Any

# The RoPE frequency scaling of the published configs (their rope_scaling, rope_type llama3).
LLAMA_3_1_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_len": 8192}
LLAMA_3_2_SCALING = {**LLAMA_3_1_SCALING, "factor": 32.0}

PRESETS: dict[str, dict[str, Any]] = {
    # The ModelConfig defaults: trains in seconds on CPU, for tests.
    "tiny": {"vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 192},
    # GPT-3 Small's width and depth with Llama's vocabulary and SwiGLU.
    "llama-125m": {"vocab_size": 32000, "dim": 768, "n_layers": 12, "n_heads": 12, "ffn_hidden": 2048},
    # meta-llama/Llama-3.2-1B
    "llama3-1b": {
        "vocab_size": 128256, "dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 8192,
        "tie_embeddings": True, "rope_theta": 500000.0, "rope_scaling": LLAMA_3_2_SCALING,
    },
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": {
        "vocab_size": 128256, "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336,
        "tie_embeddings": False, "rope_theta": 500000.0,
    },
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": {
        "vocab_size": 128256, "dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_hidden": 28672,
        "tie_embeddings": False, "rope_theta": 500000.0,
    },
    # meta-llama/Llama-3.1-405B
    "llama3-405b": {
        "vocab_size": 128256, "dim": 16384, "n_layers": 126, "n_heads": 128, "n_kv_heads": 8, "ffn_hidden": 53248,
        "tie_embeddings": False, "rope_theta": 500000.0, "rope_scaling": LLAMA_3_1_SCALING,
    },
    # mistralai/Mixtral-8x7B-v0.1: 46.7 B parameters, 12.9 B of them active a token
    "mixtral-8x7b": {
        "vocab_size": 32000, "dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_hidden": 14336,
        "tie_embeddings": False, "rope_theta": 1000000.0, "experts": 8, "experts_per_token": 2,
    },
    # mistralai/Mixtral-8x22B-v0.1: 141 B parameters, 39 B active
    "mixtral-8x22b": {
        "vocab_size": 32768, "dim": 6144, "n_layers": 56, "n_heads": 48, "n_kv_heads": 8, "ffn_hidden": 16384,
        "tie_embeddings": False, "rope_theta": 1000000.0, "experts": 8, "experts_per_token": 2,
    },
    # Qwen/Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active; heads of 128, wider than dim / n_heads
    "qwen3-30b-a3b": {
        "vocab_size": 151936, "dim": 2048, "n_layers": 48, "n_heads": 32, "n_kv_heads": 4, "head_dim": 128,
        "qk_norm": True, "ffn_hidden": 6144, "norm_eps": 1e-6, "tie_embeddings": False, "rope_theta": 1000000.0,
        "experts": 128, "experts_per_token": 8, "expert_hidden": 768,
    },
    # Qwen/Qwen3-235B-A22B: 235 B parameters, 22 B active
    "qwen3-235b-a22b": {
        "vocab_size": 151936, "dim": 4096, "n_layers": 94, "n_heads": 64, "n_kv_heads": 4, "head_dim": 128,
        "qk_norm": True, "ffn_hidden": 12288, "norm_eps": 1e-6, "tie_embeddings": False, "rope_theta": 1000000.0,
        "experts": 128, "experts_per_token": 8, "expert_hidden": 1536,
    },
}

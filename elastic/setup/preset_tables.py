"""The tables of ``docs/presets.md``: each preset's shape, and the memory per rank of the
documented layouts (each validated as a full config). ``python -m elastic.setup.preset_tables``
prints both; a test keeps the document equal to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from elastic.core.topology import Topology
from elastic.setup.config import ModelConfig, parse_config
from elastic.setup.memory_estimate import H100_BUDGET_GIB, host_memory_per_rank, memory_per_rank, parameter_count
from elastic.setup.presets import PRESETS


@dataclass(frozen=True)
class Layout:
    preset: str
    shard: int
    tp: int
    seq_len: int
    micro_batch: int
    activation_checkpointing: Literal["none", "full"] = "none"
    sequence_parallel: bool | None = None  # None: the config's default (on where tp > 1 allows it)
    pp: int = 1
    ep: int = 1  # the experts split over blocks of this many shard ranks
    cp: int = 1  # each sequence split over this many ranks

    @property
    def topology(self) -> Topology:
        return Topology(self.shard, self.tp, pp=self.pp, ep=self.ep, cp=self.cp)

    @property
    def dimensions(self) -> str:
        shard = f"{self.shard} (ep {self.ep})" if self.topology.expert_parallel else f"{self.shard}"
        return f"{self.pp} × {shard} × {self.cp} × {self.tp}"


DOC_LAYOUTS = [
    Layout("tiny", shard=1, tp=1, seq_len=64, micro_batch=4),
    Layout("llama-125m", shard=1, tp=1, seq_len=2048, micro_batch=8),
    Layout("llama-125m", shard=8, tp=1, seq_len=2048, micro_batch=8),
    Layout("llama3-1b", shard=8, tp=1, seq_len=4096, micro_batch=2),
    Layout("llama3-1b", shard=8, tp=2, seq_len=4096, micro_batch=2),
    Layout("llama3-8b", shard=8, tp=1, seq_len=8192, micro_batch=1),
    Layout("llama3-8b", shard=8, tp=1, seq_len=8192, micro_batch=1, activation_checkpointing="full"),
    Layout("llama3-8b", shard=8, tp=4, seq_len=8192, micro_batch=1, sequence_parallel=False),
    Layout("llama3-8b", shard=8, tp=4, seq_len=8192, micro_batch=1),
    Layout("llama3-8b", shard=32, tp=2, seq_len=8192, micro_batch=1),
    Layout("llama3-70b", shard=16, tp=8, seq_len=8192, micro_batch=1),
    Layout("llama3-70b", shard=16, tp=8, seq_len=8192, micro_batch=1, activation_checkpointing="full"),
    Layout("llama3-70b", shard=4, tp=8, seq_len=8192, micro_batch=1, activation_checkpointing="full", pp=4),
    # long contexts: Llama 3's 128 k tokens, each sequence split over cp ranks
    Layout("llama3-8b", shard=1, tp=1, seq_len=131072, micro_batch=1, cp=8),
    Layout("llama3-8b", shard=1, tp=1, seq_len=131072, micro_batch=1, activation_checkpointing="full", cp=8),
    Layout("llama3-8b", shard=1, tp=2, seq_len=131072, micro_batch=1, activation_checkpointing="full", cp=16),
    Layout("llama3-70b", shard=1, tp=8, seq_len=131072, micro_batch=1, activation_checkpointing="full", cp=8),
    Layout("llama3-70b", shard=1, tp=8, seq_len=131072, micro_batch=1, activation_checkpointing="full", cp=16),
    Layout("llama3-405b", shard=32, tp=8, seq_len=8192, micro_batch=1, activation_checkpointing="full"),
    Layout("llama3-405b", shard=64, tp=8, seq_len=8192, micro_batch=1, activation_checkpointing="full"),
    Layout("llama3-405b", shard=8, tp=8, seq_len=8192, micro_batch=1, activation_checkpointing="full", pp=8),
    Layout("llama3-405b", shard=4, tp=8, seq_len=8192, micro_batch=1, activation_checkpointing="full", pp=16),
    Layout("mixtral-8x7b", shard=8, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full"),
    Layout("mixtral-8x7b", shard=32, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full"),
    Layout("mixtral-8x22b", shard=32, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full"),
    Layout("mixtral-8x22b", shard=64, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full"),
    Layout("mixtral-8x7b", shard=8, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full", ep=8),
    Layout("mixtral-8x7b", shard=8, tp=4, seq_len=4096, micro_batch=1, activation_checkpointing="full", pp=4, ep=8),
    Layout("mixtral-8x7b", shard=32, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full", ep=8),
    Layout("qwen3-30b-a3b", shard=8, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full"),
    Layout("qwen3-30b-a3b", shard=8, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full", ep=8),
    Layout("qwen3-30b-a3b", shard=32, tp=1, seq_len=4096, micro_batch=1, activation_checkpointing="full", ep=32),
    Layout("qwen3-235b-a22b", shard=64, tp=4, seq_len=4096, micro_batch=1, activation_checkpointing="full", ep=64),
    Layout("qwen3-235b-a22b", shard=16, tp=4, seq_len=4096, micro_batch=1, activation_checkpointing="full", pp=4,
           ep=16),
]


def _format_count(count: int) -> str:
    return f"{count / 1e9:.3g} B" if count >= 1e9 else f"{count / 1e6:.3g} M"


def shapes_table() -> str:
    lines = [
        "| preset | params | vocab_size | dim | n_layers | n_heads | n_kv_heads | ffn_hidden | experts (a token) "
        "| tie_embeddings | rope_theta | rope_scaling factor |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|",
    ]
    for name in PRESETS:
        model = ModelConfig(preset=name)
        lines.append(
            f"| `{name}` | {_format_count(parameter_count(model))} | {model.vocab_size} | {model.dim} | {model.n_layers} "
            f"| {model.n_heads} | {model.kv_heads} | {model.ffn_hidden} "
            f"| {f'{model.experts} ({model.experts_per_token})' if model.experts else '-'} "
            f"| {str(model.tie_embeddings).lower()} "
            f"| {model.rope_theta:g} | {f'{model.rope_scaling.factor:g}' if model.rope_scaling else '-'} |"
        )
    return "\n".join(lines)


def memory_table(layouts: list[Layout] = DOC_LAYOUTS) -> str:
    """One row per layout, each first validated as a full config (so tp divides the shapes)."""
    lines = [
        "| preset | pp × shard (ep) × cp × tp | seq_len × micro_batch | activation checkpointing | sequence parallel "
        "| params + grads + AdamW | FSDP2 unsharded | activations | logits | total | fits an H100 80 GB |",
        "|---|--:|--:|---|---|--:|--:|--:|--:|--:|---|",
    ]
    for layout in layouts:
        config = parse_config({
            "micro_batch": layout.micro_batch,
            # as many micro-batches per rank as stages: the fewest a pipeline takes
            "global_batch": layout.micro_batch * layout.shard * layout.pp,
            "scaling": {"min_groups": 1, "max_groups": 1, **layout.topology.degrees(),
                        **({} if layout.sequence_parallel is None else {"sequence_parallel": layout.sequence_parallel})},
            "model": {"preset": layout.preset},
            "data": {"seq_len": layout.seq_len},
            "compute": {"precision": "bf16", "activation_checkpointing": layout.activation_checkpointing},
        })
        memory = memory_per_rank(
            config.model, config.scaling.topology, seq_len=config.data.seq_len,
            micro_batch=config.micro_batch, precision=config.compute.precision,
            activation_checkpointing=config.compute.activation_checkpointing == "full",
            sequence_parallel=config.sequence_parallel,
            reshard_after_forward=config.scaling.reshards_after_forward,
        )
        states = memory["parameters"] + memory["gradients"] + memory["optimizer"]
        fits = "yes" if memory["total"] <= H100_BUDGET_GIB else "no"
        lines.append(
            f"| `{layout.preset}` | {layout.dimensions} "
            f"| {layout.seq_len} × {layout.micro_batch} | {layout.activation_checkpointing} "
            f"| {'yes' if config.sequence_parallel else 'no'} "
            f"| {states:.2f} | {memory['unsharded']:.2f} | {memory['activations']:.2f} | {memory['logits']:.2f} "
            f"| {memory['total']:.2f} | {fits} |"
        )
    return "\n".join(lines)


def host_memory_table(layouts: list[Layout] = DOC_LAYOUTS) -> str:
    """Host memory per rank for each distinct (preset, pp, shard, cp, tp) of the layouts."""
    lines = [
        "| preset | pp × shard × cp × tp | committed state | memory tier (4 copies) | checkpoint staging | total host |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    seen = set()
    for layout in layouts:
        key = (layout.preset, layout.pp, layout.shard, layout.cp, layout.tp)
        if key in seen:
            continue
        seen.add(key)
        memory = host_memory_per_rank(ModelConfig(preset=layout.preset), layout.topology)
        lines.append(
            f"| `{layout.preset}` | {layout.pp} × {layout.shard} × {layout.cp} × {layout.tp} | {memory['state']:.2f} "
            f"| {memory['memory_tier']:.2f} "
            f"| {memory['staging']:.2f} | {memory['total']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print(shapes_table(), memory_table(), host_memory_table(), sep="\n\n")

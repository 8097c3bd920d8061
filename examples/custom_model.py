"""Train a user-defined model through the Python API, with its own tensor-parallel plan.

    python examples/custom_model.py

A small MLP language model over bytes with its own tensor-parallel plan: the token embedding
split by vocabulary rows, the hidden layers column- then row-wise. FSDP2, the precision
(``compute.precision``) and the rest stay the trainer's; every other hook but the dataset is
the user's.
"""

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from elastic import ElasticTrainer, load_config


class ByteMLP(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(h)


def tensor_parallel_plan(model: ByteMLP, tp_mesh) -> None:
    parallelize_module(model, tp_mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "up": ColwiseParallel(),
        "down": RowwiseParallel(),
        "head": ColwiseParallel(output_layouts=Replicate()),
    })


def smoothed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), reduction="none", label_smoothing=0.05
    ).view(targets.shape)


def main() -> None:
    # No run name: each run of the example is a new run (the same name would resume the last one)
    config = load_config(overrides={"steps": 30, "scaling.max_groups": 2, "scaling.shard": 1, "scaling.tp": 2})
    result = ElasticTrainer(
        config,
        model_fn=ByteMLP,
        tp_plan=tensor_parallel_plan,
        loss_fn=smoothed_cross_entropy,
        optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2),
        progress=True,
    ).fit()
    print(f"{result.exit}: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}; summary at {result.summary_path}")


if __name__ == "__main__":
    main()

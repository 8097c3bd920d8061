"""Train a model that is not a language model, with its own loss: an image classifier on
generated images, one rank killed mid-run, its losses equal to a clean run's.

    python examples/image_classifier.py

The dataset gives dicts of tensors (an image and its label); the default ``collate_fn``
stacks them, and ``batch_loss_fn(model, batch)`` returns the batch's summed loss and how many
samples it summed over. The trainer divides the step by the count summed over every rank and
group, so the step is the same mean however many groups are live: the run that loses a rank
commits the clean run's losses (to float summation order).
"""

import torch
from torch import nn

from elastic import ElasticTrainer, load_config

CLASSES = 4
SIZE = 8


class Shapes(torch.utils.data.Dataset):
    """Images of SIZE x SIZE: class c lights up row band c, with noise; the same for a seed."""

    def __init__(self, samples: int = 512, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, CLASSES, (samples,), generator=generator)
        self.images = 0.3 * torch.randn(samples, 1, SIZE, SIZE, generator=generator)
        band = SIZE // CLASSES
        for index, label in enumerate(self.labels.tolist()):
            self.images[index, 0, label * band:(label + 1) * band] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"image": self.images[index], "label": self.labels[index]}


class SmallConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d((4, 1)))
        self.head = nn.Linear(8 * 4, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))


def summed_cross_entropy(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    logits = model(batch["image"])
    return nn.functional.cross_entropy(logits.float(), batch["label"], reduction="sum"), batch["label"].numel()


def train(config, inject: str = "") -> "RunResult":  # noqa: F821 - elastic.RunResult
    if inject:
        config = config.model_copy(update={"fault_tolerance": config.fault_tolerance.model_copy(
            update={"inject": inject})})
    return ElasticTrainer(
        config,
        model_fn=SmallConvNet,
        batch_loss_fn=summed_cross_entropy,
        dataset=Shapes(),
        optimizer_fn=lambda params: torch.optim.AdamW(params, lr=1e-2),
    ).fit()


def main() -> None:
    # No run name: each run is a new run (the same name would resume the last one)
    config = load_config(overrides={"steps": 20, "global_batch": 32, "micro_batch": 4, "scaling.min_groups": 1,
                                    "scaling.max_groups": 2, "scaling.shard": 2, "checkpoint.memory_every": 1})
    clean = train(config)
    killed = train(config, inject="kill:rank=1,step=8")
    largest = max(abs(a - b) / abs(b) for a, b in zip(killed.losses, clean.losses))
    print(f"clean: {clean.exit}, loss {clean.losses[0]:.3f} -> {clean.losses[-1]:.3f}")
    print(f"a rank killed at step 8: {killed.exit}; {len(killed.losses)} committed losses, the largest relative "
          f"difference from the clean run's {largest:.1e}")


if __name__ == "__main__":
    main()

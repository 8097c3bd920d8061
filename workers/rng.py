"""A rank's random-number generators as committed state.

Random ops in the model (dropout) draw from torch's default CPU generator and, on a GPU,
the device's. Their states are part of what a step commits: captured before the step, put
back when the step is discarded, copied with the parameters when a replacement heals, and
saved with checkpoints. Ranks at the same (pp, shard, tp) position in every group draw the same
stream, so a replacement that copies its peer's state continues exactly where the rank it
replaces would have. TP ranks of a shard position share the stream too: their replicated
activations need the same dropout masks. Each pipeline stage has a stream of its own, so its
layers do not draw the masks another stage's draw.
"""

from __future__ import annotations

import numpy as np
import torch

RngState = dict[str, bytes]


def training_seed(seed: int, shard_index: int, step: int = 0, stage: int = 0) -> int:
    """The seed of a shard position's training stream on pipeline stage ``stage`` (``step``:
    where a stream that could not be restored restarts). The first stage's is the seed of a
    run without stages."""
    entropy = [seed, shard_index, step] + ([stage] if stage else [])
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> 1)


def capture(on_gpu: bool) -> RngState:
    state = {"cpu": torch.get_rng_state().numpy().tobytes()}
    if on_gpu:
        state["cuda"] = torch.cuda.get_rng_state().numpy().tobytes()
    return state


def restore(state: RngState) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(state["cpu"]), dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8))

"""Failures of a large training fleet, drawn from published rates.

The rate and the mix are Llama 3's 54-day pre-training on 16,384 H100s ("The Llama 3 Herd of
Models", Meta, 2024, section 3.3.4 and Table 5): 419 unexpected interruptions, by root cause:
faulty GPU 148, GPU HBM3 memory 72, software bug 54, network switch or cable 35, host
maintenance 32, GPU SRAM memory 19, GPU system processor 17, NIC 7, NCCL watchdog timeouts 7,
silent data corruption 6, GPU thermal interface and sensor 6, SSD 3, power supply 3, server
chassis 2, IO expansion board 2, dependency 2, CPU 2, system memory 2. They are grouped here
by what a trainer sees: a GPU lost (its rank dies, the node stays), a node lost (eight ranks
at once), a network fault and a hang (a rank stops answering inside a collective), a
software failure (a rank's process dies; the node is fine), a silent data corruption.

A slow GPU is not an interruption and the table does not count it: its rate here
(``SLOW_GPU_SHARE`` of the interruption rate) is an assumption, to be replaced by a team's own.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum

GPUS_PER_NODE = 8
HOUR_S = 3600.0


class FailureKind(StrEnum):
    GPU_LOST = "gpu-lost"
    NODE_LOST = "node-lost"
    NETWORK = "network"
    HANG = "hang"
    SOFTWARE = "software"
    SILENT_CORRUPTION = "silent-corruption"
    SLOW_GPU = "slow-gpu"


# Llama 3's Table 5, by what a trainer sees (the module's docstring names each row)
LLAMA3_INTERRUPTIONS = {
    FailureKind.GPU_LOST: 148 + 72 + 19 + 17 + 6,
    FailureKind.NODE_LOST: 32 + 3 + 3 + 2 + 2 + 2 + 2,
    FailureKind.NETWORK: 35 + 7,
    FailureKind.HANG: 7,
    FailureKind.SOFTWARE: 54 + 2,
    FailureKind.SILENT_CORRUPTION: 6,
}
LLAMA3_GPU_HOURS = 54 * 24 * 16_384
SLOW_GPU_SHARE = 0.1  # assumed: a slow GPU for every ten interruptions


@dataclass(frozen=True)
class Failure:
    at_s: float
    kind: FailureKind
    gpu: int  # the GPU it strikes (a node's first GPU for a node lost)

    @property
    def node(self) -> int:
        return self.gpu // GPUS_PER_NODE


def rates_per_gpu_hour(scale: float = 1.0) -> dict[FailureKind, float]:
    """Each kind's rate per GPU-hour, ``scale`` times Llama 3's."""
    rates = {kind: scale * count / LLAMA3_GPU_HOURS for kind, count in LLAMA3_INTERRUPTIONS.items()}
    rates[FailureKind.SLOW_GPU] = SLOW_GPU_SHARE * sum(rates.values())
    return rates


def draw_failures(gpus: int, duration_s: float, seed: int, scale: float = 1.0) -> list[Failure]:
    """A trace of failures over ``duration_s`` on ``gpus`` GPUs: each kind a Poisson process at
    its rate, striking a GPU drawn uniformly; in time order."""
    rng = random.Random(seed)
    failures = []
    for kind, rate in rates_per_gpu_hour(scale).items():
        per_second = rate * gpus / HOUR_S
        at = rng.expovariate(per_second)
        while at < duration_s:
            gpu = rng.randrange(gpus)
            if kind == FailureKind.NODE_LOST:
                gpu -= gpu % GPUS_PER_NODE
            failures.append(Failure(at, kind, gpu))
            at += rng.expovariate(per_second)
    return sorted(failures, key=lambda failure: failure.at_s)

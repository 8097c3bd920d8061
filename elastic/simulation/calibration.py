"""Calibration before claims: the model run with each publication's own parameters, its
figure against the publication's (``python bench/at_scale.py --calibrate``).

Each row names its parameters and where each comes from; a parameter a publication does not
give is named as chosen, with why. Ratios are between 0 and 1: ETTR, and for Kokolis et al.'s
mean time to failure the chance that a job of that size runs an hour without a failure,
exp(-1 h / MTTF). A row whose figure the model does not reproduce within the 2-point goal says
so and why (``gap``) and carries that gap as its tolerance, rather than a parameter tuned to
hide it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from elastic.simulation.costs import DEFAULT, Costs
from elastic.simulation.designs import MODELS, Design, Job, replay
from elastic.simulation.failure_mix import DAY_S, HOUR_S, FailureModel, draw_failures

GOAL = 0.02  # within 2 points of every published figure

# Kokolis et al. 2024 ("Revisiting Reliability in Large-Scale Machine Learning Research Clusters",
# Meta, HPCA 2025): RSC-1's failure rate, and the mean times to failure it gives at scale
KOKOLIS_FAILURES_PER_NODE_DAY = 6.50e-3
# Salpekar et al. 2026 ("Training LLMs with Fault Tolerant HSDP on 100,000 GPUs", Meta): a
# failure's job-wide stall, synchronous and fault-tolerant
FT_HSDP_SYNC_STALL_S = 600.0
FT_HSDP_STALL_S = 180.0
# Not published by Llama 3, ByteRobust or FT-HSDP, chosen: an in-memory checkpoint every 5
# minutes, restart-the-world's best current form here (Llama 3's per-GPU state of 1 MB to 4 GB
# to a 7 TB/s store takes seconds to save, so minutes between saves cost little)
CHOSEN_CHECKPOINT_EVERY_S = 300.0

# The synchronous restart as FT-HSDP prices it: one stall that holds detection, the nodes'
# replacement from standbys and the world's start; what the stall holds is not charged again.
SYNCHRONOUS = replace(DEFAULT, world_restart_s=FT_HSDP_SYNC_STALL_S, world_timeout_s=0.0, node_death_s=0.0,
                      node_replacement_s=0.0, comm_init_s_per_rank=0.0, checkpoint_load_bandwidth=math.inf,
                      checkpoint_every_s=CHOSEN_CHECKPOINT_EVERY_S)
# FT-HSDP's own: the job-wide stall holds detection and the process groups' change; the failed
# replica restarts as the synchronous job does (not published, chosen: the same 10 minutes, of
# one replica) and catches up without stalling the others (its non-blocking catch-up)
FAULT_TOLERANT = replace(SYNCHRONOUS, torchft_stall_s=FT_HSDP_STALL_S, torchft_heartbeat_s=0.0, torchft_timeout_s=0.0,
                         group_restart_s=FT_HSDP_SYNC_STALL_S, heal_bandwidth=math.inf)


@dataclass(frozen=True)
class Row:
    source: str
    published: float
    modelled: float
    tolerance: float
    parameters: str
    bound: bool = False  # the publication gives a floor ("more than 90 %")
    gap: str = ""  # why the model does not reproduce the figure within the goal

    def _close(self, tolerance: float) -> bool:
        short = self.published - self.modelled
        return short <= tolerance if self.bound else abs(short) <= tolerance

    @property
    def within(self) -> bool:
        """Within the row's tolerance: the goal's, or the gap it documents."""
        return self._close(self.tolerance)

    @property
    def meets_goal(self) -> bool:
        return self._close(GOAL)

    def as_json(self) -> dict:
        return {"source": self.source, "published": round(self.published, 4), "modelled": round(self.modelled, 4),
                "tolerance": self.tolerance, "bound": self.bound, "within": self.within, "meets_goal": self.meets_goal,
                "parameters": self.parameters,
                "gap": self.gap}


def _ettr(job: Job, design: Design, days: float, failures: FailureModel, costs: Costs, traces: int) -> float:
    wall_s = days * DAY_S
    return statistics.mean(replay(job, draw_failures(job.gpus, wall_s, seed, failures), design, wall_s,
                                  spare_gpus=64, costs=costs, seed=seed).ettr for seed in range(traces))


def _hour_without_failure(mttf_h: float) -> float:
    return math.exp(-1 / mttf_h)


def _kokolis(gpus: int, published_mttf_h: float, kind: str, gap: str = "", tolerance: float = GOAL
             ) -> Callable[[int], Row]:
    def row(traces: int) -> Row:
        span_s = 1000 * published_mttf_h * HOUR_S  # a thousand failures' worth, about
        failures = draw_failures(gpus, span_s, 0, FailureModel.at_node_rate(KOKOLIS_FAILURES_PER_NODE_DAY))
        modelled_mttf_h = span_s / len(failures) / HOUR_S
        return Row(f"Kokolis et al. 2024: MTTF {published_mttf_h:g} h at {gpus:,} GPUs ({kind}), as the chance of "
                   f"an hour without failure (modelled {modelled_mttf_h:.2f} h)",
                   _hour_without_failure(published_mttf_h), _hour_without_failure(modelled_mttf_h), tolerance,
                   "RSC-1's 6.50 failures per 1,000 node-days (published), Llama 3's mix of kinds, Poisson arrivals",
                   gap=gap)
    return row


def _llama3(traces: int) -> Row:
    return Row("Llama 3 (Meta 2024): effective training time > 90 % at 16,384 GPUs, 54 days", 0.90,
               _ettr(Job(MODELS["405b"], 16_384), Design.RESTART, 54, FailureModel.published(), SYNCHRONOUS, traces),
               GOAL, "466 interruptions in 54 days, 47 planned (published); restart the world; a 10-minute stall per "
                     "interruption (not published: FT-HSDP's figure for Meta's synchronous training); in-memory "
                     "checkpoints every 5 minutes (not published, chosen)", bound=True)


def _byterobust(traces: int) -> Row:
    job = Job(MODELS["70b"], 9_600)
    return Row("ByteRobust (ByteDance 2025): 97 % ETTR on 9,600 GPUs over three months", 0.97,
               _ettr(job, Design.RESTART, 90, FailureModel.published(),
                     replace(SYNCHRONOUS, checkpoint_every_s=job.step_s()), traces),
               GOAL, "9,600 GPUs, 90 days (published); Llama 3's rates and mix (not published in the abstract: "
                     "Llama 3's production H100 rates); restart the world on warm standbys, checkpoints at near-zero "
                     "overhead (published), so taken every step (chosen); a 10-minute stall per failure (not "
                     "published: FT-HSDP's figure)")


FT_HSDP_GAP = ("Meta's 6.5 failures per 1,000 node-days give 18 minutes between failures at 98,304 GPUs; the "
               "abstract's figures fit each failure charged its whole stall, even one that strikes during another's "
               "recovery (1 - stall / 18 min: 44 % and 83 %); this model starts a recovery over from a failure that "
               "strikes during it, which leaves more time training, and FT-HSDP's remaining 3 points (a replica out "
               "while it restarts, at a replica size not published) are not reproduced")


def _ft_hsdp(design: Design, published: float, what: str, costs: Costs, tolerance: float) -> Callable[[int], Row]:
    def row(traces: int) -> Row:
        return Row(f"FT-HSDP (Meta 2026): {what} at ~100 k GPUs", published,
                   _ettr(Job(MODELS["405b"], 98_304), design, 14,
                         FailureModel.at_node_rate(KOKOLIS_FAILURES_PER_NODE_DAY), costs, traces),
                   tolerance, "98,304 GPUs; the stall per failure, 10 minutes synchronous and 3 fault-tolerant "
                              "(published); the failure rate, Kokolis et al.'s (not in the abstract: Meta's own "
                              "published rate); checkpoints every 5 minutes, a replica's restart 10 minutes, groups "
                              "of 512 GPUs (not published, chosen)", gap=FT_HSDP_GAP)
    return row


PUBLICATIONS: tuple[Callable[[int], Row], ...] = (
    _llama3,
    _byterobust,
    _ft_hsdp(Design.RESTART, 0.44, "44 % ETTR synchronous", SYNCHRONOUS, 0.07),
    _ft_hsdp(Design.GROUP_RESTART, 0.80, "80 % ETTR fault-tolerant", FAULT_TOLERANT, 0.05),
    _kokolis(1_024, 7.9, "measured",
             gap="the paper's measured MTTF at 1,024 GPUs is shorter than its own per-node rate gives (28.8 h): "
                 "small jobs fail for causes the per-node rate does not count; a per-node model cannot reproduce it",
             tolerance=0.09),
    _kokolis(16_384, 1.8, "projected"),
    _kokolis(131_072, 0.23, "projected"),
)


def calibrate(traces: int = 3) -> list[Row]:
    return [publication(traces) for publication in PUBLICATIONS]

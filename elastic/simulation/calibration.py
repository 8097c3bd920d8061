"""Calibration before claims: the model run with each publication's own parameters, its
figure against the publication's (``python bench/at_scale.py --calibrate``).

Each row names its parameters and where each comes from; a parameter a publication does not
give is named as chosen, with why. Ratios are between 0 and 1: ETTR, and for Kokolis et al.'s
mean time to failure the chance that a job of that size runs an hour without a failure,
exp(-1 h / MTTF). A row whose figure the model does not reproduce within the 2-point goal says
so and why (``gap``) and carries that gap as its tolerance, rather than a parameter tuned to
hide it. Failures arrive as Poisson processes, except in FT-HSDP's rows, which follow that
paper's own arithmetic: a failure every mean time between failures, each charged its recovery.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

from elastic.simulation.costs import DEFAULT, Costs
from elastic.simulation.designs import MODELS, Design, Job, ModelShape, replay
from elastic.simulation.failure_mix import DAY_S, HOUR_S, Failure, FailureModel, draw_failures, draw_failures_every

GOAL = 0.02  # within 2 points of every published figure

# Kokolis et al. 2024 ("Revisiting Reliability in Large-Scale Machine Learning Research Clusters",
# Meta, HPCA 2025): RSC-1's failure rate, and the mean times to failure it gives at scale
KOKOLIS_FAILURES_PER_NODE_DAY = 6.50e-3
# Salpekar et al. 2026 ("Training LLMs with Fault Tolerant HSDP on 100,000 GPUs", Meta, arXiv
# 2602.00277). The abstract: the stall per failure, 10 minutes synchronous and 3 fault-tolerant;
# ETTR 44 % and 80 %. The body, as two public write-ups of it give it (the stored arXiv HTML
# holds the abstract and the introduction's start only): at 98 k GPUs "an MTBF of 18 minutes";
# "Effective training = (18 - 10) / 18 = 44%", the 10 minutes a warm recovery (machines
# allocated, NCCL's set-up ~200 s, the checkpoint loaded, the first step), no term for work
# redone; fault-tolerant "~3 min stall + ~7 min degraded at 11/12 throughput + ~8 min full",
# "(8 + 7 x 11/12) / 18 = 80%", with "12 DP replicas of 8,192 GPUs each"; the 3 minutes hold the
# ~60 s NCCL timeout that finds the failure, FTAR's reconfiguration, ~20 s to train again the
# step in flight, and two bugs (a power smoother ~45 s, a needless reconfiguration ~45 s); a
# "secondary stall of ~100 seconds" when the replica rejoins is reported but not in the 80 %.
FT_HSDP_GPUS = 98_304
FT_HSDP_REPLICA_GPUS = 8_192
FT_HSDP_MTBF_S = 18 * 60.0
FT_HSDP_SYNC_STALL_S = 600.0
FT_HSDP_STALL_S = 180.0
FT_HSDP_REPLICA_OUT_S = 7 * 60.0  # after the job-wide stall, the replica's restart: 10 minutes in all
# The replicas as FT-HSDP sizes them; what is inside one (the paper's Llama model, TP, CP, PP and
# FSDP) is not given: Llama 3 405B in 16 stages x 64 shards x 8 is chosen, as only a replica's
# size moves the ETTR (the step, 1.2 s, is what a failure redoes)
FT_HSDP_REPLICA = ModelShape("llama3-405b in FT-HSDP's replicas", MODELS["405b"].parameters, 16, 64, 8)
assert FT_HSDP_REPLICA.group_gpus == FT_HSDP_REPLICA_GPUS
# Not published by Llama 3, ByteRobust or FT-HSDP, chosen: an in-memory checkpoint every 5
# minutes, restart-the-world's best current form here (Llama 3's per-GPU state of 1 MB to 4 GB
# to a 7 TB/s store takes seconds to save, so minutes between saves cost little)
CHOSEN_CHECKPOINT_EVERY_S = 300.0

# The synchronous restart as FT-HSDP prices it: one stall that holds detection, the nodes'
# replacement from standbys and the world's start; what the stall holds is not charged again.
SYNCHRONOUS = replace(DEFAULT, world_restart_s=FT_HSDP_SYNC_STALL_S, world_timeout_s=0.0, node_death_s=0.0,
                      node_replacement_s=0.0, comm_init_s_per_rank=0.0, checkpoint_load_bandwidth=math.inf,
                      checkpoint_every_s=CHOSEN_CHECKPOINT_EVERY_S)
# FT-HSDP's own: the job-wide stall holds detection, the process groups' change and the step
# trained again; the failed replica is then out 7 more minutes (its restart, fetch and zero-gradient
# catch-up, which stall no one), its whole return: nothing of it is charged again
FAULT_TOLERANT = replace(SYNCHRONOUS, torchft_stall_s=FT_HSDP_STALL_S, torchft_heartbeat_s=0.0, torchft_timeout_s=0.0,
                         group_restart_s=FT_HSDP_REPLICA_OUT_S, heal_bandwidth=math.inf, spare_takeover_s=0.0,
                         process_start_s=0.0)


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


def _ettr(job: Job, design: Design, days: float, failures: FailureModel, costs: Costs, traces: int,
          every_s: float | None = None) -> float:
    """The mean ETTR over ``traces`` traces: Poisson arrivals, or with ``every_s`` a failure every
    ``every_s`` (``draw_failures_every``)."""
    wall_s = days * DAY_S

    def trace(seed: int) -> list[Failure]:
        if every_s is None:
            return draw_failures(job.gpus, wall_s, seed, failures)
        return draw_failures_every(job.gpus, wall_s, every_s, seed, failures)

    return statistics.mean(replay(job, trace(seed), design, wall_s, spare_gpus=64, costs=costs, seed=seed).ettr
                           for seed in range(traces))


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


FT_HSDP_JOB = Job(FT_HSDP_REPLICA, FT_HSDP_GPUS)
FT_HSDP_PARAMETERS = (
    "98,304 GPUs in 12 replicas of 8,192; a failure every 18 minutes, each charged its whole recovery and none "
    "striking during another's, the paper's own arithmetic ((18 - 10) / 18 and (8 + 7 x 11/12) / 18); the stall, "
    "10 minutes synchronous and 3 fault-tolerant, then the failed replica out 7 more minutes; no work redone "
    "beyond the stall, as that arithmetic charges none, so a checkpoint every step; the ~100 s stall reported when "
    "a replica rejoins, not in its 80 %, not charged (published: the abstract, and the body as public write-ups "
    "give it); Llama 3's mix of kinds, of which its 6 silent corruptions in 425 are found by neither design and "
    "not charged; the model inside a replica, Llama 3 405B in 16 stages x 64 shards x 8 (not published, chosen: "
    "only the replica's size moves the figure)")


def _ft_hsdp(design: Design, published: float, what: str, costs: Costs) -> Callable[[int], Row]:
    def row(traces: int) -> Row:
        return Row(f"FT-HSDP (Meta 2026): {what} at ~100 k GPUs", published,
                   _ettr(FT_HSDP_JOB, design, 14, FailureModel.published(planned=False),
                         replace(costs, checkpoint_every_s=FT_HSDP_JOB.step_s()), traces, every_s=FT_HSDP_MTBF_S),
                   GOAL, FT_HSDP_PARAMETERS)
    return row


PUBLICATIONS: tuple[Callable[[int], Row], ...] = (
    _llama3,
    _byterobust,
    _ft_hsdp(Design.RESTART, 0.44, "44 % ETTR synchronous", SYNCHRONOUS),
    _ft_hsdp(Design.GROUP_RESTART, 0.80, "80 % ETTR fault-tolerant", FAULT_TOLERANT),
    _kokolis(1_024, 7.9, "measured",
             gap="the paper's measured MTTF at 1,024 GPUs is shorter than its own per-node rate gives (28.8 h): "
                 "small jobs fail for causes the per-node rate does not count; a per-node model cannot reproduce it",
             tolerance=0.09),
    _kokolis(16_384, 1.8, "projected"),
    _kokolis(131_072, 0.23, "projected"),
)


def calibrate(traces: int = 3) -> list[Row]:
    return [publication(traces) for publication in PUBLICATIONS]

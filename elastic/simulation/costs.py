"""What each phase of a recovery costs, in seconds (bandwidths in bytes per second, rates per
second), every figure named with its source: two columns, ``DEFAULT`` (measured here where a
measurement exists, else published, else assumed and said so) and ``PESSIMISTIC`` (each cost
at its worst published value, and each assumption at its worse end).

This product's path is priced as it runs today (``elastic/driver``): every group waits for
each recovery and for two job-wide regroups of the cross-group process groups (the failure's and
the join's, each one word in the driver's store that its server hands every waiting rank, and
a driver call per rank of the changed group), while the joining group takes the state rank to
rank as every group steps (the catch-up). Each phase is its own figure so that a law measured on the
real code (``bench/failure_cost.py``) can replace it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from elastic.driver.outcome_collector import ABORT_GRACE_S, ABORT_SETTLE_S
from elastic.setup.config import CheckpointConfig, FaultToleranceConfig, IntegrityConfig
from elastic.simulation.failure_mix import FailureModel
from elastic.simulation.failure_mix import SOURCES as FAILURE_SOURCES

_FT = FaultToleranceConfig()


@dataclass(frozen=True)
class Costs:
    # finding a failure
    deadline_factor: float = _FT.deadline_factor
    min_deadline_s: float = _FT.min_deadline_s
    first_step_deadline_s: float = _FT.first_step_deadline_s
    probe_s: float = 5.0
    drain_s: float = ABORT_SETTLE_S + ABORT_GRACE_S
    node_death_s: float = 50.0
    # a regroup: every surviving rank's cross-group process groups rebuilt, every group waiting
    regroup_s: float = 0.3
    store_reads_per_s: float = 18_500.0
    driver_calls_per_s: float = 8830.0
    comm_init_s_per_rank: float = 0.002
    comm_init_s_per_rank_squared: float = 0.0
    pairing_s: float = 0.0053
    # the failed group's replacement, while the other groups train
    spare_takeover_s: float = 4.0
    process_start_s: float = 3.5
    node_replacement_s: float = 600.0
    # the heal, every group waiting
    heal_bandwidth: float = 0.27e9
    # the integrity check and the memory tier
    integrity_every_steps: int = IntegrityConfig().every
    memory_every_steps: int = CheckpointConfig().memory_every
    # a slow GPU, found by the same straggler detector in every design
    slowdown: float = 1.5
    # restart-the-world, in its best current form
    world_restart_s: float = 9.0
    world_timeout_s: float = 120.0
    checkpoint_every_s: float = 300.0
    checkpoint_load_bandwidth: float = 25e9
    # group restart, torchft's
    torchft_heartbeat_s: float = 5.0
    torchft_timeout_s: float = 60.0
    group_restart_s: float = 1.2
    torchft_stall_s: float = 0.0

    def comm_init_s(self, ranks: int) -> float:
        """A communicator's bootstrap over ``ranks`` ranks."""
        return self.comm_init_s_per_rank * ranks + self.comm_init_s_per_rank_squared * ranks ** 2


SOURCES = {
    "deadline_factor": "this product's default (fault_tolerance.deadline_factor): a hang is found at this many "
                       "median step times (StepDeadline over the run's last 20 steps)",
    "min_deadline_s": "this product's default (fault_tolerance.min_deadline_s)",
    "first_step_deadline_s": "this product's default (fault_tolerance.first_step_deadline_s), before 3 steps are timed",
    "probe_s": "the probe's timeout in OutcomeCollector.find_hung, waited out by a rank that does not answer",
    "drain_s": "OutcomeCollector's ABORT_SETTLE_S + ABORT_GRACE_S: the broken group's ranks released after a failure",
    "node_death_s": "Ray's health check: 5 missed checks of 10 s each mark a silent node dead (ray_config_def.h)",
    "regroup_s": "measured: a regroup on 4 CPU ranks over gloo, less the step redone (bench/goodput.py, "
                 "docs/benchmarks.md)",
    "store_reads_per_s": "measured: the next segment's word, one write to the driver's TCPStore, served to 128, 512 "
                         "and 2,048 waiting ranks: the server's threads spent 54 us of CPU per rank "
                         "(bench/handoff_fanout.py, docs/benchmarks.md); a regroup's segment start reaches every "
                         "surviving rank so (Fleet.start_segment, fleet/waiting_ranks.py; each rank enters its own "
                         "cross-group groups)",
    "driver_calls_per_s": "Ray 2.10's release microbenchmark, 1:n actor calls (async): 8,830/s; a regroup makes one "
                          "per rank of the changed group (its new ranks' first segment, its build)",
    "comm_init_s_per_rank": "assumed: a communicator's bootstrap grows 1 s per 500 ranks (each cross-group group has "
                            "one rank per group; a group's world, its ranks)",
    "comm_init_s_per_rank_squared": "none by default: NCCL's quadratic set-up at scale, which NCCL PR #1789 "
                                    "removes, is priced in PESSIMISTIC",
    "pairing_s": "measured: BuddyPairing's re-pair for one 512-GPU group lost and back at 98,304 ranks "
                 "(docs/at-scale.md)",
    "spare_takeover_s": "measured: kill -> group whole with a warm spare, 3.47 steps of 1.16 s on one H100 over gloo "
                        "(bench/gpu_check.py, docs/benchmarks.md)",
    "process_start_s": "measured: a fresh rank process's start, 3-4 s on CPU (docs/architecture.md, warm spares)",
    "node_replacement_s": "assumed: a node replaced and its pod started (KubeRay); none measured or published",
    "heal_bandwidth": "measured: today's heal road, state to host, pickled into the object store and back, 2.47 GB "
                      "in 9.01 s between two actors on one H100 host (bench/heal_transport.py, docs/benchmarks.md); "
                      "every rank of the group copies in parallel",
    "integrity_every_steps": "this product's default (integrity.every)",
    "memory_every_steps": "this product's default (checkpoint.memory_every)",
    "slowdown": "assumed: a slow GPU's step time over a healthy one's (every rank waits for it)",
    "world_restart_s": "measured: Ray Train V2's kill -> next commit, tiny job (bench/recovery.py)",
    "world_timeout_s": "restart-the-world's best current form: a 120 s collective timeout finds a hang",
    "checkpoint_every_s": "restart-the-world's best current form: an in-memory checkpoint every 5 minutes",
    "checkpoint_load_bandwidth": "assumed: an in-memory checkpoint reloads host to device at 25 GB/s per GPU (PCIe 5)",
    "torchft_heartbeat_s": "torchft's default: the lighthouse's heartbeat_timeout_ms 5000 finds a replica gone",
    "torchft_timeout_s": "torchft's default: the Manager's timeout (60 s) ends a collective that hangs",
    "group_restart_s": "measured: torchft's kill -> group whole 6.2 s, less its 5 s heartbeat (bench/goodput.py)",
    "torchft_stall_s": "none by default beyond detection and the process groups' bootstrap",
}

DEFAULT = Costs()

PESSIMISTIC = replace(
    DEFAULT,
    node_death_s=65.0,
    store_reads_per_s=7540.0,
    driver_calls_per_s=2450.0,
    comm_init_s_per_rank_squared=7.2e-9,
    pairing_s=0.09,
    process_start_s=30.0,
    node_replacement_s=4 * 3600.0,
    heal_bandwidth=0.21e9,
    world_restart_s=600.0,
    torchft_stall_s=180.0,
)

PESSIMISTIC_SOURCES = SOURCES | {
    "node_death_s": "Ray's health check at its slowest: 5 x (3 s period + 10 s timeout) (ray_config_def.h)",
    "store_reads_per_s": "measured: the same handoff's wall time from the write to the last rank's read, 133 us per "
                         "rank, the 2,048 ranks' threads sharing the server's two cores (bench/handoff_fanout.py)",
    "driver_calls_per_s": "Ray 2.10's release microbenchmark, actor calls with arguments: 2,450/s",
    "comm_init_s_per_rank_squared": "NCCL PR #1789 (Meta, 2025): ncclBuildRing 26 s at 98,304 ranks and "
                                    "initTransportsRank 11 s at 49,152, both quadratic in the ranks",
    "pairing_s": "measured: the pairing 17x slower on a loaded host than a quiet one (12.8 s against 0.75 s, "
                 "issue 68), applied to the incremental re-pair",
    "process_start_s": "assumed: a fresh rank process on a GPU node (CUDA context, imports, model built); none "
                       "measured or published",
    "node_replacement_s": "assumed: 4 hours for a node replaced (Llama 3: 3 of 466 interruptions needed manual work)",
    "heal_bandwidth": "measured: the same run's first copy through the object store, 2.47 GB in 11.69 s "
                      "(bench/heal_transport.py)",
    "world_restart_s": "FT-HSDP (Salpekar et al. 2026): synchronous training's recovery stall at ~100 k GPUs, "
                       "10 minutes (a warm restart: machines allocated, NCCL's set-up, the checkpoint loaded, the "
                       "first step)",
    "torchft_stall_s": "FT-HSDP (Salpekar et al. 2026): the job-wide stall of a fault-tolerant HSDP recovery at "
                       "~100 k GPUs, 3 minutes, its ~60 s detection among them; charged here on top of torchft's "
                       "own detection, the worse end",
}

PESSIMISTIC_FAILURES = replace(
    FailureModel(),
    job_maintenance_share=1.0,
    sdc_state_share=0.0,
    power_domains_per_gpu_day=1 / (30 * 16_384),
    power_domain_gpus=3072,
    repeat_share=0.2,
    repeat_within_s=3600.0,
)

PESSIMISTIC_FAILURE_SOURCES = FAILURE_SOURCES | {
    "job_maintenance_share": "assumed: every planned interruption is a configuration or dataset update that stops "
                             "the job (Llama 3 names these among its 47)",
    "sdc_state_share": "assumed: every silent corruption is a compute error entering the cross-group sum, which no "
                       "replica comparison sees",
    "power_domains_per_gpu_day": "assumed: one per 30 days at 16,384 GPUs",
    "power_domain_gpus": "assumed: a Llama 3 pod, 3,072 GPUs behind its cluster switches (section 3.3.1)",
    "repeat_share": "assumed: one failure in five strikes a node that failed before",
    "repeat_within_s": "assumed: within the hour",
}


def cost_lines(costs: Costs, sources: dict[str, str], base: Costs) -> list[str]:
    """Each figure, its value and its source, for the output; a figure not ``base``'s is marked."""
    return [f"{item.name} = {getattr(costs, item.name):g}: {sources[item.name]}"
            + ("" if getattr(costs, item.name) == getattr(base, item.name) else " (replaced here)")
            for item in fields(costs)]

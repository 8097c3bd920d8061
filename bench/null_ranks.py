"""Benchmark: the driver's cost per steady-state step on real Ray actors, the step protocol
of today (runs: ranks step on their own and stream their groups' records) against the
pattern it replaced (one actor call per rank per step, collected one at a time), side by
side at each scale.

Null ranks speak the real protocol (``SegmentSpec`` in, ``SegmentRecords`` / ``GroupRecords`` /
``SegmentEnd`` out, planned with the real ``data_plan``) under the real ``Fleet`` and
``Controller``, but do no math and import no torch: a step is a sleep of ``--step-ms``, and
the run's first rank writes every group's records itself where real ranks gather them over
their cross-group process group (at the same steps: about once per report interval). Real
ranks keep in step through their collectives; null ranks end each step at the same instant
of a schedule the run's first arrival writes to a file.
Printed per scale:

- driver CPU per step: the driver process's CPU time (every thread, Ray's included) over
  the steady-state steps, divided by their number;
- rank wait per step: time per steady-state step beyond ``--step-ms``, the time the ranks
  spent not computing because of the driver: for the old pattern the driver's wall time per
  step (it waits for every report before the next dispatch), for runs the ranks' own loop
  period (records arrive in batches). The ranks call nothing on the driver: what shows here
  is how far they fall behind their schedule on a shared machine (negative: catching up).

    python bench/control_plane.py --ray [--ranks 8,32,128] [--steps 150] [--step-ms 50]

Exit status 0 when the segment protocol meets --target-ms of driver CPU per step at every scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

from elastic.core.data_plan import rank_share  # noqa: E402
from elastic.core.protocol import (  # noqa: E402
    BuildOutcome, GroupRecords, RankActivity, RankTimes, SegmentEnd, SegmentRecords, StepRecord,
)
from elastic.fleet.ray_connection import start_local_ray  # noqa: E402

RANKS_PER_GROUP = 4
WARMUP_STEPS = 20


class NullRank:
    """A rank that speaks the segment protocol and sleeps instead of computing."""

    def __init__(self, spec, pickled_pace: bytes):  # the fleet's pickled hooks: the step time, the schedule's folder
        self.spec = spec
        self.pause_run = -1
        self.step_s, self.schedules = ray.cloudpickle.loads(pickled_pace)

    def node(self) -> dict:
        return {"pid": os.getpid(), "global_rank": self.spec.global_rank}

    def build(self, world_build: int) -> BuildOutcome:
        return BuildOutcome(self.spec.global_rank, 0.0)

    @ray.method(concurrency_group="control")
    def request_pause(self, run: int) -> None:
        self.pause_run = run

    @ray.method(concurrency_group="control")
    def probe(self) -> RankActivity:
        return RankActivity(self.spec.global_rank, 0, "compute", 0, 0, 0.0)

    def run(self, spec):
        me = self.spec
        topology = me.layout
        # the steps at which real ranks' first ranks agree to gather, about once per interval
        every = max(1, round(spec.records_interval_s / self.step_s))
        leads_group = me.group_rank == 0
        replica_rank = spec.groups.index(me.group)  # of the segment's cross-group groups, as a real rank enters them
        held_groups = spec.groups if leads_group and replica_rank == 0 else (me.group,) if leads_group else ()
        held = {group: [] for group in held_groups}
        cursor = spec.cursor
        run_starts = self.run_start(spec.attempt)
        for step in range(spec.first_step, spec.stop_step):
            started = time.perf_counter()
            share = rank_share(spec, step, cursor, me.group, me.shard_index, me.layout.shard)
            time.sleep(max(0.0, run_starts + (step - spec.first_step + 1) * self.step_s - time.time()))
            wall = time.perf_counter() - started
            for group, records in held.items():
                ranks = tuple(topology.global_ranks(group))
                records.append(StepRecord(step, group, 1.0, 0.0, 1.0, spec.schedule.lr(step), share.global_samples,
                                          share.group_samples, share.next_cursor, ranks,
                                          (RankTimes(data_s=0.0, compute_s=self.step_s, comm_s=0.0, wall_s=wall),) * len(ranks),
                                          step_s=wall, counted=share.global_samples * spec.seq_len))
            cursor = share.next_cursor
            last = step + 1 == spec.stop_step or self.pause_run == spec.attempt
            if leads_group and (last or (step - spec.first_step) % every == 0):
                if last or len(spec.groups) == 1:  # each group's first rank sends what it holds
                    yield GroupRecords(me.group, tuple(held[me.group]))
                elif len(held) > 1:
                    yield SegmentRecords.of_groups(held)
                held = {group: [] for group in held}
            if last:
                yield SegmentEnd(me.global_rank, step + 1)
                return


    def run_start(self, run: int) -> float:
        """The wall-clock instant every rank starts ``run`` at: the first to arrive sets it."""
        path = os.path.join(self.schedules, f"run-{run}")
        try:
            with open(path, "x") as file:
                file.write(repr(time.time() + 1.0))  # time for the others' calls to arrive
        except FileExistsError:
            pass
        for _ in range(1000):
            with open(path) as file:
                text = file.read()
            if text:
                return float(text)
            time.sleep(0.001)
        raise TimeoutError(f"{path} stayed empty")


class PerStepRank:
    """The replaced pattern's rank: one call per step."""

    def __init__(self, step_s: float):
        self.step_s = step_s

    def ready(self) -> bool:
        return True

    def step(self, step: int) -> float:
        time.sleep(self.step_s)
        return self.step_s


def measure_per_step_calls(ranks: int, steps: int, step_s: float) -> tuple[float, float]:
    actors = [ray.remote(num_cpus=0.01)(PerStepRank).remote(step_s) for _ in range(ranks)]
    ray.get([actor.ready.remote() for actor in actors])
    for step in range(steps):
        if step == WARMUP_STEPS:
            cpu0, wall0 = time.process_time(), time.perf_counter()
        if step == steps - WARMUP_STEPS:
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        refs = [actor.step.remote(step) for actor in actors]
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            ray.get(ready)
    measured = steps - 2 * WARMUP_STEPS
    for actor in actors:
        ray.kill(actor)
    return cpu / measured, wall / measured - step_s


def measure_runs(ranks: int, steps: int, step_s: float, tmp: str) -> tuple[float, float]:
    from elastic.setup.capacity import on_cluster
    from elastic.setup.preflight import build_config
    from elastic.driver.controller import Controller
    from elastic.driver.records import StepResult
    from elastic.core.events import EventLog
    from elastic.core.goodput import TimeLedger
    from elastic.core.topology import Topology
    from elastic.fleet.ray_fleet import Fleet
    from elastic.fleet.rendezvous import Rendezvous

    groups = ranks // RANKS_PER_GROUP
    config = build_config({
        "run_name": f"null-{ranks}", "storage": tmp, "steps": steps, "global_batch": 4 * ranks, "micro_batch": 4,
        "scaling": {"min_groups": groups, "max_groups": groups, "shard": RANKS_PER_GROUP, "tp": 1,
                    "cpus_per_rank": 0.01, "device": "cpu"},  # no math: no GPU, also where the cluster has some
        "data": {"seq_len": 32, "corpus_tokens": 40_000},
        "checkpoint": {"every": 0, "memory_every": 0},
        "stragglers": {"enabled": True},
    })
    config = on_cluster(config, ray.cluster_resources())
    topology = Topology(RANKS_PER_GROUP, 1, groups)
    null_actor = ray.remote(concurrency_groups={"control": 1})(NullRank)
    fleet = Fleet(config, (step_s, tempfile.mkdtemp(dir=tmp)), topology, Rendezvous.start(), actor_class=null_actor)
    clock = time.monotonic
    marks, loop_s = {}, []

    def mark(result: StepResult) -> None:
        if result.step in (WARMUP_STEPS - 1, steps - WARMUP_STEPS - 1):
            marks[result.step] = (time.process_time(), time.perf_counter())
        if WARMUP_STEPS <= result.step < steps - WARMUP_STEPS:
            loop_s.append(result.step_s)

    controller = Controller(config, fleet, dataset_len=1_000_000, events=EventLog(clock), ledger=TimeLedger(clock),
                            clock=clock, on_step=[mark])
    try:
        ended = controller.run()
        assert ended.ok, str(ended)
    finally:
        fleet.shutdown()
    (cpu0, _), (cpu1, _) = marks[WARMUP_STEPS - 1], marks[steps - WARMUP_STEPS - 1]
    # Records arrive in batches, so the driver's clock cannot time a step: the ranks' own loop
    # period (from one step's start to the next's) can.
    return (cpu1 - cpu0) / (steps - 2 * WARMUP_STEPS), statistics.mean(loop_s) - step_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="8,32,128")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--step-ms", type=float, default=50.0)
    parser.add_argument("--target-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    scales = [int(n) for n in args.ranks.split(",")]
    if any(n % RANKS_PER_GROUP for n in scales):
        parser.error(f"--ranks must be multiples of {RANKS_PER_GROUP} (ranks per group)")
    step_s = args.step_ms / 1000
    # The actors need this module's classes, not its file: send them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    start_local_ray(num_cpus=max(scales) + 2, log_to_driver=False)

    print(f"null ranks, {RANKS_PER_GROUP} per group, steps of {args.step_ms:g} ms, "
          f"{args.steps - 2 * WARMUP_STEPS} steady-state steps measured (not the first or last {WARMUP_STEPS})")
    print(f"{'ranks':>6} | {'driver CPU ms/step':>19} {'':>8} {'':>6} | {'rank wait ms/step':>18} {'':>8}")
    print(f"{'':>6} | {'per-step':>9} {'runs':>9} {'ratio':>6} {'':>7}| {'per-step':>9} {'runs':>9}")
    passed = True
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in scales:
            old_cpu, old_wait = measure_per_step_calls(ranks, args.steps, step_s)
            new_cpu, new_wait = measure_runs(ranks, args.steps, step_s, tmp)
            passed &= new_cpu * 1e3 <= args.target_ms
            print(f"{ranks:>6} | {old_cpu * 1e3:>9.2f} {new_cpu * 1e3:>9.3f} {old_cpu / new_cpu:>6.0f}x {'':>6}| "
                  f"{old_wait * 1e3:>9.2f} {new_wait * 1e3:>9.2f}", flush=True)
    print(f"runs: driver CPU per steady-state step at most {args.target_ms:g} ms at every scale: "
          f"{'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

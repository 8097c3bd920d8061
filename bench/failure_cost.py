"""What one failure costs against the job's size, measured on the real product: real rank
processes under the real driver, one rank killed mid-step, at each size in ``--ranks`` (groups
of ``--shard`` ranks; steps paced to ``--step-s`` with the reference model's math, so that
the ranks leave the cores free and the wall times measure the design where the processes fit
the machine).

``bench/failure_probe.py``, installed in every rank process by Ray's setup hook, writes what
each rank did (its commits, the process groups it created, the bytes of state it handed to
the object store, its CPU seconds); the driver's actor calls are counted in this process.
Per size, in the window from the kill until the killed group commits again:

- ``stall_s``: time in which no group committed, less one step time each gap: the step time
  of the layout the step ran in (``degraded_step_s`` in a step the killed group took no samples
  in, out or catching up: its samples go to the others, in whole micro-batches; the probe
  records each step's shares), counted where it is over by more than half a step. The step in
  flight at the kill is redone within it;
- ``ranks_stopped``: the ranks whose own commits stalled so (the killed group's included);
- ``groups_created_per_survivor``: process groups each surviving rank created (max, mean);
- ``survivor_recovery_cpu_s``: CPU seconds each surviving rank spent beyond its steps, from its
  last commit before the kill to its first once the killed group is whole again: that window's
  CPU less each step call's own (the largest; ``_median`` over the survivors), and ``_net`` (and
  ``_net_median``) of it less what the rank spends between steps when nothing fails, at its rate
  before the kill, over the window (whose length is the machine's where the processes outnumber
  the cores);
- ``survivor_regroups``: each surviving rank's entries into a new build of the cross-group
  groups (their count, and one entry's wall and CPU seconds: the rendezvous with every peer);
- ``object_store_bytes``: rank state handed to the Ray object store;
- ``driver_calls``: actor calls the driver made, and the keys it set in the run's store to end an
  attempt (its abort) or hand the next segment on to the ranks waiting for it;
- ``phases``: where the time from the kill to the group whole again went (``bench/goodput.py``'s
  ``kill_to_whole_phases``), and the run's ``recovered`` event's parts;
- ``kill_to_commit_step_times``: kill to the next commit of any group, in step times.

Also ``rank_to_rank_bytes`` (the heal's, from its ``group-healed`` event), ``pairing_98304_s``:
the memory tier's re-pairing after one group's loss and return at 98,304 ranks
(``elastic/simulation/driver_cost.py``), and ``heal_speedup_vs_object_store``: one rank's state
(``--heal-dim``, ``--heal-layers``; 0.31 GB by default) copied rank to rank against through the
object store, in the same run (``bench/heal_transport.py``). Each figure is fit to a power law in the
job's size (``a * ranks ** b``) and the exponents printed: 0 is flat.

The rank processes fork from a server that imported torch once
(``elastic.testing.forked_ray_workers``), so that 64 of them fit 24 GB.

    python bench/failure_cost.py --ranks 4,16,64 --json OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import heal_transport  # noqa: E402
from bench.goodput import kill_to_whole_phases  # noqa: E402
from elastic.core.events import EventKind  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402

KILL_STEP = 6
SAMPLES_PER_RANK = 2  # one micro-batch each


def job_config(storage: str, ranks: int, shard: int, steps: int, killed: int):
    return build_config({
        "run_name": f"failure-cost-{ranks}", "storage": storage, "steps": steps,
        "global_batch": SAMPLES_PER_RANK * ranks, "micro_batch": 1, "seed": 5,
        "scaling": {"min_groups": 1, "max_groups": ranks // shard, "shard": shard, "tp": 1, "cpus_per_rank": 0.1},
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 192},
        "data": {"seq_len": 64, "corpus_tokens": 200_000},
        "stragglers": {"enabled": False},
        "checkpoint": {"every": 0},
        "fault_tolerance": {"inject": f"kill:rank={killed},step={KILL_STEP},after=0.2", "min_deadline_s": 5.0,
                            "first_step_deadline_s": 600},
    })


class DriverCalls:
    """Every actor call this process makes, with its wall time, and each key it sets in the run's
    store to end an attempt (the abort: ``end_attempt``) or to hand the next segment to the ranks
    that wait for it (``hand_off``): one write each, whatever the ranks."""

    def __init__(self):
        import ray.actor

        from elastic.fleet.rendezvous import Rendezvous

        self.times: list[tuple[float, str]] = []
        original = ray.actor.ActorMethod._remote
        end_attempt, hand_off = Rendezvous.end_attempt, Rendezvous.hand_off

        def counted(method, *args, **kwargs):
            self.times.append((time.time(), method._method_name))
            return original(method, *args, **kwargs)

        def counted_end(rendezvous, attempt):
            self.times.append((time.time(), "end_attempt (store)"))
            return end_attempt(rendezvous, attempt)

        def counted_hand_off(rendezvous, attempt, release, word):
            self.times.append((time.time(), "hand_off (store)"))
            return hand_off(rendezvous, attempt, release, word)

        ray.actor.ActorMethod._remote = counted
        Rendezvous.end_attempt = counted_end
        Rendezvous.hand_off = counted_hand_off

    def between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t, _ in self.times)

    def by_method(self, start: float, end: float) -> dict[str, int]:
        """The calls between ``start`` and ``end`` by the actor method called, most first."""
        counts = Counter(name for t, name in self.times if start <= t <= end)
        return dict(counts.most_common())


def read_probe(directory: str) -> list[dict]:
    lines = []
    for path in Path(directory).glob("*.jsonl"):
        pid = int(path.stem)
        lines.extend({**json.loads(line), "pid": pid} for line in path.read_text().splitlines() if line)
    return sorted(lines, key=lambda line: line["t"])


def measure(ranks: int, shard: int, step_s: float, steps: int, calls: DriverCalls, probe_dir: str) -> dict:
    from elastic import ElasticTrainer
    from elastic.testing.paced import paced_model

    for path in Path(probe_dir).glob("*.jsonl"):
        path.unlink()
    groups = ranks // shard
    killed = (groups - 1) * shard  # the last group's first rank
    killed_group = groups - 1
    with tempfile.TemporaryDirectory() as storage:
        config = job_config(storage, ranks, shard, steps, killed)
        result = ElasticTrainer(config, model_fn=paced_model(config, step_s)).fit()
    assert result.ok, result.exit
    events = result.summary["events"]
    lines = read_probe(probe_dir)
    [kill] = [line for line in lines if line["kind"] == "exit" and line["rank"] == killed]
    killed_at = kill["t"]
    commits = [line for line in lines if line["kind"] == "commit"]
    # A step's commit time: the last rank to apply it (every group applies every step together).
    step_done: dict[int, float] = {}
    # Whether the killed group took samples in a step: not while it is out, nor while it
    # catches up (a joining group holds no state yet); the others take its share then.
    killed_took_share: dict[int, bool] = {}
    for line in commits:
        step_done[line["step"]] = max(step_done.get(line["step"], 0.0), line["t"])
        killed_took_share[line["step"]] = line["group_samples"].get(str(killed_group), 0) > 0
    whole_at = min(line["t"] for line in commits
                   if line["rank"] is not None and line["rank"] // shard == killed_group and line["t"] > killed_at)
    before = sorted(t for step, t in step_done.items() if t < killed_at)
    typical = statistics.median(b - a for a, b in zip(before, before[1:]))
    done = sorted(step_done.values())
    # Without one group's samples the others take them: a paced step lasts as many forwards as
    # its rank's micro-batches, whole ones. That longer step is the layout's, not a stall.
    degraded = typical * math.ceil(SAMPLES_PER_RANK * groups / (groups - 1)) / SAMPLES_PER_RANK

    def stalls(commits_by_step: dict[int, float]) -> list[float]:
        """Each gap between commits from the kill until the killed group's return beyond the
        step time of the layout the gap's step ran in, by more than half a step."""
        window = sorted((t, step) for step, t in commits_by_step.items() if killed_at - typical <= t <= whole_at)
        window += sorted((t, step) for step, t in commits_by_step.items() if t > whole_at)[:1]
        gaps = [(b - a, typical if killed_took_share[step] else degraded)
                for (a, _), (b, step) in zip(window, window[1:])]
        return [gap - step_time for gap, step_time in gaps if gap > step_time + 0.5 * typical]

    job_stalls = stalls(step_done)
    survivors = {line["pid"]: line["rank"] for line in lines
                 if line["rank"] is not None and line["rank"] // shard != killed_group and line["t"] < killed_at}
    by_pid = defaultdict(list)
    for line in lines:
        by_pid[line["pid"]].append(line)
    created, cpu, cpu_net, regroups = [], [], [], []
    for pid in survivors:
        own = by_pid[pid]
        created.append(sum(1 for line in own if line["kind"] == "process-group" and killed_at <= line["t"] <= whole_at))
        regroups.extend(line for line in own if line["kind"] == "regroup" and killed_at <= line["t"] <= whole_at)
        own_commits = [line for line in own if line["kind"] == "commit"]
        last_before = max((line for line in own_commits if line["t"] < killed_at), key=lambda line: line["t"])
        first_after = min((line for line in own_commits if line["t"] >= whole_at), key=lambda line: line["t"],
                          default=own_commits[-1])
        beyond = first_after["cpu"] - last_before["cpu"] - _stepping(own, last_before["t"], first_after["t"])
        cpu.append(max(0.0, beyond))
        # what the process spends between steps when nothing fails (Ray's and gloo's threads),
        # over the window: the window is the machine's, 44 s at 64 ranks on two cores against 3 s at 4
        steady = [line for line in own_commits if line["t"] < killed_at][2:]
        if len(steady) > 1:
            span = steady[-1]["t"] - steady[0]["t"]
            rate = (steady[-1]["cpu"] - steady[0]["cpu"] - _stepping(own, steady[0]["t"], steady[-1]["t"])) / span
            cpu_net.append(max(0.0, beyond - rate * (first_after["t"] - last_before["t"])))
    stopped = {rank for rank in range(ranks) if rank // shard == killed_group}
    stopped |= {rank for pid, rank in survivors.items()
                if stalls({line["step"]: line["t"] for line in by_pid[pid] if line["kind"] == "commit"})}
    [fault] = [e for e in events if e["kind"] == EventKind.FAULT_INJECTED]
    recovered = next((e for e in events if e["kind"] == EventKind.RECOVERED), {})
    next_commit = min(t for t in done if t > killed_at)
    return {
        "groups": groups,
        "step_s": round(typical, 4),
        "degraded_step_s": round(degraded, 4),
        "stall_s": round(sum(job_stalls), 3),
        "stalls_s": [round(stall, 3) for stall in job_stalls],
        "ranks_stopped": len(stopped),
        "groups_created_per_survivor": {"max": max(created), "mean": round(statistics.mean(created), 2)},
        "survivor_recovery_cpu_s": round(max(cpu), 3),
        "survivor_recovery_cpu_s_median": round(statistics.median(cpu), 3),
        "survivor_recovery_cpu_s_net": round(max(cpu_net), 3),
        "survivor_recovery_cpu_s_net_median": round(statistics.median(cpu_net), 3),
        "survivor_regroups": regroup_figures(regroups),
        "object_store_bytes": sum(line.get("nbytes", 0) for line in lines
                                  if line["kind"] == "object-store" and killed_at <= line["t"] <= whole_at),
        "rank_to_rank_bytes": sum(e.get("rank_to_rank_bytes", 0) for e in events if e["kind"] == EventKind.GROUP_HEALED),
        "driver_calls": calls.between(killed_at, whole_at),
        "driver_calls_by_method": calls.by_method(killed_at, whole_at),
        "kill_to_whole_s": round(whole_at - killed_at, 3),
        "kill_to_commit_step_times": round((next_commit - killed_at) / typical, 2),
        "phases": {"kill_to_whole": {key: round(value, 3) for key, value in
                                     kill_to_whole_phases(events, fault, killed_group).items()},
                   "recovered": {key: value for key, value in recovered.items() if key.endswith("_s")}},
    }


def _stepping(lines: list[dict], after: float, until: float) -> float:
    """The CPU seconds of a rank's step calls that ended in ``(after, until]``."""
    return sum(line["cpu_s"] for line in lines if line["kind"] == "step" and after < line["t"] <= until)


def regroup_figures(regroups: list[dict]) -> dict:
    """The survivors' entries into a new build of the cross-group groups in the window: how many
    (every survivor's), the groups' counts, and the median and largest wall and CPU seconds of one
    (the rendezvous, every peer connected)."""
    if not regroups:
        return {"count": 0}
    return {"count": len(regroups), "groups": sorted({line["groups"] for line in regroups}),
            **{f"{what}_{stat}": round(read([line[what] for line in regroups]), 4)
               for what in ("wall_s", "cpu_s") for stat, read in (("median", statistics.median), ("max", max))}}


def power_law_exponent(sizes: list[int], values: list[float]) -> float | None:
    """``b`` of the least-squares fit ``value = a * size ** b`` (None for one size, or where a value is 0)."""
    if len(sizes) < 2 or min(values) <= 0:
        return None
    return statistics.linear_regression([math.log(size) for size in sizes], [math.log(value) for value in values]).slope


def pairing_s(ranks: int = 98_304) -> float:
    from bench.at_scale import MODELS
    from elastic.simulation.designs import Job
    from elastic.simulation.driver_cost import driver_cost

    return driver_cost(Job(MODELS["405b"], ranks)).buddies_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4,8,16", help="job sizes, comma-separated (multiples of --shard)")
    parser.add_argument("--shard", type=int, default=2, help="ranks per group")
    parser.add_argument("--step-s", type=float, default=0.6, help="each step's paced time")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--heal-dim", type=int, default=640, help="the heal's timed state: the model's dim "
                        "(640 with 5 layers: 0.31 GB with AdamW)")
    parser.add_argument("--heal-layers", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.ranks.split(",")]
    if any(size % args.shard or size // args.shard < 2 for size in sizes):
        parser.error(f"--ranks: each size must be a multiple of --shard={args.shard} with two groups or more")

    import ray

    from elastic.fleet.ray_connection import start_local_ray
    from elastic.testing import forked_ray_workers
    from elastic.testing.loopback import wait_for

    probe_dir = tempfile.mkdtemp(prefix="failure-probe-")
    os.environ["FAILURE_PROBE_DIR"] = probe_dir
    # The rank processes fork from a server that imported torch once: each then holds about half
    # the memory of one that imports it itself, and 64 of them fit 24 GB (they did not, before).
    fork_socket = os.path.join(probe_dir, "fork.sock")
    fork_server = forked_ray_workers.start_server(fork_socket, subprocess.DEVNULL,
                                                  dict(os.environ, OMP_NUM_THREADS="1"))
    wait_for(lambda: os.path.exists(fork_socket) or fork_server.poll() is not None, 120, "the fork server")
    if fork_server.poll() is not None:
        raise SystemExit(f"the fork server exited with {fork_server.returncode}")
    os.environ.update(forked_ray_workers.driver_env(fork_socket))
    ray.shutdown()
    calls = DriverCalls()
    figures = {"group_ranks": args.shard, "step_s": args.step_s, "sizes": {}}
    try:
        start_local_ray(num_cpus=max(sizes) + 2, log_to_driver=False, runtime_env={
            "env_vars": {"FAILURE_PROBE_DIR": probe_dir,
                         "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))},
            "worker_process_setup_hook": "bench.failure_probe.install"})
        for size in sizes:
            started = time.perf_counter()
            figures["sizes"][str(size)] = measured = measure(size, args.shard, args.step_s, args.steps, calls,
                                                             probe_dir)
            print(f"{size} ranks ({time.perf_counter() - started:.0f} s): {json.dumps(measured)}", flush=True)
        heal = heal_transport.measure(args.heal_dim, args.heal_layers, "cpu", repeats=3)
    finally:
        ray.shutdown()
        fork_server.terminate()
        fork_server.wait()
    medians = {road: statistics.median(seconds) for road, seconds in heal["seconds"].items()}
    figures["heal_bytes"] = heal["bytes"]
    figures["heal_speedup_vs_object_store"] = medians["object store"] / medians["rank to rank"]
    figures["kill_to_commit_step_times"] = max(size["kill_to_commit_step_times"] for size in figures["sizes"].values())
    figures["pairing_98304_s"] = pairing_s()
    laws = {}
    for name, read in (("stall_s", lambda m: m["stall_s"]),
                       ("ranks_stopped", lambda m: m["ranks_stopped"]),
                       ("groups_created_per_survivor", lambda m: m["groups_created_per_survivor"]["max"]),
                       ("survivor_recovery_cpu_s", lambda m: m["survivor_recovery_cpu_s"]),
                       ("survivor_recovery_cpu_s_median", lambda m: m["survivor_recovery_cpu_s_median"]),
                       ("survivor_recovery_cpu_s_net", lambda m: m["survivor_recovery_cpu_s_net"]),
                       ("survivor_recovery_cpu_s_net_median", lambda m: m["survivor_recovery_cpu_s_net_median"]),
                       ("survivor_regroup_cpu_s", lambda m: m["survivor_regroups"].get("cpu_s_median", 0.0)),
                       ("survivor_regroup_wall_s", lambda m: m["survivor_regroups"].get("wall_s_median", 0.0)),
                       ("object_store_bytes", lambda m: m["object_store_bytes"]),
                       ("driver_calls", lambda m: m["driver_calls"])):
        values = [read(figures["sizes"][str(size)]) for size in sizes]
        laws[name] = power_law_exponent(sizes, values)
        exponent = "n/a" if laws[name] is None else f"{laws[name]:+.2f}"
        print(f"{name:>28}: {values} at {sizes} ranks; grows as ranks ** {exponent}")
    figures["laws"] = laws
    print(f"re-pairing at 98,304 ranks: {1000 * figures['pairing_98304_s']:.2f} ms")
    print(f"the heal of {heal['bytes'] / 1e9:.2f} GB rank to rank: {figures['heal_speedup_vs_object_store']:.2f}x "
          f"the object store's speed (every copy whole: {heal['whole']})")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

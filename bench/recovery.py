"""Recovery from one killed rank: the same job trained (A) by elastic, which evicts the rank
and reruns the step on the surviving groups, (B) by Ray Train V2's TorchTrainer with
FailureConfig(max_failures=1), which restarts the worker group from its own checkpoint, and
(D) by torchft 0.2.0, whose surviving replica groups go on without the dead one while it is
restarted and healed from their state. Prints, for each, the time from the kill to the next
committed step and the steps redone, and B/A and D/A, measured in one run, for two jobs:

- tiny: steps of tens of milliseconds on 2 ranks; rank 1 exits at the start of step 25,
  mid-way between Ray Train's checkpoints (every 10). Target: A < 1 s and B/A >= 20.
- real: a larger model on 4 ranks whose steps take over a second; rank 1 exits 0.5 s into
  step 15, mid-way between Ray Train's checkpoints (every 10), while the other ranks are
  computing their own share. Target: A under 2 step times and B/A >= 10.

(D) is ``bench/torchft_job.py`` (its docstring gives the settings, torchft's defaults unless
said, and why): torchft's lighthouse on loopback (heartbeat timeout 5 s, its default), one
replica group of one process per rank (FSDP2 over a one-rank mesh), the same rank exiting at
the same point, and its group restarted at once by the supervisor, as torchrun would. Nothing
is checkpointed or rolled back: the survivors' next step commits once the lighthouse gives
them a quorum without the dead group (its heartbeat timed out, or its restart joined), and
the steps they commit without it train their own shares of the batch only. For D it also
prints the kill to the killed group committing again with every group in (whole), the steps
committed without it and their untrained shares in full-batch steps, its losses before the
kill against A's, and the first step whose loss differs from a clean torchft run's (expected:
the first step the killed group's share was not trained). D has no target.

    pip install -e ".[bench]"   # Ray Train and torchft, which the product itself does not need
    python bench/recovery.py [--jobs tiny,real] [--systems A,B,D]

With ``--memory``: every copy of a shard position lost, recovered (A) from the in-memory
tier (``checkpoint.memory_every = 1``: the survivors' own host copies and the buddies'
copies of the dead ranks' state) with a warm spare taking each dead rank's place
(``scaling.spares``), (A0) the same tier with no spare, and (B) the same job with neither,
restoring the last checkpoint (every 10 steps; the kill at step 45, by when the spares are
warm), from local disk and from an S3 API server on loopback. Two layouts: one group of shard 2 with rank 1 killed, and two groups
of shard 2 with both copies of shard 0 (ranks 0 and 2) killed. Prints, per layout and
storage, the state's step the run went back to, the committed steps lost, the seconds from
the kill to the next committed step and to the kill step committed again, and the bytes
of the checkpoint the restore loaded. Target: B/A >= 5 (kill to the next committed step),
A reads nothing from storage. Kill to the kill step committed again is printed beside it:
on a machine whose ranks use every core, the taken spares' replacements start (importing
torch) after A's first step and slow the next ones.

    python bench/recovery.py --memory

All train the reference model (elastic and torchft: one replica group of shard 1 per rank;
Ray Train: one worker per rank, gradients summed) with the same data plan, loss, optimizer
and global batch, so A and B commit the same losses, and D the same until the kill. The
killed rank exits with os._exit(1), once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.setup.preflight import build_config  # noqa: E402
from elastic.core.events import EventKind  # noqa: E402
from elastic.driver.recovery_timing import RECOVERY_PARTS  # noqa: E402
from bench.goodput import chosen_systems  # noqa: E402
from bench.torchft_job import TorchftResult  # noqa: E402
from elastic.testing.losses import max_relative_difference  # noqa: E402

KILLED_RANK = 1
SYSTEMS = ("A", "B", "D")


@dataclass(frozen=True)
class Job:
    name: str
    world: int
    model: dict
    seq_len: int
    global_batch: int
    micro_batch: int
    steps: int
    kill_step: int
    kill_after_s: float  # 0: at the start of the step
    checkpoint_every: int  # Ray Train's

    def config(self, storage: str, inject: str = ""):
        return build_config({
            "run_name": f"recovery-{self.name}", "storage": storage, "steps": self.steps,
            "global_batch": self.global_batch, "micro_batch": self.micro_batch, "seed": 3,
            "scaling": {"min_groups": 1, "max_groups": self.world, "shard": 1, "tp": 1, "cpus_per_rank": 0.25},
            "model": self.model,
            "data": {"seq_len": self.seq_len, "corpus_tokens": 200_000},
            "stragglers": {"enabled": False},
            "checkpoint": {"every": 0},
            # A killed actor is reported by Ray at once; the deadline only matters for hangs.
            "fault_tolerance": {"inject": inject, "min_deadline_s": 3.0},
        })


JOBS = {
    "tiny": Job("tiny", world=2, model={"dim": 32, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64}, seq_len=32,
                global_batch=8, micro_batch=2, steps=40, kill_step=25, kill_after_s=0.0, checkpoint_every=10),
    "real": Job("real", world=4, model={"dim": 256, "n_layers": 5, "n_heads": 8, "ffn_hidden": 768}, seq_len=256,
                global_batch=16, micro_batch=1, steps=20, kill_step=15, kill_after_s=0.5, checkpoint_every=10),
}


def run_elastic(job: Job, storage: str) -> dict:
    from elastic import ElasticTrainer

    after = f",after={job.kill_after_s}" if job.kill_after_s else ""
    summary = ElasticTrainer(job.config(storage, inject=f"kill:rank={KILLED_RANK},step={job.kill_step}{after}")).fit().summary
    assert summary["exit"] == "completed", summary["exit"]
    steps = summary["steps"]
    assert [r["step"] for r in steps] == list(range(job.steps)), "a committed step was lost or doubled"
    # Both times are on the run's event clock; the event is emitted as the fatal step is
    # dispatched, just before the rank's step starts, so this slightly overstates A.
    [fault] = [e for e in summary["events"] if e["kind"] == EventKind.FAULT_INJECTED]
    [recovered] = [e for e in summary["events"] if e["kind"] == EventKind.RECOVERED]
    return {
        "recovery_s": steps[job.kill_step]["t"] - fault["t"] - job.kill_after_s,
        "step_s": statistics.median(r["step_s"] for r in steps[: job.kill_step]),
        "rerun": summary["steps_discarded"],
        "lost": 0,
        "losses": summary["losses"],
        "parts": {k: recovered[k] for k in (*RECOVERY_PARTS, "total_s")},
    }


def ray_train_loop(loop: dict) -> None:
    """One Ray Train worker: its share of the global batch per step, gradients summed over all."""
    import torch

    import ray.train
    from bench.ray_train_job import report, restore, train_step
    from elastic.setup.hooks import resolve_hooks

    job: Job = loop["job"]
    config, rank = job.config(loop["storage"]), ray.train.get_context().get_world_rank()
    hooks = resolve_hooks(config)
    torch.manual_seed(config.seed)
    model = hooks.model_fn()
    optimizer = hooks.optimizer_fn(model.parameters())
    step, cursor, restored = restore(model, optimizer)
    log = Path(loop["log"])
    while step < config.steps:
        marker = log.with_suffix(".killed")
        if rank == KILLED_RANK and step == job.kill_step and not marker.exists():
            marker.write_text(json.dumps({"t": time.time() + job.kill_after_s, "step": step}))
            if not job.kill_after_s:
                os._exit(1)
            threading.Timer(job.kill_after_s, os._exit, (1,)).start()
        loss, cursor = train_step(model, optimizer, hooks, config, step, cursor, rank, job.world)
        step += 1
        report(model, optimizer, step, cursor, job.checkpoint_every, rank, {"step": step - 1, "loss": loss})
        if rank == 0:
            with log.open("a") as handle:
                handle.write(json.dumps({"t": time.time(), "step": step - 1, "loss": loss,
                                         "restored": restored}) + "\n")


def run_ray_train(job: Job, storage: str) -> dict:
    from bench.ray_train_job import fit

    log = Path(storage) / f"ray_train_steps_{job.name}.jsonl"
    fit(ray_train_loop, {"job": job, "storage": storage, "log": str(log)}, job.world,
        f"recovery-ray-train-{job.name}", storage, max_failures=1)
    killed = json.loads(log.with_suffix(".killed").read_text())
    records = [json.loads(line) for line in log.read_text().splitlines()]
    first_restart = min(i for i, r in enumerate(records) if r["restored"])
    before, after = records[:first_restart], records[first_restart:]
    # The committed history: what the restarted run reported replaces what it redid.
    committed = {r["step"]: r["loss"] for r in before + after}
    assert sorted(committed) == list(range(job.steps)), "a step is missing"
    resumed_at = next(r for r in after if r["step"] == killed["step"])
    return {
        "recovery_s": after[0]["t"] - killed["t"],
        "back_to_kill_step_s": resumed_at["t"] - killed["t"],
        # The kill step itself was in flight, as in A; the steps since the checkpoint were lost.
        "rerun": killed["step"] + 1 - after[0]["step"],
        "lost": killed["step"] - after[0]["step"],
        "losses": [committed[s] for s in range(job.steps)],
    }


def run_torchft(job: Job, storage: str) -> TorchftResult:
    """D: the job under torchft, the same rank exiting at the same point; and the first step
    whose loss differs from a clean torchft run's."""
    from bench.torchft_job import KillAtStep, against_clean

    kill = KillAtStep(KILLED_RANK, job.kill_step, job.kill_after_s)
    return against_clean(job.config(storage), Path(storage) / f"torchft-{job.name}", 0.0, kill)


def torchft_row(d: TorchftResult) -> dict:
    """D's row of the table: from the kill to the next commit by any group; the step runs a
    group threw away and ran again; the committed steps a rollback lost."""
    [kill] = d.run.kills
    return {"recovery_s": d.run.next_commit_s(kill), "rerun": d.run.discarded_runs(), "lost": d.run.rolled_back_steps()}


def print_torchft(job: Job, d: TorchftResult, a: dict | None) -> None:
    run = d.run
    [kill] = run.kills
    steps = run.step_commits()
    without = sum(commit.participants < run.groups for commit in steps.values())
    untrained = len(steps) - run.full_batch_steps()
    whole_s = run.group_whole_s(kill)
    whole = (f"{whole_s:.3f} s ({whole_s / run.healthy_s():.1f} step times)" if whole_s < math.inf
             else "never (the others finished the job first)")
    print(f"torchft: kill -> the killed group commits whole again {whole}; steps committed without it {without}, "
          f"their shares untrained {untrained:g} full-batch steps; group restarts {run.restarts}")
    losses = d.losses_against_clean()
    if a:
        before = max_relative_difference(run.losses()[:job.kill_step], a["losses"][:job.kill_step])
        losses += f"; before the kill D vs A max relative difference {before:.1e}"
    print(f"torchft: losses {losses}")


def print_ratios(a: dict | None, b: dict | None, d: TorchftResult | None) -> None:
    """B/A and D/A, kill -> next committed step, and A in step times."""
    if not a:
        return
    ratios = [f"{name}/A = {row['recovery_s'] / a['recovery_s']:.1f}"
              for name, row in (("B", b), ("D", d and torchft_row(d))) if row]
    print("; ".join(ratios + [f"A = {a['recovery_s'] / a['step_s']:.2f} step times"]))


def compare(job: Job, a: dict | None, b: dict | None, d: TorchftResult | None) -> bool:
    """Print the systems that ran side by side; the target's verdict (True where A or B did not run)."""
    model = job.model
    medians = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in (("A", a and a["step_s"]),
                                                                      ("D", d and d.run.healthy_s())) if seconds)
    print(f"\njob {job.name}: reference model dim {model['dim']} x {model['n_layers']} layers, seq {job.seq_len}, "
          f"{job.world} ranks, global batch {job.global_batch}, {job.steps} steps, median step {medians}; "
          f"rank {KILLED_RANK} killed {job.kill_after_s:g} s into step {job.kill_step}; "
          f"Ray Train checkpoints every {job.checkpoint_every}")
    print(f"{'':34} {'kill -> next committed step':>28} {'steps run again':>16} {'committed steps lost':>21}")
    rows = [("(A) elastic, evict + rerun", a), ("(B) Ray Train V2, restart + ckpt", b),
            ("(D) torchft, heal from peers", d and torchft_row(d))]
    for name, row in rows:
        if row:
            print(f"{name:34} {row['recovery_s']:>26.3f} s {row['rerun']:>16} {row['lost']:>21}")
    print_ratios(a, b, d)
    if a and b:
        print(f"elastic recovery parts (s): {a['parts']}; Ray Train back at the kill step after "
              f"{b['back_to_kill_step_s']:.3f} s; committed losses A vs B max relative difference "
              f"{max_relative_difference(b['losses'], a['losses']):.1e}")
    if d:
        print_torchft(job, d, a)
    return verdict(job, a, b)


def verdict(job: Job, a: dict | None, b: dict | None) -> bool:
    if not (a and b):
        print("target: not checked (it needs A and B)")
        return True
    ratio = b["recovery_s"] / a["recovery_s"]
    in_steps = a["recovery_s"] / a["step_s"]
    if job.kill_after_s:
        passed, target = in_steps < 2 and ratio >= 10, "A < 2 step times and B/A >= 10"
    else:
        passed, target = a["recovery_s"] < 1.0 and ratio >= 20, "A < 1 s and B/A >= 20"
    print(f"target {target}: {'PASS' if passed else 'FAIL'}")
    return passed


@dataclass(frozen=True)
class MemoryCase:
    name: str
    groups: int
    killed: tuple[int, ...]


MEMORY_CASES = (MemoryCase("1 group x shard 2, rank 1 killed", 1, (1,)),
                MemoryCase("2 groups x shard 2, both copies of shard 0 killed", 2, (0, 2)))
MEMORY_KILL_STEP, MEMORY_STEPS, MEMORY_CHECKPOINT_EVERY = 45, 54, 10
MEMORY_SIDES = {"A": (1, True), "A0": (1, False), "B": (0, False)}  # memory_every, spares


def memory_case_run(case: MemoryCase, storage: str, storage_options: dict, memory_every: int, spares: bool) -> dict:
    import fsspec

    from elastic import ElasticTrainer

    config = build_config({
        "run_name": f"memory-{case.groups}-{memory_every}", "storage": storage, "steps": MEMORY_STEPS,
        "global_batch": 8, "micro_batch": 2, "seed": 3,
        "scaling": {"min_groups": case.groups, "max_groups": case.groups, "shard": 2, "tp": 1, "cpus_per_rank": 0.25,
                    "spares": len(case.killed) if spares else 0},
        "model": {"dim": 128, "n_layers": 4, "n_heads": 4, "ffn_hidden": 384},
        "data": {"seq_len": 128, "corpus_tokens": 200_000},
        "stragglers": {"enabled": False},
        "checkpoint": {"every": MEMORY_CHECKPOINT_EVERY, "memory_every": memory_every, **storage_options},
        "fault_tolerance": {"min_deadline_s": 3.0,
                            "inject": ";".join(f"kill:rank={rank},step={MEMORY_KILL_STEP}" for rank in case.killed)},
    })
    summary = ElasticTrainer(config).fit().summary
    assert summary["exit"] == "completed", summary["exit"]
    steps = summary["steps"]
    assert [r["step"] for r in steps] == list(range(MEMORY_STEPS)), "a committed step was lost or doubled"
    fault_t = min(e["t"] for e in summary["events"] if e["kind"] == EventKind.FAULT_INJECTED)
    restores = [e for e in summary["events"] if e["kind"] in (
        EventKind.RESTORED_FROM_MEMORY, EventKind.RESTORED_FROM_CHECKPOINT, EventKind.RESTORED_INITIAL_STATE)]
    loaded = 0
    for event in restores:
        if event["kind"] == EventKind.RESTORED_FROM_CHECKPOINT:
            fs, root = fsspec.core.url_to_fs(f"{storage}/{config.run_name}/checkpoints",
                                             **({"endpoint_url": storage_options["s3_endpoint_url"]}
                                                if storage_options else {}))
            step_dir = next(path for path in fs.ls(root) if path.rstrip("/").endswith(f"{event['step']:08d}"))
            loaded += fs.du(step_dir) * len(event["groups"])
    return {
        "source": ", ".join(sorted({e["kind"].removeprefix("restored-") for e in restores})) or "peers",
        "back_to": min((e["step"] for e in restores), default=MEMORY_KILL_STEP),
        "lost": sum(e["rolled_back_steps"] for e in restores),
        "next_s": min(r["t"] for r in steps if r["t"] > fault_t) - fault_t,
        "kill_step_s": steps[MEMORY_KILL_STEP]["t"] - fault_t,
        "step_s": statistics.median(r["step_s"] for r in steps[:MEMORY_KILL_STEP]),
        "loaded": loaded,
        "restore_s": sum(e.get("seconds", 0.0) for e in restores),
        "spares": "".join("r" if e["was_ready"] else "w" for e in summary["events"] if e["kind"] == EventKind.SPARE_TAKEN),
    }


def compare_memory() -> bool:
    from elastic.testing.s3 import MotoServer

    s3 = MotoServer(bucket="bench-memory").start()
    verdicts = []
    try:
        with tempfile.TemporaryDirectory() as local:
            targets = {"local disk": (local, {}),
                       "loopback S3": (s3.url("runs"), {"s3_endpoint_url": s3.endpoint_url})}
            print(f"kill at step {MEMORY_KILL_STEP}, checkpoints every {MEMORY_CHECKPOINT_EVERY} steps, "
                  f"{MEMORY_STEPS} steps; (A) memory tier every step and warm spares, (A0) the tier alone, "
                  "(B) neither; spares taken: r ready, w still warming")
            print(f"{'layout, storage':<62} {'':>3} {'from':>18} {'back to':>8} {'lost':>5} {'restore':>9} "
                  f"{'kill->next':>11} {f'kill->step {MEMORY_KILL_STEP}':>14} {'ckpt bytes':>11} {'spares':>7}")
            for case in MEMORY_CASES:
                for target, (url, options) in targets.items():
                    rows = {side: memory_case_run(case, f"{url}/{side}", options, memory_every, spares)
                            for side, (memory_every, spares) in MEMORY_SIDES.items()}
                    for side, row in rows.items():
                        print(f"{case.name + ', ' + target:<62} {side:>3} {row['source']:>18} {row['back_to']:>8} "
                              f"{row['lost']:>5} {row['restore_s']:>7.3f} s {row['next_s']:>9.2f} s "
                              f"{row['kill_step_s']:>12.2f} s {row['loaded']:>11} {row['spares']:>7}")
                    a, b = rows["A"], rows["B"]
                    ratio = b["next_s"] / a["next_s"]
                    print(f"  kill -> next committed step: B/A0 (the tier alone) {b['next_s'] / rows['A0']['next_s']:.2f}; "
                          f"kill -> step {MEMORY_KILL_STEP} committed again: B/A {b['kill_step_s'] / a['kill_step_s']:.2f}, "
                          f"B/A0 {b['kill_step_s'] / rows['A0']['kill_step_s']:.2f}")
                    print(f"  the state's restore alone: B/A {b['restore_s'] / max(a['restore_s'], 1e-6):.1f} "
                          "(the rest of each recovery: detecting, starting or taking the replacement, rebuilding)")
                    passed = ratio >= 5 and a["loaded"] == 0 and a["source"] == "from-memory"
                    verdicts.append(passed)
                    print(f"  median step {a['step_s']:.3f} s; B/A (kill -> next committed step) {ratio:.2f}, A "
                          f"{a['next_s'] / a['step_s']:.1f} step times; target B/A >= 5 and A reads no checkpoint: "
                          f"{'PASS' if passed else 'FAIL'}")
    finally:
        s3.stop()
    return all(verdicts)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", default="tiny,real", help="comma-separated: " + ", ".join(JOBS))
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help="which to run, comma-separated: A (elastic), B (Ray Train V2), D (torchft)")
    parser.add_argument("--memory", action="store_true", help="the in-memory tier against a checkpoint restore")
    args = parser.parse_args()
    systems = chosen_systems(parser, args.systems, SYSTEMS)
    if args.memory:
        from elastic.fleet.ray_connection import start_local_ray
        from elastic.testing.s3 import set_test_credentials

        set_test_credentials()  # before Ray starts: the ranks inherit them
        start_local_ray(num_cpus=4, log_to_driver=False)
        return 0 if compare_memory() else 1
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    if systems & {"A", "B"}:
        from elastic.fleet.ray_connection import start_local_ray

        start_local_ray(num_cpus=4, log_to_driver=False)
    results = []
    with tempfile.TemporaryDirectory() as storage:
        for name in args.jobs.split(","):
            job = JOBS[name]
            a = run_elastic(job, storage) if "A" in systems else None
            b = run_ray_train(job, storage) if "B" in systems else None
            d = run_torchft(job, storage) if "D" in systems else None
            results.append(compare(job, a, b, d))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

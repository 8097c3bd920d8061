"""Goodput under repeated failures: the effective training time ratio of the same job,
killed on the same schedules, trained (A) by elastic with warm spares and the in-memory tier,
(B) by elastic without them, (C) by Ray Train V2, which restarts its workers from its last
checkpoint (every ``--checkpoint-every`` steps) after each kill, and (D) by torchft 0.2.0
(``bench/torchft_job.py``: its lighthouse, two replica groups of FSDP2 x 2, a killed rank's
group restarted at once and healed from the other group).

Effective training time ratio: the committed steps times the job's healthy step time (the
median step with every group in, in the same run), over the wall time from the start of the
first step to the last commit. It is the share of the wall time the same steps would take
without failures: a step that two groups share is not counted fuller when one group carries
it alone at twice the time.

The job: 2 groups x shard 2 (4 ranks; Ray Train: 4 workers) of a small reference model whose
forward waits like a host thread on a GPU, so a step takes ``--step-s`` while the CPU stays
free (``elastic/testing/paced.py``), and a rank killed (``os._exit``) every ``--interval`` seconds of
training, ``--kills`` times. For A it also prints each kill's time until the killed rank's
group is whole again (joined the quorum), in step times; for A and D each kill's time until
the next committed step.

torchft trains a step that one group commits alone on that group's half of the batch (the
other half is not trained), so D's goodput counts committed samples: committed samples x
healthy step time / global batch over the wall time, a step one group of two committed being
half a step. D's losses are checked against a clean torchft run (no kills, unpaced): they
differ from the first step one group trained alone, which the table names.

Targets (issue 23): A >= 90 % at a kill every 30 s; A's kill -> whole group <= 2 step times.

    pip install -e ".[bench]"   # Ray Train and torchft, which the product itself does not need
    python bench/goodput.py [--intervals 10,30,120] [--kills 3] [--step-s 1.0] [--systems A,B,C,D]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.core.outer_rounds import whole_rounds  # noqa: E402
from elastic.setup.config import TrainConfig  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402
from elastic.core.events import EventKind  # noqa: E402
from bench.torchft_job import TorchftResult  # noqa: E402

GROUPS, SHARD = 2, 2
WORLD = GROUPS * SHARD
GLOBAL_BATCH, MICRO_BATCH = 16, 1
SYSTEMS = ("A", "B", "C", "D")


def job_config(storage: str, name: str, steps: int, inject: str, spares: int, memory_every: int,
               checkpoint_every: int, scaling: dict | None = None, outer_every: int = 0,
               lost_learner: str = "redo") -> TrainConfig:
    """``scaling`` overrides the layout's settings (device, groups, shard); ``outer_every``: DiLoCo's
    rounds of that many steps (``sync.mode``), the steps and intervals in whole rounds."""
    if outer_every:  # the memory tier's copies at each round's start, as the config's default under DiLoCo
        steps, checkpoint_every = whole_rounds(steps, outer_every), whole_rounds(checkpoint_every, outer_every)
        memory_every = outer_every if memory_every else 0
    return build_config({
        "run_name": name, "storage": storage, "steps": steps, "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO_BATCH, "seed": 5,
        "scaling": {"min_groups": 1, "max_groups": GROUPS, "shard": SHARD, "tp": 1, "cpus_per_rank": 0.25,
                    "spares": spares} | (scaling or {}),
        "model": {"dim": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 192},
        "data": {"seq_len": 64, "corpus_tokens": 200_000},
        "stragglers": {"enabled": False},
        "checkpoint": {"every": checkpoint_every, "memory_every": memory_every},
        "fault_tolerance": {"inject": inject, "min_deadline_s": 3.0},
        "sync": {"mode": "diloco", "outer_every": outer_every, "lost_learner": lost_learner} if outer_every else {},
    })


def steps_for(interval: float, kills: int, step_s: float) -> int:
    """Enough steps that every kill fires before the run ends."""
    return math.ceil((kills + 0.5) * interval / step_s)


def ratio(steps: int, healthy_s: float, wall_s: float) -> float:
    return steps * healthy_s / wall_s


def kill_to_whole_phases(events: list[dict], fault: dict, group: int) -> dict[str, float]:
    """Where the time from a kill to its group whole again went, in seconds: until the rank's
    failure was seen and the others drained (``detect_s``), the replacement started or a spare
    assumed the rank (``start_s``), the group's world and model built (``build_s``), the wait
    for the survivors' next boundary (``boundary_s``), the state copied from a peer
    (``heal_s``), and the rest until the group joined (``join_s``); and from the failure seen to
    the group built (``evicted_to_built_s``: its start and build, with the wait for a placement
    and the driver's polls)."""
    def first(kind: str, **match) -> dict | None:
        return next((e for e in events if e["kind"] == kind and e["t"] >= fault["t"]
                     and all(e.get(key) == value for key, value in match.items())), None)

    failed, built = first(EventKind.RANK_FAILED), first(EventKind.GROUP_BUILT, group=group)
    healed, joined = first(EventKind.GROUP_HEALED, group=group), first(EventKind.GROUP_JOINED, group=group)
    if not (failed and built and joined):
        return {}
    # caught up while every group stepped, or taken in the first step after the join: no wait
    # for the copy before the group is in
    if healed and (healed.get("overlapped") or healed.get("before_first_step")):
        healed = None
    heal_s = healed["seconds"] if healed else 0.0
    heal_started = (healed["t"] - heal_s) if healed else joined["t"]
    return {"detect_s": failed["t"] - fault["t"], "start_s": built.get("start_s", 0.0),
            "build_s": built.get("build_s", 0.0),
            "boundary_s": max(0.0, heal_started - built["t"]), "heal_s": heal_s,
            "join_s": joined["t"] - (healed["t"] if healed else heal_started),
            "evicted_to_built_s": built["t"] - failed["t"]}


def run_elastic(storage: str, interval: float, kills: int, step_s: float, spares: int, memory_every: int,
                checkpoint_every: int, scaling: dict | None = None, steps: int | None = None,
                outer_every: int = 0, lost_learner: str = "redo") -> dict:
    from elastic import ElasticTrainer
    from elastic.testing.paced import paced_model

    steps = steps or steps_for(interval, kills, step_s)
    inject = ";".join(f"kill:rank=random,at={interval * k:g}" for k in range(1, kills + 1))
    if outer_every:
        # A kill at a time fires at the run's next pause, which DiLoCo holds to a round's end: it
        # would always land between rounds, where nothing is redone. A kill at a step instead,
        # about every ``interval`` seconds, moved on by up to a round (or an interval) at random.
        draws = random.Random(f"goodput:{interval}:{outer_every}")
        every = round(interval / step_s)
        at = [every * k + draws.randrange(min(outer_every, every)) for k in range(1, kills + 1)]
        inject = ";".join(f"kill:rank=random,step={step}" for step in at)
        steps = max(steps, at[-1] + every // 2)
    name = f"goodput-{interval:g}-{spares}-{memory_every}"
    config = job_config(storage, name, steps, inject, spares, memory_every, checkpoint_every, scaling, outer_every,
                        lost_learner)
    steps = config.steps
    summary = ElasticTrainer(config, model_fn=paced_model(config, step_s)).fit().summary
    assert summary["exit"] == "completed", summary["exit"]
    records = summary["steps"]
    assert sorted({r["step"] for r in records}) == list(range(steps)), "a committed step was lost"
    events = summary["events"]
    faults = [e for e in events if e["kind"] == EventKind.FAULT_INJECTED]
    assert len(faults) == kills, f"{len(faults)} of {kills} kills fired"
    groups, shard = config.scaling.max_groups, config.scaling.shard
    healthy = statistics.median(r["step_s"] for r in records if r["live_groups"] == groups)
    started, ended = records[0]["t"] - records[0]["step_s"], records[-1]["t"]
    if summary["steps_rolled_back"]:  # the first steps' first commits were rolled back: from the groups' first join
        started = min(e["t"] for e in events if e["kind"] == EventKind.GROUP_JOINED)
    whole, phases = [], []
    for fault in faults:
        [rank] = fault["ranks"]
        group = rank // shard
        joined = [e["t"] for e in events if e["kind"] == EventKind.GROUP_JOINED and e["group"] == group
                  and e["t"] >= fault["t"]]
        whole.append((min(joined) - fault["t"]) / healthy if joined else math.inf)
        phases.append(kill_to_whole_phases(events, fault, group))
    next_commit = [min(r["t"] for r in records if r["t"] > fault["t"]) - fault["t"] for fault in faults]
    return {
        "goodput": ratio(steps, healthy, ended - started),
        "healthy_s": healthy,
        "wall_s": ended - started,
        "steps": steps,
        "whole_steps": whole,
        "whole_phases": phases,
        "next_commit_s": next_commit,
        "spares_taken": sum(e["kind"] == EventKind.SPARE_TAKEN for e in events),
        "losses": summary["losses"],
    }


def ray_train_loop(loop: dict) -> None:
    """One Ray Train worker: its quarter of the global batch per step, gradients summed over
    the four, a checkpoint every ``checkpoint_every`` steps; rank ``k % 4`` exits at the k-th
    kill time of the schedule, counted from the first step of the first attempt."""
    import torch

    import ray.train
    from bench.ray_train_job import report, restore, train_step
    from elastic.setup.hooks import model_args, resolve_hooks
    from elastic.testing.paced import PacedModel

    config: TrainConfig = loop["config"]
    rank = ray.train.get_context().get_world_rank()
    hooks = resolve_hooks(config)
    torch.manual_seed(config.seed)
    model = PacedModel(model_args(config), loop["step_s"] / (GLOBAL_BATCH // WORLD // MICRO_BATCH))()
    optimizer = hooks.optimizer_fn(model.parameters())
    step, cursor, _ = restore(model, optimizer)
    log, start_file = Path(loop["log"]), Path(loop["log"]).with_suffix(".start")
    while step < config.steps:
        if rank == 0 and not start_file.exists():
            start_file.write_text(str(time.time()))
        if start_file.exists():
            due = int((time.time() - float(start_file.read_text())) // loop["interval"])
            for kill in range(1, min(due, loop["kills"]) + 1):
                marker = log.with_suffix(f".kill{kill}")
                if kill % WORLD == rank and not marker.exists():
                    marker.write_text(str(time.time()))
                    os._exit(1)
        began = time.time()
        _, cursor = train_step(model, optimizer, hooks, config, step, cursor, rank, WORLD)
        step += 1
        report(model, optimizer, step, cursor, loop["checkpoint_every"], rank, {"step": step - 1})
        if rank == 0:
            with log.open("a") as handle:
                handle.write(json.dumps({"t": time.time(), "step": step - 1, "step_s": time.time() - began}) + "\n")


def run_ray_train(storage: str, interval: float, kills: int, step_s: float, checkpoint_every: int) -> dict:
    from bench.ray_train_job import fit

    steps = steps_for(interval, kills, step_s)
    config = job_config(storage, f"goodput-ray-train-{interval:g}", steps, "", 0, 0, 0)
    log = Path(storage) / f"ray_train_{interval:g}.jsonl"
    fit(ray_train_loop, {"config": config, "log": str(log), "interval": interval, "kills": kills, "step_s": step_s,
                         "checkpoint_every": checkpoint_every},
        WORLD, f"goodput-ray-train-{interval:g}", storage, max_failures=kills + 1)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert {r["step"] for r in records} == set(range(steps)), "a step is missing"
    fired = len(list(log.parent.glob(f"{log.stem}.kill*")))
    assert fired == kills, f"{fired} of {kills} kills fired"
    healthy = statistics.median(r["step_s"] for r in records)
    started = float(log.with_suffix(".start").read_text())
    return {"goodput": ratio(steps, healthy, records[-1]["t"] - started), "healthy_s": healthy,
            "wall_s": records[-1]["t"] - started, "steps": steps}


def run_torchft(storage: str, interval: float, kills: int, step_s: float, heartbeat_ms: int,
                outer_every: int = 0) -> TorchftResult:
    """``outer_every``: torchft's DiLoCo (``torchft.local_sgd.DiLoCo``) with rounds of this many steps."""
    from bench.torchft_job import KillEvery, TorchftSettings, against_clean

    steps = steps_for(interval, kills, step_s)
    config = job_config(storage, f"goodput-torchft-{interval:g}", steps, "", 0, 0, 0, outer_every=outer_every)
    plan = KillEvery(interval, kills, config.seed)  # ranks drawn with the job's seed
    return against_clean(config, Path(storage) / f"torchft_{interval:g}", step_s, plan,
                         TorchftSettings(heartbeat_ms=heartbeat_ms))


@dataclass(frozen=True)
class Row:
    """One kill interval's results; None where the system was not run."""

    interval: float
    a: dict | None
    b: dict | None
    c: dict | None
    d: TorchftResult | None


def run_row(args: argparse.Namespace, systems: set[str], interval: float) -> Row:
    with tempfile.TemporaryDirectory() as storage:
        a = (run_elastic(storage, interval, args.kills, args.step_s, 1, 10, args.checkpoint_every,
                         outer_every=args.outer_every, lost_learner=args.lost_learner) if "A" in systems else None)
        b = (run_elastic(storage, interval, args.kills, args.step_s, 0, 0, args.checkpoint_every,
                         outer_every=args.outer_every, lost_learner=args.lost_learner) if "B" in systems else None)
        c = run_ray_train(storage, interval, args.kills, args.step_s, args.checkpoint_every) if "C" in systems else None
        d = (run_torchft(storage, interval, args.kills, args.step_s, args.torchft_heartbeat_ms, args.outer_every)
             if "D" in systems else None)
    return Row(interval, a, b, c, d)


def percent(goodput: float | None, width: int) -> str:
    return f"{goodput:>{width}.1%}" if goodput is not None else f"{'-':>{width}}"


def times(seconds: list[float], healthy_s: float) -> str:
    """Seconds, and in step times."""
    return ", ".join(f"{s:.2f} ({s / healthy_s:.1f})" for s in seconds)


def phase_line(phases: dict[str, float]) -> str:
    return " ".join(f"{name.removesuffix('_s')} {seconds:.2f}" for name, seconds in phases.items()) or "-"


def print_row(row: Row) -> None:
    a, b, c, d = row.a, row.b, row.c, row.d
    goodputs = {"A": a and a["goodput"], "B": b and b["goodput"], "C": c and c["goodput"], "D": d and d.run.goodput()}
    a_over = {name: f"{goodputs['A'] / goodputs[name]:>6.2f}" if a and goodputs[name] else f"{'-':>6}" for name in "CD"}
    whole = ", ".join(f"{steps:.2f}" for steps in a["whole_steps"]) if a else "-"
    healthy = [f"{name} {row['healthy_s']:.3f} s" for name, row in (("A", a), ("B", b), ("C", c)) if row]
    healthy += [f"D {d.run.healthy_s():.3f} s"] if d else []
    spares = f"; spares taken {a['spares_taken']}" if a else ""
    print(f"{row.interval:>9g}s {percent(goodputs['A'], 19)} {percent(goodputs['B'], 12)} {percent(goodputs['C'], 16)} "
          f"{percent(goodputs['D'], 12)} {a_over['C']} {a_over['D']}  {whole}  (healthy steps: {', '.join(healthy)}{spares})")
    next_commit = [f"A {times(a['next_commit_s'], a['healthy_s'])}"] if a else []
    next_commit += [f"D {times([d.run.next_commit_s(kill) for kill in d.run.kills], d.run.healthy_s())}"] if d else []
    if next_commit:
        print(f"{'':>11}kill -> next commit, s (step times): {'; '.join(next_commit)}")
    if a:
        print(f"{'':>11}A: kill -> whole group, s, by phase: {'; '.join(map(phase_line, a['whole_phases']))}")
    if d:
        print_torchft(d)


def print_torchft(d: TorchftResult) -> None:
    run = d.run
    steps = run.step_commits()
    alone = sum(commit.participants < GROUPS for commit in steps.values())
    print(f"{'':>11}D: kill -> killed group trains its half again, s (step times): "
          f"{times([run.group_whole_s(kill) for kill in run.kills], run.healthy_s())}")
    unit = "rounds" if d.rounds else "steps"  # under DiLoCo torchft commits rounds
    print(f"{'':>11}D: {len(steps)} {unit} committed ({alone} by one group alone) = {run.full_batch_steps():g} "
          f"full-batch {unit}, {run.restarts} group restarts; losses {d.losses_against_clean()}")


def chosen_systems(parser: argparse.ArgumentParser, text: str, known: tuple[str, ...]) -> set[str]:
    """``--systems``'s letters (this bench's and ``recovery.py``'s)."""
    systems = {name.strip().upper() for name in text.split(",") if name.strip()}
    if unknown := systems - set(known):
        parser.error(f"--systems: unknown {', '.join(sorted(unknown))} (choose from {', '.join(known)})")
    return systems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals", default="10,30,120", help="seconds between kills, comma-separated")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=1.0)
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (A, B and C)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="which to run, comma-separated: A, B, C, D")
    parser.add_argument("--no-ray-train", action="store_true", help="leave C out")
    parser.add_argument("--outer-every", type=int, default=0,
                        help="A, B and D train DiLoCo's rounds of this many steps (sync.mode = diloco; 0: every "
                             "step's sum)")
    parser.add_argument("--lost-learner", choices=("redo", "drop"), default="redo",
                        help="with --outer-every: sync.lost_learner")
    parser.add_argument("--torchft-heartbeat-ms", type=int, default=5000,
                        help="D's lighthouse --heartbeat_timeout_ms (torchft's default 5000)")
    args = parser.parse_args()
    systems = chosen_systems(parser, args.systems, SYSTEMS) - ({"C"} if args.no_ray_train else set())
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    if systems & {"A", "B", "C"}:
        from elastic.fleet.ray_connection import start_local_ray

        start_local_ray(num_cpus=4, log_to_driver=False)
    verdicts = []
    print(f"{GROUPS} groups x shard {SHARD}, steps of ~{args.step_s:g} s, {args.kills} kills per schedule, "
          f"checkpoints every {args.checkpoint_every} steps, systems {','.join(sorted(systems))}")
    print(f"{'kill every':>10} {'(A) spares + memory':>20} {'(B) neither':>12} {'(C) Ray Train V2':>17} "
          f"{'(D) torchft':>12} {'A/C':>6} {'A/D':>6}  A: kill -> group whole (step times)")
    for interval in (float(text) for text in args.intervals.split(",")):
        row = run_row(args, systems, interval)
        print_row(row)
        if row.a is None:
            continue
        if interval == 30:
            verdicts.append(row.a["goodput"] >= 0.90)
        verdicts.append(max(row.a["whole_steps"]) <= 2)
    if "A" not in systems:
        print("targets: not checked (A not run)")
        return 0
    passed = all(verdicts)
    print(f"targets: A >= 90 % at a kill every 30 s, A's kill -> whole group <= 2 step times: "
          f"{'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

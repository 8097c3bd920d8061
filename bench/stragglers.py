"""Benchmark: straggler detection and mitigation, simulated and on real Ray actors, in one run.

(a) Noise never acts: ``--sim-steps`` simulated steps with +/-``--noise`` uniform noise on
    every rank's compute time through ``StragglerMitigation`` (fake clock, no Ray), then a
    real run of ``--noise-steps`` steps with ``stragglers.noise`` set to the same amplitude.
    Target: zero mitigations in both.
(b) One rank slowed ``--factor`` x from ``--onset-s`` seconds into training (by then the
    warm spare has started, as in any run past its first minutes; the bench says when it
    had not), three real runs of ``--steps`` steps: healthy, slowed with mitigation, slowed
    with mitigation off. Reports the steps from the onset to the ``straggler-detected``
    event (target <= 10) and the median step time once the mitigation has taken effect
    (from the first step the replacement takes part in, past ``--settle`` warm-up steps)
    against the healthy run's over the same steps (target within 10 %), and the
    mitigation-off run's; the share of the slowdown the mitigation recovered (target >=
    60 %), and the steps from the decision until the full quorum is back. Every run keeps
    ``--spares`` warm spares (default 1), so a replaced rank's place goes to a process
    started ahead; the mitigated run's straggler and spare events and its steps around
    the decision are printed in order.

    python bench/stragglers.py [--steps 160] [--onset-s 8] [--factor 1.5] [--spares 1]

Real runs use 2 groups x 2 ranks (shard 2) of a small model (``MODEL``, 2 layers of dim 256,
seq 128) with 8 samples per rank per step, so compute is a large share of a step; on a
shared machine step times carry the other load's noise, which is why the comparisons use
medians.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic import ElasticTrainer  # noqa: E402
from elastic.setup.config import StragglerConfig  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402
from elastic.core.events import EventKind, EventLog  # noqa: E402
from elastic.core.straggler_mitigation import StragglerMitigation  # noqa: E402
from elastic.fleet.ray_connection import start_local_ray  # noqa: E402


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulated_noise(steps: int, noise: float, groups: int, ranks_per_group: int, seed: int) -> tuple[int, int]:
    """(flags, mitigations) over ``steps`` steps of a healthy fleet with uniform noise."""
    clock = FakeClock()
    events = EventLog(clock)
    global_batch = 1024
    mitigation = StragglerMitigation(StragglerConfig(), global_batch, events, clock=clock)
    rng = np.random.default_rng(seed)
    n = groups * ranks_per_group
    ranks = np.arange(n)
    group_of = ranks // ranks_per_group
    speed = rng.uniform(0.95, 1.05, n) * 1e-3  # each rank's own seconds per sample
    weights: dict[int, float] = {}
    for step in range(steps):
        clock.t += 1.0
        samples = np.array([weights.get(g, 1.0) for g in range(groups)])
        samples = np.repeat(samples / samples.sum() * global_batch, ranks_per_group)
        compute = speed * samples * rng.uniform(1 - noise, 1 + noise, n)
        actions = mitigation.on_step_arrays(
            step, ranks, group_of, samples=samples, compute_s=compute, fixed_s=np.full(n, 0.01),
            step_s=0.01 + float(compute.max()), spare_slot=True, min_groups=1,
        )
        weights = actions.weights if actions.weights is not None else weights
    mitigation.close()
    return len(events.of_kind(EventKind.STRAGGLER_DETECTED)), len(events.of_kind(EventKind.STRAGGLER_MITIGATED))


# Large enough that compute is most of a step (a slowed rank slows the step by most of its
# factor, as a slow GPU would): with the tiny test model, per-step overheads were 4/5 of it.
MODEL = {"dim": 256, "n_layers": 2, "n_heads": 4, "ffn_hidden": 768}
SEQ_LEN = 128


def real_run(root: str, name: str, steps: int, spares: int = 0, **overrides):
    values = {
        "run_name": name, "storage": os.path.join(root, "runs"), "steps": steps,
        "global_batch": 32, "micro_batch": 4, "seed": 3,
        "scaling": {"min_groups": 1, "max_groups": 2, "shard": 2, "tp": 1, "cpus_per_rank": 0.25, "spares": spares,
                    "device": "cpu"},  # the control plane's bench: CPU ranks, also where GPUs are
        "model": MODEL,
        "data": {"seq_len": SEQ_LEN, "corpus_tokens": 400_000},
        "fault_tolerance": {"first_step_deadline_s": 120, "collective_timeout_s": 20},
    }
    for key, value in overrides.items():
        section, _, leaf = key.partition("__")
        values.setdefault(section, {})[leaf] = value
    started = time.perf_counter()
    result = ElasticTrainer(build_config(values)).fit()
    if not result.ok:
        raise SystemExit(f"{name}: {result.exit}")
    print(f"  {name}: {steps} steps in {time.perf_counter() - started:.0f} s")
    return result.summary


def of_kind(summary: dict, kind: str) -> list[dict]:
    return [event for event in summary["events"] if event["kind"] == kind]


def median_step_s(summary: dict, first: int, last: int | None = None) -> float:
    return float(np.median([r["step_s"] for r in summary["steps"] if first <= r["step"] < (last or 1 << 30)]))


TIMELINE = ("straggler-detected", "straggler-recovered", "straggler-decided", "straggler-mitigated", "spare-ready",
            "spare-taken", "spare-lost", "rank-evicted", "rank-failed", "group-healed", "group-evicted")


def print_timeline(summary: dict) -> None:
    """The mitigated run's straggler and spare events, in order, with seconds since the first
    step: what a figure below the target is made of."""
    start = summary["steps"][0]["t"] - summary["steps"][0]["step_s"]
    events = [event for event in summary["events"] if event["kind"] in TIMELINE]
    decided = [event["step"] for event in events if event["kind"] == "straggler-decided"]
    shown = range(min(decided, default=0) - 5, max(decided, default=0) + 15)
    lines = [(event["t"], f"{event['kind']}: {({k: v for k, v in event.items() if k not in ('t', 'kind')})}")
             for event in events]
    lines += [(record["t"], f"step {record['step']}: {record['step_s'] * 1e3:.1f} ms, compute ms by rank "
                            f"{ {rank: round(s * 1e3, 1) for rank, s in record['rank_compute_s'].items()} }")
              for record in summary["steps"] if record["step"] in shown]
    for t, line in sorted(lines, key=lambda item: item[0]):
        print(f"  {t - start:+7.2f} s {line}")


def joined_again(summary: dict, action: dict) -> int | None:
    """The first step with every rank again after ``action`` took effect: the membership's
    generation changes as a replaced rank's group leaves and as it heals (an eviction lands
    a few steps after the decision, and a warm spare may heal the group before the next
    step starts)."""
    ranks = max(r["live_ranks"] for r in summary["steps"])
    decided = next(r["generation"] for r in summary["steps"] if r["step"] >= action["step"])
    return next((r["step"] for r in summary["steps"]
                 if r["step"] > action["step"] and r["generation"] != decided and r["live_ranks"] == ranks), None)


def detection_alone(root: str, args: argparse.Namespace, slow: str) -> int:
    """The slowed run alone: the steps from the onset to the slow rank's detection, what was
    flagged on the way, and each rank's compute seconds before and after the onset (a peer
    that waits for the slow rank inside the group's collectives times that wait as compute)."""
    slowed = real_run(root, "slowed", args.steps, args.spares, fault_tolerance__inject=slow)
    print_timeline(slowed)
    onset = of_kind(slowed, "fault-injected")[0]["step"]
    flags = [(e["step"] - onset, e["rank"]) for e in of_kind(slowed, "straggler-detected")]
    print(f"  onset at step {onset}; flags (steps after the onset, rank): {flags or 'none'}")
    for label, steps in (("before", slowed["steps"][max(0, onset - 10):onset]), ("after", slowed["steps"][onset:onset + 10])):
        ranks = sorted(steps[0]["rank_compute_s"], key=int) if steps else []
        medians = {rank: float(np.median([step["rank_compute_s"][rank] for step in steps if rank in step["rank_compute_s"]]))
                   for rank in ranks}
        print(f"  median compute s per rank, 10 steps {label} the onset: "
              + ", ".join(f"{rank}: {seconds:.3f}" for rank, seconds in medians.items()))
    to_detect = next((steps for steps, rank in flags if rank == args.slow_rank), None)
    print(f"  onset -> detection of rank {args.slow_rank}: {to_detect if to_detect is not None else 'never'} steps "
          f"(target <= 10): {'PASS' if to_detect is not None and to_detect <= 10 else 'FAIL'}")
    return 0 if to_detect is not None and to_detect <= 10 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim-steps", type=int, default=1000)
    parser.add_argument("--sim-groups", type=int, default=8)
    parser.add_argument("--sim-ranks-per-group", type=int, default=4)
    parser.add_argument("--noise", type=float, default=0.15)
    parser.add_argument("--noise-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--onset-s", type=float, default=8.0, help="seconds into training the slowdown starts")
    parser.add_argument("--factor", type=float, default=1.5)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--slow-kind", choices=("slow", "slow-device"), default="slow",
                        help="slow: work after the rank's compute; slow-device: inside its blocks' forward, so its "
                             "FSDP2 partner waits for it inside the collectives (as for a slow GPU)")
    parser.add_argument("--only-slowed", action="store_true", help="skip (a) and the healthy and unmitigated runs: "
                        "the slowed run's detection alone")
    parser.add_argument("--settle", type=int, default=3, help="warm-up steps skipped after a replacement joins")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spares", type=int, default=1, help="warm spares in every run of (b)")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-stragglers-")
    start_local_ray(num_cpus=8, log_to_driver=False)
    verdicts = []
    slowed = f"(b) rank {args.slow_rank} slowed {args.factor}x ({args.slow_kind}) from {args.onset_s:g} s into training"
    slow = f"{args.slow_kind}:rank={args.slow_rank},factor={args.factor},at={args.onset_s}"

    if args.only_slowed:
        print(slowed)
        return detection_alone(root, args, slow)
    print(f"(a) noise +/-{args.noise:.0%} on every rank")
    flags, mitigations = simulated_noise(
        args.sim_steps, args.noise, args.sim_groups, args.sim_ranks_per_group, args.seed
    )
    print(f"  simulated: {args.sim_steps} steps x {args.sim_groups * args.sim_ranks_per_group} ranks: "
          f"{flags} flags, {mitigations} mitigations")
    noisy = real_run(root, "noise", args.noise_steps, stragglers__noise=args.noise)
    real_flags, real_mitigations = len(of_kind(noisy, "straggler-detected")), len(of_kind(noisy, "straggler-mitigated"))
    print(f"  real: {args.noise_steps} steps x 4 ranks: {real_flags} flags, {real_mitigations} mitigations")
    verdicts.append(mitigations == 0 and real_mitigations == 0)

    print(slowed)
    healthy = real_run(root, "healthy", args.steps, args.spares)
    mitigated = real_run(root, "mitigated", args.steps, args.spares, fault_tolerance__inject=slow)
    unmitigated = real_run(root, "unmitigated", args.steps, args.spares, fault_tolerance__inject=slow,
                           stragglers__mitigate=False)
    print_timeline(mitigated)
    detected = [e for e in of_kind(mitigated, "straggler-detected") if e["rank"] == args.slow_rank]
    actions = of_kind(mitigated, "straggler-mitigated")
    if not detected or not actions:
        print("  the slow rank was not detected and mitigated: FAIL")
        return 1
    onset = of_kind(mitigated, "fault-injected")[0]["step"]
    to_detect = detected[0]["step"] - onset
    back = joined_again(mitigated, actions[0])
    if back is None or back + args.settle >= args.steps:
        print(f"  the mitigation did not take effect before the run ended (step {back}): FAIL")
        return 1
    first = back + args.settle
    healthy_s = median_step_s(healthy, first)
    after_s = median_step_s(mitigated, first)
    off_s = median_step_s(unmitigated, first)
    taken = of_kind(mitigated, "spare-taken")
    print(f"  onset to detection: {to_detect} steps (target <= 10); first action {actions[0]['action']} at step "
          f"{actions[0]['step']}, full quorum again at step {back} ({back - actions[0]['step']} steps later; "
          f"spares taken: {[(e['rank'], e['was_ready']) for e in taken]})")
    print(f"  median step time from step {first}: healthy {healthy_s * 1e3:.1f} ms, mitigated "
          f"{after_s * 1e3:.1f} ms ({after_s / healthy_s - 1:+.1%}, target within 10%), mitigation off "
          f"{off_s * 1e3:.1f} ms ({off_s / healthy_s - 1:+.1%})")
    before = (onset, detected[0]["step"] + 1)
    print(f"  steps {before[0]}..{before[1] - 1} (slowed, before the decision): mitigated run "
          f"{median_step_s(mitigated, *before) * 1e3:.1f} ms, healthy run {median_step_s(healthy, *before) * 1e3:.1f} ms")
    recovered = (off_s - after_s) / (off_s - healthy_s) if off_s > healthy_s else float("nan")
    print(f"  slowdown recovered by the mitigation: {recovered:.0%} (target >= 60 %)")
    if taken:  # the spare taken is started again: on a machine whose ranks use every core it takes their CPU
        refilled = [e["t"] for e in of_kind(mitigated, "spare-ready") if e["t"] > taken[0]["t"]]
        settled = next((r["step"] for r in mitigated["steps"] if refilled and r["t"] > refilled[0]), None)
        if settled is not None and settled + args.settle < args.steps:
            after_refill = median_step_s(mitigated, settled + args.settle)
            healthy_then, off_then = median_step_s(healthy, settled + args.settle), median_step_s(
                unmitigated, settled + args.settle)
            print(f"  once the spare taken is replaced (ready at step {settled}): healthy {healthy_then * 1e3:.1f} ms, "
                  f"mitigated {after_refill * 1e3:.1f} ms ({after_refill / healthy_then - 1:+.1%}), mitigation off "
                  f"{off_then * 1e3:.1f} ms; recovered {(off_then - after_refill) / (off_then - healthy_then):.0%}")
    verdicts.append(to_detect <= 10 and after_s <= 1.1 * healthy_s and recovered >= 0.6)
    print("PASS" if all(verdicts) else "FAIL")
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())

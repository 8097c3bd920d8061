"""Benchmark: the driver's per-step decision cost at 16,384 simulated ranks, no Ray; with
``--ray``, the driver's CPU per steady-state step on real Ray actors (null ranks, 8 to 128),
runs against the per-rank-call pattern they replaced (``bench/null_ranks.py``).

Per simulated step, with the controller's own decision code: the membership quorum and the
data-plan weights (``group_weights``), the data plan for the step, and straggler handling
(``StragglerMitigation``: the detector over every present rank's compute seconds per
sample, the policy's per-group inputs and decision, applied to the membership through the
group lifecycle).
Per-rank timings are synthetic (±10 % noise, one
rank 1.6x slow from step 20) and generated outside the timed region, as are the results a
real driver would receive from its workers. Every 50 steps a random rank is evicted (its
group sits out one step, a generation change) and its replacement rejoins the next step.

    python bench/control_plane.py [--groups 2048] [--ranks-per-group 8] [--steps 200]
    python bench/control_plane.py --ray [--ranks 8,32,128] [--steps 150] [--step-ms 50]

The one-off setup (the first epoch's permutation, lru_cached by the data plan) is timed
separately. PASS/FAIL compares the mean per-step total with --target-ms (5 ms); the exit
status is 0 on PASS, 1 on FAIL. "total (cpu)" is the process CPU time of the same region,
less sensitive to other load on a shared machine than the wall-clock columns.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from elastic.setup.config import StragglerConfig  # noqa: E402
from elastic.core.data_plan import DataCursor, epoch_order, group_weights, plan_step  # noqa: E402
from elastic.core.events import EventKind, EventLog  # noqa: E402
from elastic.core.membership import Built, Membership, Placed, Started  # noqa: E402
from elastic.core.straggler_mitigation import StragglerMitigation  # noqa: E402
from elastic.core.topology import Topology  # noqa: E402

COMPONENTS = ("quorum", "data_plan", "stragglers")


def summarize(samples: list[float]) -> tuple[float, float, float, float]:
    ms = np.asarray(samples) * 1e3
    return float(ms.mean()), float(np.percentile(ms, 50)), float(np.percentile(ms, 99)), float(ms.max())


def rejoin(membership: Membership, groups: list[int]) -> None:
    """The cluster's side of a group's way back: placed, started, built, then joined."""
    for group in groups:
        for change in (Placed(), Started(), Built()):
            membership.apply(group, change)
    membership.join(groups)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--ray" in argv:
        import null_ranks

        return null_ranks.main([arg for arg in argv if arg != "--ray"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2048)
    parser.add_argument("--ranks-per-group", type=int, default=8)
    parser.add_argument("--shard", type=int, default=2, help="FSDP shard positions per group (tp = ranks/shard)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--global-batch", type=int, default=32768)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--dataset-len", type=int, default=10_000_000)
    parser.add_argument("--spare-slots", type=int, default=1)
    parser.add_argument("--min-groups", type=int, default=1)
    parser.add_argument("--churn-every", type=int, default=50, help="evict + rejoin a rank every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-ms", type=float, default=5.0)
    parser.add_argument(
        "--gc-freeze", action="store_true",
        help="gc.collect() + gc.freeze() after setup, so full collections skip the epoch order",
    )
    args = parser.parse_args(argv)
    if args.ranks_per_group % args.shard:
        parser.error("--ranks-per-group must be a multiple of --shard")
    shard, tp = args.shard, args.ranks_per_group // args.shard
    rpg, n_groups = args.ranks_per_group, args.groups
    n_ranks = rpg * n_groups
    rng = np.random.default_rng(args.seed)

    # ---- one-off setup
    t0 = time.perf_counter()
    membership = Membership(Topology(shard, tp, n_groups))
    rejoin(membership, [membership.add_group() for _ in range(n_groups)])
    membership_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    epoch_order(args.dataset_len, args.seed, 0)
    epoch_s = time.perf_counter() - t0
    gc_s = 0.0
    if args.gc_freeze:
        # The epoch order is a tuple of dataset_len ints: until a full collection has
        # visited it, every gen-2 collection walks it (~1 s at 10M, then ~0.2 s each).
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        gc_s = time.perf_counter() - t0

    clock = time.monotonic
    events = EventLog(clock)
    stragglers = StragglerMitigation(StragglerConfig(), args.global_batch, events, clock=clock)
    cursor = DataCursor()
    base = rng.uniform(0.009, 0.011, n_ranks)  # each rank's own speed, seconds per sample
    fixed_by_group = rng.uniform(0.02, 0.03, n_groups)  # per-step overhead per group (data, update)
    slow_rank = int(rng.integers(n_ranks))
    slow_factor = 1.6
    pending_rejoin: list[int] = []  # groups whose replaced rank rejoins next step

    times = {name: [] for name in COMPONENTS}
    totals, cpu_totals = [], []
    churns = 0
    generations = {membership.generation}

    for step in range(args.steps):
        # ---- untimed: the cluster's side (replacements finish healing, faults happen, workers report)
        rejoin(membership, sorted(set(pending_rejoin)))
        pending_rejoin = []
        if args.churn_every and step and step % args.churn_every == 0:
            victim = int(rng.integers(n_ranks))
            if membership.topology.group_of(victim) in membership.live_groups():
                pending_rejoin.append(membership.lose_rank(victim))
                stragglers.forget(victim)
                churns += 1
        live_now = np.array(membership.live_groups(), dtype=np.int64)
        present = (live_now[:, None] * rpg + np.arange(rpg)[None, :]).ravel()
        speed = base[present] * rng.uniform(0.9, 1.1, len(present))
        if step >= 20:
            speed[present == slow_rank] *= slow_factor

        # ---- timed: the driver's decisions for this step
        c0 = time.process_time()
        t0 = time.perf_counter()
        quorum = membership.quorum()
        weights = group_weights(quorum.groups, stragglers.weights)
        t1 = time.perf_counter()
        plan = plan_step(
            step, cursor, dataset_len=args.dataset_len, global_batch=args.global_batch, seed=args.seed,
            group_weights=weights,
        )
        cursor = plan.next_cursor
        t2 = time.perf_counter()
        cpu_plan = time.process_time() - c0

        # ---- untimed: the workers run the plan and report their timings
        samples = plan.groups.samples()
        group_samples = np.fromiter(samples.values(), np.float64, len(samples))  # live_now's order
        compute_s = speed * np.repeat(group_samples, rpg)
        step_s = float(np.max(fixed_by_group[live_now] + compute_s.reshape(-1, rpg).max(axis=1)))

        # ---- timed: straggler handling, applied to the membership and the weights
        c0 = time.process_time()
        t3 = time.perf_counter()
        actions = stragglers.on_step_arrays(
            step, present, present // rpg, samples=np.repeat(group_samples, rpg), compute_s=compute_s,
            fixed_s=fixed_by_group[present // rpg], step_s=step_s, spare_slot=args.spare_slots > 0,
            min_groups=args.min_groups,
        )
        for rank in actions.replace:
            pending_rejoin.append(membership.lose_rank(rank))
            stragglers.forget(rank)
            if rank == slow_rank:
                slow_factor = 1.0  # the replacement runs at normal speed
        for group in actions.evict_groups:
            membership.remove_group(group)
            for rank in membership.topology.global_ranks(group):
                stragglers.forget(rank)
        t4 = time.perf_counter()
        cpu_totals.append(cpu_plan + time.process_time() - c0)

        generations.add(quorum.generation)
        for name, dt in zip(COMPONENTS, (t1 - t0, t2 - t1, t4 - t3)):
            times[name].append(dt)
        totals.append(t2 - t0 + t4 - t3)

    print(
        f"control plane: {n_groups} groups x {rpg} ranks (shard {shard} x tp {tp}) = {n_ranks} ranks, "
        f"{args.steps} steps, global_batch {args.global_batch}, micro_batch {args.micro_batch}, "
        f"dataset {args.dataset_len:,}"
    )
    print(
        f"one-off setup: epoch permutation {epoch_s * 1e3:.0f} ms, membership {membership_s * 1e3:.1f} ms"
        + (f", gc collect+freeze {gc_s * 1e3:.0f} ms" if args.gc_freeze else ", gc not frozen")
    )
    print(f"{'component':<12}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'max ms':>10}")
    for name in COMPONENTS:
        print(f"{name:<12}" + "".join(f"{v:>10.3f}" for v in summarize(times[name])))
    print(f"{'total':<12}" + "".join(f"{v:>10.3f}" for v in summarize(totals)))
    print(f"{'total (cpu)':<12}" + "".join(f"{v:>10.3f}" for v in summarize(cpu_totals)))
    stragglers.close()
    decisions = Counter(event["action"] for event in events.of_kind(EventKind.STRAGGLER_MITIGATED))
    print(
        f"events: flags {len(events.of_kind(EventKind.STRAGGLER_DETECTED))}, "
        f"recoveries {len(events.of_kind(EventKind.STRAGGLER_RECOVERED))}, churn evictions {churns}, "
        f"decisions {dict(decisions) or '{}'}, generations seen {len(generations)} "
        f"(final {membership.generation})"
    )
    mean_ms = summarize(totals)[0]
    verdict = "PASS" if mean_ms < args.target_ms else "FAIL"
    print(f"per-step decision cost: {mean_ms:.3f} ms mean vs target {args.target_ms:g} ms: {verdict}")
    worst = max(COMPONENTS, key=lambda name: np.mean(times[name]))
    print(f"largest component: {worst} ({summarize(times[worst])[0]:.3f} ms mean)")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())

"""What a run on thousands of GPUs would see: failures drawn at Llama 3's published rates
(``elastic/simulation/failure_mix.py`` names every source) over simulated days, replayed
against this product (its real diagnosis, recovery plan and spare choice), restart-the-world
and group restart (``elastic/simulation/designs.py``), each with its own costs, every one a
named figure, measured or assumed. No GPU and no Ray: the control plane is pure code on a
simulated clock. ``docs/at-scale.md`` states the model's assumptions.

Prints, for Llama 3 8B, 70B and 405B at 1 k to about 100 k GPUs, each design's effective
training time ratio (ETTR: the wall time's share spent training work that was kept), with
spares provisioned; how many spare GPUs keep ours above the target at 16 k GPUs; and the
driver's own CPU per step and per failure at each size, timed on the real decision code,
against the step time. ``--plot FILE`` draws ETTR against the fleet's size.

    python bench/at_scale.py                       # 30 simulated days, 3 traces per point
    python bench/at_scale.py --cost node_replacement_s=14400 --cost heal_bandwidth=5e9
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.simulation.designs import MODELS, Costs, Design, Job, cost_lines, replay  # noqa: E402
from elastic.simulation.driver_cost import driver_cost  # noqa: E402
from elastic.simulation.failure_mix import GPUS_PER_NODE, draw_failures, rates_per_gpu_hour  # noqa: E402

FLEETS = (1024, 4096, 16_384, 98_304)
DAY_S = 86_400.0


def ettr(job: Job, design: Design, days: float, spare_gpus: int, traces: int, costs: Costs) -> float:
    """The mean ETTR over ``traces`` failure traces, the same traces for every design."""
    wall_s = days * DAY_S
    return statistics.mean(
        replay(job, draw_failures(job.gpus, wall_s, seed), design, wall_s, spare_gpus, costs, seed=seed).ettr
        for seed in range(traces))


def costs_from(settings: list[str]) -> Costs:
    """``Costs`` with each ``NAME=VALUE`` of ``--cost`` in place of its figure."""
    values = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in Costs.__dataclass_fields__ or not value:
            raise SystemExit(f"--cost {setting!r}: give NAME=VALUE, NAME one of {', '.join(Costs.__dataclass_fields__)}")
        values[name] = type(getattr(Costs(), name))(float(value))
    return Costs(**values)


def provisioned_spares(job: Job) -> int:
    """Spares for the table: two nodes' worth, and one group's nodes' worth at most 64 GPUs."""
    return max(2 * GPUS_PER_NODE, min(job.model.group_gpus, 64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--traces", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.97, help="the ETTR to provision spares for")
    parser.add_argument("--plot", type=Path, help="write ETTR against the fleet's size here (PNG)")
    parser.add_argument("--cost", action="append", default=[], metavar="NAME=VALUE",
                        help="replace one of the figures (see the costs printed), e.g. node_replacement_s=14400")
    args = parser.parse_args()
    costs = costs_from(args.cost)

    rates = rates_per_gpu_hour()
    print("failures per GPU-hour (Llama 3's 419 interruptions in 54 days on 16,384 GPUs, a slow GPU assumed): "
          + ", ".join(f"{kind} {rate:.2e}" for kind, rate in rates.items()))
    print("costs:\n  " + "\n  ".join(cost_lines(costs)))
    print(f"\nETTR over {args.days:g} simulated days, mean of {args.traces} traces; spares provisioned for every "
          "design (whole nodes; ours keeps them warm):")
    print(f"{'model':<12} {'GPUs':>7} {'groups':>7} {'step s':>7} {'failures':>9} {'spares':>7} "
          + " ".join(f"{design.value:>18}" for design in Design))
    curves: dict[tuple[str, Design], list[tuple[int, float]]] = {}
    for key, model in MODELS.items():
        for gpus in FLEETS:
            job = Job(model, gpus)
            spares = provisioned_spares(job)
            failures = len(draw_failures(gpus, args.days * DAY_S, 0))
            row = {design: ettr(job, design, args.days, spares, args.traces, costs) for design in Design}
            for design, value in row.items():
                curves.setdefault((model.name, design), []).append((gpus, value))
            print(f"{model.name:<12} {gpus:>7} {job.groups:>7} {job.step_s:7.2f} {failures:>9} {spares:>7} "
                  + " ".join(f"{100 * value:17.2f}%" for value in row.values()))

    print(f"\nours at 16,384 GPUs: the fewest spare GPUs for ETTR >= {100 * args.target:g} %")
    for key in ("70b", "405b"):
        job = Job(MODELS[key], 16_384)
        found = None
        for spares in (0, 8, 16, 32, 64, 128):
            value = ettr(job, Design.OURS, args.days, spares, args.traces, costs)
            print(f"  {job.model.name}: {spares:>4} spare GPUs -> {100 * value:.3f} %")
            if value >= args.target and found is None:
                found = spares
        print(f"  {job.model.name}: {found if found is not None else 'more than 128'} spare GPUs reach the target")

    print("\nthe driver's CPU, timed on the real decision code (best of 3):")
    print(f"{'GPUs':>7} {'per step ms':>12} {'405B step s':>12} {'share of step':>14} {'per failure ms':>15} "
          f"{'re-pair ms':>11}")
    for gpus in FLEETS:
        job = Job(MODELS["405b"], gpus)
        cost = driver_cost(job)
        print(f"{cost.gpus:>7} {1000 * cost.step_observe_s:12.2f} {job.step_s:12.2f} "
              f"{cost.step_observe_s / job.step_s:14.2%} {1000 * cost.failure_decision_s:15.3f} {1000 * cost.buddies_s:11.3f}")

    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4), sharey=True)
        for axis, model in zip(axes, MODELS.values()):
            for design in Design:
                points = curves[(model.name, design)]
                axis.plot([gpus for gpus, _ in points], [100 * value for _, value in points], marker="o",
                          label=design.value)
            axis.set_xscale("log")
            axis.set_title(model.name)
            axis.set_xlabel("GPUs")
        axes[0].set_ylabel("ETTR %")
        axes[0].legend()
        figure.tight_layout()
        figure.savefig(args.plot)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()

"""What a run on thousands of GPUs would see: failures drawn from published rates
(``elastic/simulation/failure_mix.py`` names every source) over simulated days, replayed
against this product as it runs today (its real step deadline, diagnosis, recovery plan, spare
choice and straggler detector), restart-the-world and group restart
(``elastic/simulation/designs.py``), every cost a named figure with its source
(``elastic/simulation/costs.py``). No GPU and no Ray: the control plane is pure code on a
simulated clock. ``docs/at-scale.md`` states the model's assumptions.

Three runs:

- ``--calibrate``: the model with each publication's own parameters, published figure against
  modelled (Llama 3, ByteRobust, FT-HSDP, Kokolis et al.).
- the default: ETTR (the wall time's share spent training work that was kept) of each design
  for Llama 3 8B, 70B and 405B at 1 k to ~100 k GPUs, the workloads that fit (at least one
  sequence per data-parallel rank), p5/p50/p95 over the traces; and the driver's own CPU per
  step and per failure, timed on the real decision code.
- ``--pessimistic``: the same with every cost at its worst published value, and how many spare
  GPUs ours takes at 16,384 GPUs.

``--json OUT`` writes the run's rows: ``{"source", "published", "modelled", ...}`` for the
calibration, ``{"model", "gpus", "design", "ettr", "p5", "p50", "p95"}`` otherwise.

    python bench/at_scale.py --calibrate --json calibration.json
    python bench/at_scale.py --pessimistic --json pessimistic.json --full   # 20 traces per point
    python bench/at_scale.py --cost node_replacement_s=14400 --cost heal_bandwidth=5e9
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.simulation.calibration import GOAL, calibrate  # noqa: E402
from elastic.simulation.costs import (  # noqa: E402
    DEFAULT,
    PESSIMISTIC,
    PESSIMISTIC_FAILURE_SOURCES,
    PESSIMISTIC_FAILURES,
    PESSIMISTIC_SOURCES,
    SOURCES,
    Costs,
    cost_lines,
)
from elastic.simulation.designs import MODELS, Design, Job, replay, straggler_detection_steps  # noqa: E402
from elastic.simulation.driver_cost import driver_cost  # noqa: E402
from elastic.simulation.failure_mix import (  # noqa: E402
    DAY_S,
    GPUS_PER_NODE,
    FailureModel,
    draw_failures,
    model_lines,
    rates_per_gpu_hour,
)
from elastic.simulation.failure_mix import SOURCES as FAILURE_SOURCES  # noqa: E402

FLEETS = (1024, 4096, 16_384, 98_304)
FULL_TRACES = 20


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))]


def ettrs(job: Job, design: Design, days: float, spare_gpus: int, traces: int, costs: Costs,
          failures: FailureModel) -> list[float]:
    """ETTR over each of ``traces`` failure traces, the same traces for every design."""
    wall_s = days * DAY_S
    return [replay(job, draw_failures(job.gpus, wall_s, seed, failures), design, wall_s, spare_gpus, costs,
                   seed=seed).ettr for seed in range(traces)]


def costs_from(base: Costs, settings: list[str]) -> Costs:
    """``base`` with each ``NAME=VALUE`` of ``--cost`` in place of its figure."""
    values = {}
    for setting in settings:
        name, _, value = setting.partition("=")
        if name not in Costs.__dataclass_fields__ or not value:
            raise SystemExit(f"--cost {setting!r}: give NAME=VALUE, NAME one of {', '.join(Costs.__dataclass_fields__)}")
        values[name] = type(getattr(base, name))(float(value))
    return replace(base, **values)


def provisioned_spares(job: Job) -> int:
    """Spares for the table: two nodes' worth, and one group's nodes' worth at most 64 GPUs."""
    return max(2 * GPUS_PER_NODE, min(job.model.group_gpus, 64))


def fitting_jobs() -> list[Job]:
    return [job for model in MODELS.values() for job in (Job(model, gpus) for gpus in FLEETS) if job.fits]


def run_calibration(traces: int) -> list[dict]:
    rows = calibrate(traces)
    print(f"calibration: the model with each publication's parameters ({traces} traces; goal within "
          f"{100 * GOAL:g} points)\n")
    for row in rows:
        verdict = "goal met" if row.meets_goal else f"gap of {100 * abs(row.published - row.modelled):.1f} points"
        print(f"{row.source}\n  published {'> ' if row.bound else ''}{100 * row.published:.1f} %, modelled "
              f"{100 * row.modelled:.1f} %: {verdict}\n  parameters: {row.parameters}"
              + (f"\n  the gap: {row.gap}" if row.gap else ""))
    return [row.as_json() for row in rows]


def run_table(costs: Costs, failures: FailureModel, days: float, traces: int) -> tuple[list[dict], dict]:
    print(f"\nETTR over {days:g} simulated days, p50 [p5-p95] of {traces} traces; spares provisioned for every "
          "design (whole nodes; ours keeps them warm); only the workloads with a sequence per data-parallel rank:")
    print(f"{'model':<12} {'GPUs':>7} {'groups':>7} {'step s':>7} {'failures':>9} {'spares':>7} "
          + " ".join(f"{design.value:>24}" for design in Design))
    rows, curves = [], {}
    for job in fitting_jobs():
        spares = provisioned_spares(job)
        drawn = len(draw_failures(job.gpus, days * DAY_S, 0, failures))
        cells = []
        for design in Design:
            values = ettrs(job, design, days, spares, traces, costs, failures)
            p5, p50, p95 = (percentile(values, share) for share in (0.05, 0.5, 0.95))
            rows.append({"model": job.model.name, "gpus": job.gpus, "design": design.value,
                         "ettr": round(statistics.mean(values), 5), "p5": round(p5, 5), "p50": round(p50, 5),
                         "p95": round(p95, 5)})
            curves.setdefault((job.model.name, design), []).append((job.gpus, p50))
            cells.append(f"{100 * p50:6.2f}% [{100 * p5:6.2f}-{100 * p95:6.2f}]")
        print(f"{job.model.name:<12} {job.gpus:>7} {job.groups:>7} {job.step_s():7.2f} {drawn:>9} {spares:>7} "
              + " ".join(f"{cell:>24}" for cell in cells))
    return rows, curves


def spares_for_target(costs: Costs, failures: FailureModel, days: float, traces: int, target: float) -> None:
    print(f"\nours at 16,384 GPUs: the fewest spare GPUs for a p5 ETTR >= {100 * target:g} %")
    for job in (job for job in fitting_jobs() if job.gpus == 16_384):
        found = None
        for spares in (0, 64, 128, 256, 512, 1024):
            values = ettrs(job, Design.OURS, days, spares, traces, costs, failures)
            p5 = percentile(values, 0.05)
            print(f"  {job.model.name}: {spares:>5} spare GPUs -> p5 {100 * p5:.2f} %, "
                  f"p50 {100 * percentile(values, 0.5):.2f} %")
            if p5 >= target:
                found = spares
                break
        print(f"  {job.model.name}: {found if found is not None else 'more than 1024'} spare GPUs reach the target")


def print_driver_cost() -> None:
    print("\nthe driver's CPU, timed on the real decision code (best of 3):")
    print(f"{'GPUs':>7} {'per step ms':>12} {'405B step s':>12} {'share of step':>14} {'per failure ms':>15} "
          f"{'re-pair ms':>11}")
    for gpus in FLEETS:
        job = Job(MODELS["405b"], gpus)
        cost = driver_cost(job)
        print(f"{cost.gpus:>7} {1000 * cost.step_observe_s:12.2f} {job.step_s():12.2f} "
              f"{cost.step_observe_s / job.step_s():14.2%} {1000 * cost.failure_decision_s:15.3f} "
              f"{1000 * cost.buddies_s:11.3f}")


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(MODELS), figsize=(5 * len(MODELS), 4), sharey=True)
    for axis, model in zip(axes, MODELS.values()):
        for design in Design:
            points = curves.get((model.name, design), [])
            axis.plot([gpus for gpus, _ in points], [100 * value for _, value in points], marker="o",
                      label=design.value)
        axis.set_xscale("log")
        axis.set_title(model.name)
        axis.set_xlabel("GPUs")
    axes[0].set_ylabel("ETTR % (p50)")
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(path)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--calibrate", action="store_true", help="the model with each publication's own parameters")
    mode.add_argument("--pessimistic", action="store_true", help="every cost at its worst published value")
    parser.add_argument("--json", type=Path, help="write the run's rows here")
    parser.add_argument("--days", type=float, default=30.0)
    parser.add_argument("--traces", type=int, default=5)
    parser.add_argument("--full", action="store_true", help=f"{FULL_TRACES} traces per point")
    parser.add_argument("--target", type=float, default=0.97, help="the ETTR to provision ours' spares for")
    parser.add_argument("--plot", type=Path, help="write ETTR against the fleet's size here (PNG)")
    parser.add_argument("--cost", action="append", default=[], metavar="NAME=VALUE",
                        help="replace one of the figures (see the costs printed), e.g. node_replacement_s=14400")
    args = parser.parse_args()
    traces = FULL_TRACES if args.full else args.traces

    if args.calibrate:
        rows = run_calibration(traces)
    else:
        base = PESSIMISTIC if args.pessimistic else DEFAULT
        costs = costs_from(base, args.cost)
        failures = PESSIMISTIC_FAILURES if args.pessimistic else FailureModel()
        sources = PESSIMISTIC_SOURCES if args.pessimistic else SOURCES
        print(f"{'pessimistic' if args.pessimistic else 'default'} column; failures per GPU-hour: "
              + ", ".join(f"{kind} {rate:.2e}" for kind, rate in rates_per_gpu_hour(failures).items()))
        print("failures:\n  " + "\n  ".join(model_lines(
            failures, PESSIMISTIC_FAILURE_SOURCES if args.pessimistic else FAILURE_SOURCES)))
        print("costs:\n  " + "\n  ".join(cost_lines(costs, sources, base)))
        print(f"straggler detection, every design: {straggler_detection_steps(costs.slowdown)} steps at "
              f"{costs.slowdown:g}x (StragglerDetector's defaults)")
        rows, curves = run_table(costs, failures, args.days, traces)
        if args.pessimistic:
            spares_for_target(costs, failures, args.days, traces, args.target)
        else:
            print_driver_cost()
        if args.plot:
            plot(curves, args.plot)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"\nrows: {args.json}")


if __name__ == "__main__":
    main()

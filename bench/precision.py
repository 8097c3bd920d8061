"""fp16 with its dynamic loss scale against bf16, on the reference job: the README's
``elastic train`` (the embedded default config), once per ``compute.precision``, on a local Ray.

Each run's committed losses, step by step, against fp32's: the largest and the mean relative
difference over the run, and the last step's; the steps fp16 discarded for an overflow and
the scale it ended at. On CPU ranks the matmuls of bf16 and fp16 round their inputs and
outputs to the format, so the differences are the formats' own, the same arithmetic a GPU
does in them.

    python bench/precision.py                  # the default job, 60 steps
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.setup.preflight import build_config  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16")


def run(storage: Path, precision: str, steps: int) -> dict:
    from elastic import ElasticTrainer

    config = build_config({"storage": str(storage), "run_name": precision, "steps": steps,
                           "compute": {"precision": precision}})
    result = ElasticTrainer(config).fit()
    if not result.ok:
        raise SystemExit(f"the {precision} run failed: {result.exit}")
    overflows = [event for event in result.summary["events"] if event.get("overflow")]
    return {"losses": result.losses, "overflows": len(overflows)}


def relative(losses: list[float], reference: list[float]) -> list[float]:
    return [abs(loss - ref) / abs(ref) for loss, ref in zip(losses, reference, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    from elastic.fleet.ray_connection import start_local_ray

    start_local_ray(log_to_driver=False)
    with tempfile.TemporaryDirectory() as directory:
        runs = {precision: run(Path(directory), precision, args.steps) for precision in PRECISIONS}
    reference = runs["fp32"]["losses"]
    print(f"the default job, {args.steps} steps: each precision's committed losses against fp32's")
    print(f"{'precision':<10} {'first loss':>10} {'last loss':>10} {'max rel':>9} {'mean rel':>9} {'last rel':>9} "
          f"{'overflows':>10}")
    for precision, result in runs.items():
        differences = relative(result["losses"], reference)
        print(f"{precision:<10} {result['losses'][0]:10.4f} {result['losses'][-1]:10.4f} {max(differences):9.2e} "
              f"{statistics.mean(differences):9.2e} {differences[-1]:9.2e} {result['overflows']:10d}")
    between = relative(runs["fp16"]["losses"], runs["bf16"]["losses"])
    print(f"fp16 against bf16: max rel {max(between):.2e}, mean rel {statistics.mean(between):.2e}")


if __name__ == "__main__":
    main()

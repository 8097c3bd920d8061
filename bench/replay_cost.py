"""What the spot checks that find silent errors in compute cost (``integrity.replay_every``,
``elastic.core.compute_replay``), and whether they ever cry wolf: the reference job (the
README's ``elastic train``: the default model and generated corpus) at 3 replica groups of one
rank, on a local Ray, the same steps three times in one run of this script:

- **cost**: committed tokens a second of step time without spot checks, and with them at the
  default interval (goal: at most 2 % fewer);
- **false positives**: with a spot check at every step, the replays that did not reproduce a
  group's work (``silent-corruption-found`` events) on a healthy machine (goal: none).

    python bench/replay_cost.py                 # 1000 steps each
    python bench/replay_cost.py --steps 300     # a quicker look
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.setup.config import IntegrityConfig  # noqa: E402
from elastic.setup.preflight import build_config  # noqa: E402

GROUPS = 3


def train(storage: Path, name: str, steps: int, replay_every: int) -> dict:
    from elastic import ElasticTrainer

    config = build_config({
        "storage": str(storage), "run_name": name, "steps": steps,
        "scaling": {"min_groups": GROUPS, "max_groups": GROUPS, "shard": 1, "tp": 1},
        "checkpoint": {"every": 0}, "integrity": {"replay_every": replay_every},
    })
    result = ElasticTrainer(config).fit()
    if not result.ok:
        raise SystemExit(f"the {name} run failed: {result.exit}")
    records, events = result.summary["steps"], result.summary["events"]
    step_s = sum(record["step_s"] for record in records)
    return {
        "tokens_per_s": sum(record["tokens_per_s"] * record["step_s"] for record in records) / step_s,
        "replayed": sum(event["kind"] == "step-replayed" for event in events),
        "false_positives": sum(event["kind"] == "silent-corruption-found" for event in events),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    default = IntegrityConfig.model_fields["replay_every"].default
    from elastic.fleet.ray_connection import start_local_ray

    start_local_ray(log_to_driver=False)
    with tempfile.TemporaryDirectory() as directory:
        storage = Path(directory)
        runs = {every: train(storage, f"replay-every-{every}", args.steps, every) for every in (0, default, 1)}
    base = runs[0]["tokens_per_s"]
    print(f"\nthe reference job at {GROUPS} groups x 1 rank, {args.steps} steps each")
    print(f"{'replay_every':<14} {'tokens/s':>10} {'cost':>8} {'replayed':>9} {'false positives':>16}")
    for every, run in runs.items():
        cost = 1 - run["tokens_per_s"] / base
        print(f"{every or 'off':<14} {run['tokens_per_s']:10.0f} {cost:8.2%} {run['replayed']:9d} "
              f"{run['false_positives']:16d}")


if __name__ == "__main__":
    main()

"""Semi-synchronous training (``sync.mode = "diloco"``) against every step's sum, on the
reference job (the README's ``elastic train``: the default model and generated corpus) at 4
replica groups of one rank, on a local Ray, all in one run of this script:

- **bytes**: what the ranks handed the cross-group sums per committed step (``cross_group_bytes``
  in ``summary.json``: every step's gradients and row; or each step's row and a round's
  pseudo-gradients), diloco's over every-step's (goal: at most 1/H);
- **loss at equal tokens**: the held-out loss (the validation split's first samples) after the
  same steps of the same global batch, diloco's relative to every-step's (goal: within 2 % at
  H = 50);
- **throttled**: the same job with each group's link to the others throttled (the ``slow-link``
  fault) to 1/100 of the in-group link's speed, which the script measures first (a gloo
  all-reduce of 16 MB between two processes on loopback, as the ranks of a group sum): tokens
  a second of committed step time, diloco's over every-step's (goal: at least 10x). The full
  run measures it at a quarter of the global batch too: a quarter of the compute a step, the
  same bytes, as a faster device would leave the link a larger share of the step.

The exchange's precisions: fp32 and bf16 values, fp8 and int4 codes with a scale every 64
values (goal with int4: at most 1/(4H) of every-step's bytes). Streaming DiLoCo (``STREAMING``:
4 fragments, each turn's exchange crossing during the next inner step and merged after it, each
learner keeping half its own weights, as the paper's overlapped runs): a step's outer exchange is
one fragment's, but for every fourth round's last, which syncs all four at once and waits for
them; the table gives the largest a step hands beside the mean, and the share of the exchanges'
seconds the steps did not wait for (**hidden**, goal: at least 90 %; the throttled run's too).

    python bench/semi_sync.py                 # 1200 steps, H = 10, 50, 100, fragments 1 and 4, each precision
    python bench/semi_sync.py --quick --json OUT   # 1000 steps, H = 50, fp32 and int4, fragments 1 and 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.setup.preflight import build_config  # noqa: E402

GROUPS = 4
STREAMING = {"fragments": 4, "sync_delay": 1, "fragment_alpha": 0.5}
THROTTLE = 100  # the cross-group link is this many times slower than the in-group one
PROBE_BYTES = 16 * 2**20


def in_group_bytes_per_s() -> float:
    """A gloo all-reduce's payload speed between two processes on loopback, the best of 5."""
    from elastic.testing.gloo_ranks import all_reduce_seconds, gloo_ranks

    with tempfile.TemporaryDirectory() as directory:
        times = gloo_ranks(all_reduce_seconds, 2, str(Path(directory) / "init"), PROBE_BYTES, 5)
    return PROBE_BYTES / min(times[0])


def config(storage: Path, name: str, steps: int, sync: dict, inject: str = "", global_batch: int = 32) -> object:
    return build_config({
        "storage": str(storage), "run_name": name, "steps": steps,
        "global_batch": global_batch, "micro_batch": min(4, global_batch // GROUPS),
        "scaling": {"min_groups": GROUPS, "max_groups": GROUPS, "shard": 1, "tp": 1},
        "data": {"validation_fraction": 0.05}, "eval": {"every": steps, "samples": 256},
        "checkpoint": {"every": 0}, "fault_tolerance": {"inject": inject}, "sync": sync,
    })


def train(storage: Path, name: str, steps: int, sync: dict, inject: str = "", global_batch: int = 32) -> dict:
    from elastic import ElasticTrainer

    result = ElasticTrainer(config(storage, name, steps, sync, inject, global_batch)).fit()
    if not result.ok:
        raise SystemExit(f"the {name} run failed: {result.exit}")
    summary = result.summary
    records = summary["steps"]
    evaluated = [event["loss"] for event in summary["events"] if event["kind"] == "evaluated"]
    step_s = sum(record["step_s"] for record in records)
    return {
        "held_out_loss": evaluated[-1],
        "bytes_per_step": statistics.fmean(record["cross_group_bytes"] for record in records),
        "peak_bytes": max(record["cross_group_bytes"] for record in records),
        "tokens_per_s": sum(record["tokens_per_s"] * record["step_s"] for record in records) / step_s,
        "hidden": hidden_share(records),
        "outer_rounds": sum(record["outer_step"] for record in records),
    }


def hidden_share(records: list[dict]) -> float | None:
    """The share of the outer exchanges' seconds that no step waited for (None: no exchange)."""
    exchanged = sum(record["outer_sum_s"] for record in records)
    return 1 - sum(record["outer_sum_exposed_s"] for record in records) / exchanged if exchanged else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="H = 50, fp32 and int4 only, 1000 steps")
    parser.add_argument("--steps", type=int, help="steps of each untrottled run (a whole number of H x 4 each)")
    parser.add_argument("--throttled-steps", type=int, default=40, help="steps of each throttled run (rounded to whole periods of streaming's alignment)")
    parser.add_argument("--json", type=Path, help="write the headline figures here")
    args = parser.parse_args()
    steps = args.steps or (1000 if args.quick else 1200)
    every = (50,) if args.quick else (10, 50, 100)
    precisions = ("fp32", "int4") if args.quick else ("fp32", "bf16", "fp8", "int4")
    from elastic.fleet.ray_connection import start_local_ray

    link = in_group_bytes_per_s()
    rate = link / THROTTLE
    print(f"in-group link (gloo all-reduce on loopback, 16 MB): {link / 1e6:.0f} MB/s; throttled cross-group link "
          f"1/{THROTTLE} of it: {rate / 1e6:.1f} MB/s")
    start_local_ray(log_to_driver=False)
    throttle = ";".join(f"slow-link:group={group},step=0,rate={rate:.0f}" for group in range(GROUPS))
    with tempfile.TemporaryDirectory() as directory:
        storage = Path(directory)
        baseline = train(storage, "every-step", steps, {"mode": "every-step"})
        runs = {(h, fragments, precision): train(storage, f"diloco-h{h}-f{fragments}-{precision}", steps,
                                                 {"mode": "diloco", "outer_every": h, "precision": precision,
                                                  **(STREAMING if fragments > 1 else {})})
                for h in every for fragments in (1, STREAMING["fragments"]) for precision in precisions}
        headline_every = 50
        period = headline_every * STREAMING["fragments"]  # where streaming's learners align
        throttled_steps = max(args.throttled_steps // period, 1) * period
        batches = (32,) if args.quick else (32, 8)
        modes = {"every-step": {"mode": "every-step"}, "diloco": {"mode": "diloco", "outer_every": headline_every},
                 "streaming": {"mode": "diloco", "outer_every": headline_every, **STREAMING}}
        throttled = {(batch, mode): train(storage, f"throttled-{batch}-{mode}", throttled_steps, sync, throttle, batch)
                     for batch in batches for mode, sync in modes.items()}
    print(f"\nthe reference job at {GROUPS} groups x 1 rank, {steps} steps of {config(Path('.'), 'x', steps, {}).global_batch}"
          f" samples; held-out loss after the last step")
    print(f"{'sync':<26} {'bytes/step':>12} {'ratio':>8} {'x H':>6} {'peak':>10} {'held-out':>9} {'gap':>8} "
          f"{'outer':>6} {'hidden':>7}")
    print(f"{'every-step':<26} {baseline['bytes_per_step']:12.0f} {1:8.4f} {'':>6} {baseline['peak_bytes']:10.0f} "
          f"{baseline['held_out_loss']:9.4f} {0:8.2%} {'':>6}")
    figures = {}
    for (h, fragments, precision), run in runs.items():
        ratio = run["bytes_per_step"] / baseline["bytes_per_step"]
        gap = (run["held_out_loss"] - baseline["held_out_loss"]) / baseline["held_out_loss"]
        figures[(h, fragments, precision)] = (ratio, gap, run["peak_bytes"] / baseline["peak_bytes"])
        print(f"{f'diloco H={h} F={fragments} {precision}':<26} {run['bytes_per_step']:12.0f} {ratio:8.4f} "
              f"{ratio * h:6.2f} {run['peak_bytes']:10.0f} {run['held_out_loss']:9.4f} {gap:8.2%} "
              f"{run['outer_rounds']:6d} {run['hidden'] or 0:7.1%}")
    print(f"\nthrottled to {rate / 1e6:.1f} MB/s across groups, {throttled_steps} steps, H={headline_every}:")
    speedups = {}
    for batch in batches:
        every_step, diloco, streaming = (throttled[(batch, mode)] for mode in modes)
        speedups[batch] = (diloco["tokens_per_s"] / every_step["tokens_per_s"],
                           streaming["tokens_per_s"] / every_step["tokens_per_s"])
        print(f"  global batch {batch}: every-step {every_step['tokens_per_s']:.0f} tokens/s, diloco "
              f"{diloco['tokens_per_s']:.0f} tokens/s: {speedups[batch][0]:.1f}x; streaming "
              f"{streaming['tokens_per_s']:.0f} tokens/s: {speedups[batch][1]:.1f}x, its exchanges "
              f"{streaming['hidden']:.1%} hidden")
    speedup, streaming_speedup = speedups[32]
    ratio, gap, _ = figures[(headline_every, 1, "fp32")]
    int4_ratio, int4_gap, _ = figures[(headline_every, 1, "int4")]
    fragments_ratio, fragments_gap, _ = figures[(headline_every, 4, "fp32")]
    if args.json:
        args.json.write_text(json.dumps({"outer_every": headline_every, "bytes_ratio": ratio, "loss_gap": gap,
                                         "int4_bytes_ratio": int4_ratio, "int4_loss_gap": int4_gap,
                                         "fragments": 4, "fragments_bytes_ratio": fragments_ratio,
                                         "fragments_loss_gap": fragments_gap,
                                         "fragments_hidden": runs[(headline_every, 4, "fp32")]["hidden"],
                                         "throttled_speedup": speedup, "throttled_streaming_speedup": streaming_speedup,
                                         "throttled_streaming_hidden": throttled[(32, "streaming")]["hidden"],
                                         "steps": steps,
                                         "in_group_bytes_per_s": link, "cross_group_bytes_per_s": rate}, indent=1))


if __name__ == "__main__":
    main()

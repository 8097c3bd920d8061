"""The driver SIGKILLed at random moments of a run, each followed by the same command, as a
retrying submitter (``ray job submit`` again, a RayJob's ``backoffLimit``) would: what one lost
driver costs the run.

A Ray head of its own (``ray start --head`` on loopback, ``elastic.testing.ray_head``) outlives
the drivers. The job is the README's reference job at 2 replica groups of one rank, checkpoints
every ``--checkpoint-every`` steps; each driver serves its metrics on loopback, which the
bench polls every 50 ms for ``elastic_step`` (the next step to commit). For each kill, at a
random time ``--after`` seconds into the leg's training:

- **to the next commit**: from the first retry's start to the next leg's first commit. A retry
  that finds the dead driver's lease still live exits at once (``LeaseHeld``, exit 1) and the
  bench starts the command again a second later, as a submitter's retry would;
- **steps trained again**: the steps the killed driver had recorded (its ``elastic_step``) past
  the checkpoint the next leg resumed from: at least that many, since the ranks send their
  records about once a second and a second's steps more may have been committed and lost;
- **ranks started again**: the groups the next leg built (its console's lines), of one rank each.

    python bench/driver_loss.py --kills 3        # about 70 s a kill at the default lease_ttl_s of 60 s
"""

from __future__ import annotations

import argparse
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.testing.loopback import free_port  # noqa: E402

POLL_S = 0.05
RESUMED = re.compile(r"resuming from the checkpoint of step (\d+)")
BUILT = re.compile(r"group (\d+) built in")
GROUPS = 2


def metric(port: int, name: str) -> float | None:
    """``name``'s value at the driver's endpoint; None while it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as response:
            text = response.read().decode()
    except OSError:
        return None
    return next((sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                 if sample.name == name), None)


class Leg:
    """One driver process of the run."""

    def __init__(self, head, storage: Path, args: argparse.Namespace, number: int):
        self.port = free_port()
        self.log = storage / f"driver-{number}.log"
        command = [sys.executable, "-m", "elastic", "train", "--groups", str(GROUPS), "--shard", "1",
                   "--tp", "1", "--steps", "1000000", "--storage", str(storage), "--run-name", "job",
                   "--checkpoint-every", str(args.checkpoint_every), "--metrics-host", "127.0.0.1",
                   "--metrics-port", str(self.port), "--set", f"checkpoint.lease_ttl_s={args.lease_ttl_s}"]
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, cwd=storage, env=head.driver_env(), stdout=log,
                                            stderr=subprocess.STDOUT)

    def first_commit(self) -> float | None:
        """Wait for the leg's first commit (``elastic_step``, 0 until one, is set by each);
        when it came, or None if the driver exited first (a lease still held)."""
        while self.process.poll() is None:
            step = metric(self.port, "elastic_step")
            if step:
                return time.time()
            time.sleep(POLL_S)
        return None


def retry_until_taken(head, storage: Path, args: argparse.Namespace, number: int) -> tuple[Leg, float, float, int]:
    """The same command, started again a second after each driver that finds the dead one's
    lease live and exits: the leg that took the run, when the first try started, when the
    leg's first commit came, and the tries refused."""
    refused, first_try = 0, time.time()
    while True:
        leg = Leg(head, storage, args, number + refused)
        committed = leg.first_commit()
        if committed is not None:
            return leg, first_try, committed, refused
        if "lease" not in leg.log.read_text():
            raise SystemExit(f"a retry failed otherwise than on the lease:\n{leg.log.read_text()[-2000:]}")
        refused += 1
        time.sleep(1.0)


def run(args: argparse.Namespace) -> list[dict]:
    from elastic.testing.ray_head import RayHead

    os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                       "RAY_USAGE_STATS_ENABLED": "0"})
    draws = random.Random(args.seed)
    head = RayHead(num_cpus=GROUPS + 2)
    kills = []
    try:
        with tempfile.TemporaryDirectory() as directory:
            storage = Path(directory)
            leg, _, _, _ = retry_until_taken(head, storage, args, 0)
            legs = 1
            for _ in range(args.kills):
                time.sleep(draws.uniform(*args.after))
                # the steps committed so far, as the driver has heard of them: the ranks send their
                # records about once a second, so they may have committed a second's steps more
                next_step = int(metric(leg.port, "elastic_step"))
                leg.process.kill()
                leg.process.wait()
                leg, first_try, committed, refused = retry_until_taken(head, storage, args, legs)
                legs += 1 + refused
                log = leg.log.read_text()
                resumed = RESUMED.search(log)
                kill = {"to_next_commit_s": committed - first_try, "retries_refused": refused,
                        "steps_trained_again": next_step - (int(resumed.group(1)) if resumed else 0),
                        "ranks_started": len(set(BUILT.findall(log)))}
                kills.append(kill)
                print(f"kill {len(kills)} after step {next_step - 1}: {refused} tries refused on the lease, first "
                      f"try -> next commit {kill['to_next_commit_s']:.1f} s, {kill['steps_trained_again']} steps "
                      f"trained again, {kill['ranks_started']} ranks started again", flush=True)
            leg.process.kill()
            leg.process.wait()
    finally:
        head.stop()
    return kills


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--after", type=float, nargs=2, default=(3.0, 12.0), metavar=("MIN", "MAX"),
                        help="seconds of a leg's training before its driver is killed, drawn uniformly")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--lease-ttl-s", type=float, default=60.0, help="checkpoint.lease_ttl_s (the default: 60)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    kills = run(args)
    print(f"\n{len(kills)} driver kills, {GROUPS} groups of one rank, checkpoints every {args.checkpoint_every} "
          f"steps, lease_ttl_s {args.lease_ttl_s:g}:")
    print(f"  first retry -> next commit: median {statistics.median(k['to_next_commit_s'] for k in kills):.1f} s, "
          f"max {max(k['to_next_commit_s'] for k in kills):.1f} s")
    print(f"  steps trained again (at least): {[k['steps_trained_again'] for k in kills]}")
    print(f"  ranks started again: {[k['ranks_started'] for k in kills]} (of {GROUPS})")


if __name__ == "__main__":
    main()

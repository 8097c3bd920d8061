"""The next segment's handoff against the number of waiting ranks: one write to the driver's
store (``elastic.fleet.rendezvous.Rendezvous.hand_off``) and the store's server waking each
waiting rank and serving it the word (``workers.segment_handoff``), timed from the write until
the last rank has read it, and the CPU seconds the store's server threads spent on it.

The ranks are ``--processes`` processes, each with ``size / processes`` threads, every thread a
rank's own store connection waiting as a rank waits; the word is a real ``NextSegment`` of a job
of that many ranks. Per size, the medians over ``--repeats`` handoffs, and a straight line fit of
each over the sizes. Here the ranks share the two cores with the server, so the wall time's
per-rank cost is an upper bound (the ranks' own reads are in it); the server's CPU per rank is
what a server whose ranks are on other hosts spends (one thread, libuv). The simulation charges
the wall time's rate per surviving rank (``elastic/simulation/costs.py``, ``store_reads_per_s``).

    python bench/handoff_fanout.py --sizes 32,128,512 --json OUT
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from elastic.core.data_plan import DataCursor  # noqa: E402
from elastic.core.lr_schedule import LRSchedule  # noqa: E402
from elastic.core.protocol import NextSegment, SegmentSpec  # noqa: E402

RANKS_PER_GROUP = 8


def job_spec(ranks: int, attempt: int) -> SegmentSpec:
    groups = max(1, ranks // RANKS_PER_GROUP)
    return SegmentSpec(attempt=attempt, first_step=100, stop_step=200, cursor=DataCursor(position=12_800),
                       dataset_len=10 ** 9, global_batch=8 * ranks, seed=0,
                       group_weights=dict.fromkeys(range(groups), 1.0), micro_batch=1, seq_len=8192,
                       schedule=LRSchedule(3e-4), clip_grad_norm=1.0, deadline_s=30.0)


def waiting_ranks(port: int, secret: str, threads: int, attempts: int, ready, read_at) -> None:
    """One process's ranks: each waits for every attempt's word on its own connection and
    records when it has read it."""
    import datetime

    import torch.distributed as dist

    from workers.keyed_store import KeyedStore
    from workers.segment_handoff import next_segment_key

    def rank() -> None:
        store = KeyedStore(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=600)), secret)
        ready.put(1)
        for attempt in range(attempts):
            key = next_segment_key(attempt, 0)
            store.wait([key])
            store.get(key)
            read_at.put((attempt, time.time()))

    workers = [threading.Thread(target=rank) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def server_cpu_s() -> float:
    """CPU seconds of this process's threads other than the main one: the store's server."""
    total = 0
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) == threading.main_thread().native_id:
            continue
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def measure(size: int, processes: int, repeats: int) -> dict:
    from elastic.fleet.rendezvous import Rendezvous
    from workers.segment_handoff import encode

    rendezvous = Rendezvous.start("127.0.0.1")
    context = multiprocessing.get_context("spawn")
    ready, read_at = context.Queue(), context.Queue()
    per_process = [size // processes + (1 if index < size % processes else 0) for index in range(processes)]
    children = [context.Process(target=waiting_ranks, args=(rendezvous.port, rendezvous.secret, threads, repeats,
                                                            ready, read_at))
                for threads in per_process if threads]
    for child in children:
        child.start()
    for _ in range(size):
        ready.get(timeout=600)
    time.sleep(1.0)  # every rank in its wait
    seconds, cpu_s, word_bytes = [], [], 0
    for attempt in range(repeats):
        word = encode(NextSegment(job_spec(size, attempt)))
        word_bytes = len(word)
        cpu_before, written = server_cpu_s(), time.time()
        rendezvous.hand_off(attempt, 0, word)
        last = max(read_at.get(timeout=600)[1] for _ in range(size))
        seconds.append(last - written)
        cpu_s.append(server_cpu_s() - cpu_before)
        time.sleep(0.2)
    for child in children:
        child.join(timeout=60)
    return {"ranks": size, "seconds": statistics.median(seconds), "server_cpu_s": statistics.median(cpu_s),
            "all_s": [round(s, 5) for s in seconds], "word_bytes": word_bytes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="32,128,512", help="waiting ranks, comma-separated")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    rows = []
    for size in sizes:
        rows.append(measure(size, args.processes, args.repeats))
        print(json.dumps(rows[-1]), flush=True)
    ranks = [row["ranks"] for row in rows]
    per_rank_s, fixed_s = statistics.linear_regression(ranks, [row["seconds"] for row in rows])
    server_per_rank_s, _ = statistics.linear_regression(ranks, [row["server_cpu_s"] for row in rows])
    figures = {"sizes": rows, "fixed_s": fixed_s, "per_rank_s": per_rank_s,
               "reads_per_s": 1.0 / per_rank_s if per_rank_s > 0 else None,
               "server_cpu_per_rank_s": server_per_rank_s}
    print(f"handoff: {fixed_s * 1e3:.2f} ms + {per_rank_s * 1e6:.1f} us per waiting rank "
          f"({figures['reads_per_s'] or float('inf'):,.0f} ranks served a second); the store's server "
          f"{server_per_rank_s * 1e6:.1f} us of CPU per rank")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

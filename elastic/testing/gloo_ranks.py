"""Real process groups without a cluster: a function run on ``world`` processes that form
one gloo group (its pairs on loopback), each sending back what it returned, or its traceback,
over a pipe of its own.

Every rank process a test starts comes from ``rank_processes()``: forked from a server that
imported torch and the project once, not spawned. A spawned process imports them itself,
about 3 CPU-seconds each time, which the suite paid for every rank of every such test.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from elastic.testing.preload import TORCH_PRELOADED


START_METHOD = "forkserver"
# What a test's ranks import: the fork server imports it once, before any rank is forked.
PRELOADED = [*TORCH_PRELOADED, "workers.worker"]


def rank_processes() -> multiprocessing.context.BaseContext:
    """The context to start rank processes in: a fork server, which forks each from a process
    that runs no threads (a fork of this one would copy Ray's and gloo's threads mid-state).
    Its processes get the environment the server started with, not the test's of the moment:
    what a rank needs from the test goes in its arguments."""
    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload(PRELOADED)
    return context


def gloo_ranks(target: Callable[..., Any], world: int, init_file: str, *args, wait_s: float = 120) -> list[Any]:
    """What ``target(rank, *args)`` returned on each rank, in rank order; it runs with the
    default process group joined through ``init_file``. Fails naming a rank's traceback."""
    context = rank_processes()
    pipes = [context.Pipe(duplex=False) for _ in range(world)]
    # Daemons: a rank left waiting on one that failed goes with this process.
    processes = [context.Process(target=_answer, args=(target, rank, world, init_file, args, pipes[rank][1]),
                                 daemon=True) for rank in range(world)]
    for process in processes:
        process.start()
    answers = []
    for receiver, _ in pipes:
        assert receiver.poll(wait_s), f"a rank sent nothing within {wait_s:.0f} s"
        status, answer = pickle.loads(receiver.recv_bytes())
        assert status == "ok", answer
        answers.append(answer)
    for process in processes:
        process.join(30)
    return answers


def loopback_store(timeout_s: float) -> dist.TCPStore:
    """A rendezvous store on loopback for a test's ranks (keep it while they run): each reaches
    it at its ``port``, as a rank reaches the run's store."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _answer(target, rank: int, world: int, init_file: str, args: tuple, connection) -> None:
    # One thread, as a Ray rank runs: the spawned ranks share the machine's cores, and OpenMP
    # threads that outnumber them spin (test_float8 took twice the CPU and the time).
    torch.set_num_threads(1)
    try:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the ranks' pairs listen on loopback only
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        # Plain pickle: a tensor sent as itself would be shared through this process, gone by
        # the time the test reads it.
        connection.send_bytes(pickle.dumps(("ok", target(rank, *args))))
    except BaseException:
        connection.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def all_reduce_seconds(rank: int, nbytes: int, repeats: int) -> list[float]:
    """A ``gloo_ranks`` target: each of ``repeats`` all-reduces of ``nbytes`` timed, after one
    untimed (the connections' first use)."""
    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - started)
    return times

"""A rank's failure is attributed by the error's type and the code it came out of, never by
its text: real gloo collectives whose peer died, and a rank's own errors that merely say
"timed out" or "NCCL"."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from elastic.testing.gloo_ranks import loopback_store, rank_processes
from workers.failures import (
    CollectiveAborted,
    CollectiveFailed,
    CollectiveTimedOut,
    Failure,
    StepInterrupted,
    classify,
)


def raised(error: BaseException) -> BaseException:
    """``error`` with a traceback, as a rank's step would catch it."""
    try:
        raise error
    except BaseException as caught:
        return caught


def raised_by_a_library(error: BaseException) -> BaseException:
    """``error`` with a traceback of library frames only (the standard library's), as one
    raised where none of the user's code ran; ``raised`` itself is the user's code to a rank."""
    import json

    try:
        json.loads("{")
    except ValueError as caught:
        return error.with_traceback(caught.__traceback__.tb_next)


def test_a_ranks_own_errors_are_its_own_whatever_their_text():
    assert classify(raised(TimeoutError("S3 read timed out")), "data") is Failure.OWN_IO
    assert classify(raised(OSError("Connection reset by peer (s3)")), "data") is Failure.OWN_IO
    assert classify(raised_by_a_library(RuntimeError("NCCL-like text; abort")), "compute") is Failure.OWN_COMPUTE
    assert classify(raised(torch.OutOfMemoryError("CUDA out of memory")), "replicate") is Failure.OWN_COMPUTE
    assert classify(raised_by_a_library(ValueError("shape mismatch")), "replicate") is Failure.OWN_COMPUTE


def test_an_error_the_users_code_raises_itself_is_the_codes_and_a_runtime_error_is_not():
    # Raised by the user's code itself (these tests are the user's code to the rank): no
    # fresh process runs it differently.
    assert classify(raised(ValueError("shape mismatch")), "compute") is Failure.OWN_CODE
    try:
        torch.zeros(2)[5]  # torch's C++ raises IndexError for the user's own line
    except IndexError as error:
        assert classify(error, "compute") is Failure.OWN_CODE
    # A RuntimeError is what torch's kernels raise for a device's fault, a cuBLAS failure or
    # host memory running out, from whatever line called them: a fresh process may not meet it.
    assert classify(raised(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")), "compute") is Failure.OWN_COMPUTE
    assert classify(raised(torch.AcceleratorError("CUDA error: an illegal memory access")), "compute") \
        is Failure.OWN_COMPUTE
    assert classify(raised(torch.OutOfMemoryError("CUDA out of memory")), "compute") is Failure.OWN_COMPUTE
    assert classify(raised(dist.DistBackendError("x")), "compute") is Failure.COLLECTIVE
    # Code torch.compile generated is the compiler's, not the user's.
    generated = compile("def call():\n    raise ValueError('guard failed')\n",
                        "/tmp/torchinductor_user/ab/cabc.py", "exec")
    scope: dict = {}
    exec(generated, scope)
    try:
        scope["call"]()
    except ValueError as error:
        assert classify(error, "compute") is Failure.OWN_COMPUTE


def test_released_and_collective_failures_blame_peers():
    for error in (CollectiveAborted("x"), CollectiveTimedOut("x"), StepInterrupted("x")):
        assert classify(raised(error), "replicate") is Failure.RELEASED
    assert classify(raised(CollectiveFailed("x")), "replicate") is Failure.COLLECTIVE
    assert classify(raised(dist.DistBackendError("x")), "compute") is Failure.COLLECTIVE
    assert all(kind.blames_peers for kind in (Failure.RELEASED, Failure.COLLECTIVE))
    assert not any(kind.blames_peers for kind in (Failure.OWN_IO, Failure.OWN_COMPUTE))


def _second_step_after_peer_death(rank: int, port: int, layout: str, results) -> None:
    """``results`` is the sending end of a pipe: ``send`` has written the whole message when it
    returns, so ``os._exit`` cannot lose it (a ``Queue.put`` only hands it to a feeder thread)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=20)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    mesh = init_device_mesh("cpu", (2,))
    if layout == "tp":
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    else:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    batch = torch.randn(4, 16)
    if layout == "fsdp in a pipeline stage":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        own_stage_group, _ = dist.new_subgroups(group_size=1)
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=own_stage_group)
        schedule = ScheduleGPipe(stage, n_microbatches=1, loss_fn=lambda output, target: output.sum())
        step = lambda: schedule.step(batch, target=batch)  # noqa: E731
    else:
        step = lambda: model(batch).sum().backward()  # noqa: E731
    step()
    dist.barrier()
    if rank == 1:
        os._exit(1)  # dies between steps, like a lost node
    try:
        step()
        results.send("no error")
    except Exception as error:
        results.send(classify(error, "compute").value)
    results.close()
    os._exit(0)  # past a dead peer, the process group's teardown could wait on it


@pytest.mark.parametrize("layout", ["fsdp", "tp", "fsdp in a pipeline stage"])
def test_a_peer_dying_inside_a_real_gloo_collective_is_a_collective_failure(layout):
    """In a pipeline stage, torch's schedule re-raises the collective's error as its own
    ``RuntimeError`` ("[Stage 0] failed to run forward"): the peer's death is still what it is."""
    context = rank_processes()
    received, results = context.Pipe(duplex=False)
    # The test holds the store, listening on a port it was given: a free port picked and then
    # bound by a rank could be taken in between by another test's process.
    store = loopback_store(60)
    port = store.port
    ranks = [context.Process(target=_second_step_after_peer_death, args=(rank, port, layout, results))
             for rank in range(2)]
    for process in ranks:
        process.start()
    results.close()  # the children hold their own copies of the sending end
    try:
        assert received.poll(120), f"rank 0 sent no result; exit codes {[p.exitcode for p in ranks]}"
        assert received.recv() == Failure.COLLECTIVE.value
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()


def users_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits, targets)  # a user's bug: (batch, seq, vocab) logits


def test_a_failure_names_the_frame_in_the_users_code_not_torchs():
    from workers.failures import describe_failure

    error = raised_by(lambda: users_loss(torch.zeros(2, 3, 4), torch.zeros(2, 5, dtype=torch.long)))
    line = users_loss.__code__.co_firstlineno + 1
    assert describe_failure(error).startswith("RuntimeError: Expected target size")
    assert describe_failure(error).endswith(f" (at {__file__}:{line} in users_loss)")
    assert describe_failure(ValueError("no traceback")) == "ValueError: no traceback"


def raised_by(call) -> BaseException:
    try:
        call()
    except BaseException as caught:
        return caught
    raise AssertionError("it did not raise")


def test_the_code_that_is_not_the_users_is_known_where_a_package_is_a_folders_namesake(tmp_path):
    """A folder named ``elastic`` first on the path (a rank's, with the driver's working
    directory there) can make ``elastic`` a namespace package, which has no ``__file__``:
    the ranks' failures module still imports, and still knows the trainer's own code."""
    import subprocess
    import sys

    (tmp_path / "elastic").mkdir()
    check = ("import sys; sys.path.insert(0, sys.argv[1]); import elastic, workers.failures as failures; "
             "from elastic.core import protocol; assert not failures.is_user_code(protocol.__file__)")
    completed = subprocess.run([sys.executable, "-P", "-c", check, str(tmp_path)], capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]

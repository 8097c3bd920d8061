"""What each rank process does around a failure, written as it happens for
``bench/failure_cost.py``: installed in every Ray worker by Ray's setup hook, it wraps, without
changing them, the calls that show a recovery's cost on a rank, and appends one JSON line per
event to ``$FAILURE_PROBE_DIR/<pid>.jsonl``:

- ``step``: a step the rank took (``StepTransaction.step``), committed, discarded or failed,
  with the CPU seconds of the call (every thread's);
- ``commit``: a step the rank applied (``StepTransaction.step`` returned ``Committed``), with
  each group's share of its samples;
- ``process-group``: a process group created (``init_process_group``, ``new_group``, or a
  gloo / NCCL group built directly, as the cross-group groups are);
- ``object-store``: the bytes of a rank's state handed to Ray to carry (``export_state``,
  ``export_held``: the heal's and the memory tier's object-store roads);
- ``regroup``: the rank entering a new build of the cross-group groups as a segment starts
  (``StepTransaction.enter_replicas``), with its wall and CPU seconds (every thread's: the
  rendezvous runs on one of its own) and the number of groups;
- ``handoff``: the rank's wait for the driver's next word after a segment ended
  (``SegmentHandoff.next_spec``), with its wall and CPU seconds;
- ``exit``: the process ending itself (the injected kill).

Each line has the wall time ``t``, the process's CPU seconds so far (``cpu``: every thread)
and the rank (``rank``, once the rank has its place)."""

from __future__ import annotations

import functools
import json
import os
import threading
import time

from workers.memory_tier import state_bytes

_lock = threading.Lock()
_rank: list[int | None] = [None]


def _write(kind: str, **fields) -> None:
    line = json.dumps({"kind": kind, "t": time.time(), "cpu": time.process_time(), "rank": _rank[0], **fields})
    with _lock, open(os.path.join(os.environ["FAILURE_PROBE_DIR"], f"{os.getpid()}.jsonl"), "a") as out:
        out.write(line + "\n")


def _counting(function, kind: str, **fields):
    @functools.wraps(function)
    def counted(*args, **kwargs):
        result = function(*args, **kwargs)
        _write(kind, **fields)
        return result
    return counted


def _shipping(method):
    @functools.wraps(method)
    def shipped(self, *args, **kwargs):
        state = method(self, *args, **kwargs)
        _write("object-store", nbytes=state_bytes(state), call=method.__name__)
        return state
    return shipped


def install() -> None:
    """Ray's ``worker_process_setup_hook``: runs in each worker before it takes an actor."""
    import torch.distributed as dist

    from workers import segment_handoff, step_contributions, step_transaction, worker

    for name in ("init_process_group", "new_group"):
        setattr(dist, name, _counting(getattr(dist, name), "process-group", how=name))
    for name in ("ProcessGroupGloo", "ProcessGroupNCCL"):
        if hasattr(dist, name):
            built = getattr(dist, name)
            setattr(dist, name, type(name, (built,), {
                "__init__": _counting(built.__init__, "process-group", how=name)}))

    take_place = worker.RankWorker._take_place

    def placed(self, spec):
        _rank[0] = spec.global_rank
        return take_place(self, spec)

    worker.RankWorker._take_place = placed
    for name in ("export_state", "export_held"):
        setattr(worker.RankWorker, name, _shipping(getattr(worker.RankWorker, name)))

    step = step_transaction.StepTransaction.step

    def stepped(self, spec, share, *args, **kwargs):
        cpu = time.process_time()
        try:
            outcome = step(self, spec, share, *args, **kwargs)
        finally:  # a failed step raises: its work is the step's too
            _write("step", cpu_s=time.process_time() - cpu)
        if isinstance(outcome, step_contributions.Committed):
            _write("commit", step=outcome.record.step, group=outcome.record.group,
                   group_samples={str(group): samples for group, samples in outcome.record.group_samples.items()})
        return outcome

    step_transaction.StepTransaction.step = stepped
    enter_replicas = step_transaction.StepTransaction.enter_replicas

    def regrouped(self, spec):
        build, wall, cpu = self.world.replicas_build, time.perf_counter(), time.process_time()
        enter_replicas(self, spec)
        if self.world.replicas_build != build:
            _write("regroup", groups=len(spec.groups), wall_s=time.perf_counter() - wall,
                   cpu_s=time.process_time() - cpu)

    step_transaction.StepTransaction.enter_replicas = regrouped
    next_spec = segment_handoff.SegmentHandoff.next_spec

    def handed_on(self, *args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return next_spec(self, *args, **kwargs)
        finally:
            _write("handoff", wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu)

    segment_handoff.SegmentHandoff.next_spec = handed_on
    exit_now = os._exit

    def exiting(code):
        _write("exit")
        exit_now(code)

    os._exit = exiting

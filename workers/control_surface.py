"""The rank's control surface: what the training thread tells and is told while it steps,
apart from the step itself (``workers.step_transaction``).

The rank actor (``workers.worker``) answers the driver on a control thread while its training
thread steps: ``ActivityTracker`` is where the training thread is (for the driver's probes),
``DriverSignals`` what the driver asked of it (abort, pause), ``ComputeTimer`` its own compute
time (for the straggler records). A segment that injects faults (tests, benchmarks) hands the
step a ``FaultPlan`` it calls at two points; production runs pass ``NO_FAULTS``
(``workers.fault_injection`` builds the others).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol

import torch
from torch.distributed.fsdp import FSDPModule

from elastic.core.protocol import Phase, RankActivity
from workers.model import Attention


class ComputeTimer:
    """This rank's own compute time, without the time it waits on peers.

    On CUDA, events on the compute stream (no device-wide synchronisation). On CPU, the
    training thread's CPU time, which excludes time blocked in gloo collectives.
    """

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu

    def start(self) -> None:
        if self.on_gpu:
            self.started = torch.cuda.Event(enable_timing=True)
            self.started.record()
        else:
            self.started = time.thread_time()

    def seconds(self) -> float:
        if not self.on_gpu:
            return time.thread_time() - self.started
        ended = torch.cuda.Event(enable_timing=True)
        ended.record()
        ended.synchronize()
        return self.started.elapsed_time(ended) / 1000.0


class ActivityTracker:
    """Where the training thread is, for the control thread to answer the driver's probes."""

    def __init__(self):
        self._lock = threading.Lock()
        self.module_entries = 0
        self.set(-1, Phase.IDLE)

    def set(self, step: int, phase: Phase, micro_batch: int = 0) -> None:
        with self._lock:
            self.step, self.phase, self.micro_batch = step, phase, micro_batch
            self._phase_started = time.monotonic()
            if phase == Phase.DATA:
                self.module_entries = 0

    def count_module_entry(self, *_args) -> None:
        self.module_entries += 1

    def count_entries_of(self, model: torch.nn.Module) -> None:
        """Count each entry into a module FSDP2 wraps, and into an attention that gathers the
        sequence's keys and values from its cp peers. Prepended: counted before FSDP's
        all-gather, so a rank blocked in compute lags the peers blocked in the next module's
        gather, or in its attention's."""
        for module in model.modules():
            if isinstance(module, FSDPModule) or (isinstance(module, Attention) and module.context is not None):
                module.register_forward_pre_hook(self.count_module_entry, prepend=True)

    def chunk_started(self) -> None:
        """A pipeline stage begins a micro-batch's forward or backward."""
        with self._lock:
            self.module_entries += 1
            self.phase, self._phase_started = Phase.COMPUTE, time.monotonic()

    def chunk_ended(self) -> None:
        """A pipeline stage is through a chunk: what follows waits on its neighbours."""
        with self._lock:
            self.phase, self._phase_started = Phase.STAGE_WAIT, time.monotonic()

    def read(self, global_rank: int) -> RankActivity:
        with self._lock:
            return RankActivity(global_rank, self.step, self.phase, self.micro_batch, self.module_entries,
                            time.monotonic() - self._phase_started)


class DriverSignals:
    """What the driver asks on the rank's control thread, for the training thread to act on:
    give up the attempt in progress (abort), or stop a segment at a step boundary (pause);
    and what the control thread does itself while an attempt is in progress (``during``)."""

    def __init__(self):
        self._abort = threading.Event()
        self._abort_attempt = -1
        self._attempt = -1  # the segment or evaluation begun last
        self._pause_attempt = -1
        self._lock = threading.Lock()
        self._running = False  # the attempt begun last has not ended
        self._waking = threading.Lock()  # not ``_lock``: ``during``'s action may request an abort
        self._woken_at_abort: set[threading.Event] = set()

    def begin(self, attempt: int) -> None:
        with self._lock:
            self._attempt, self._running = attempt, True

    def end(self) -> None:
        """The attempt's work is over: what follows (a rebuild) is no longer its."""
        with self._lock:
            self._running = False

    def during(self, attempt: int, action) -> bool:
        """Run ``action`` if ``attempt`` is in progress, holding off its end until it is done:
        a late request never acts on what the next call (a rebuild) made. Returns whether it ran."""
        with self._lock:
            if not (self._running and self._attempt == attempt):
                return False
            action()
            return True

    def request_abort(self, attempt: int) -> None:
        self._abort_attempt = attempt
        self._abort.set()
        with self._waking:
            for event in self._woken_at_abort:
                event.set()

    def request_pause(self, attempt: int) -> None:
        self._pause_attempt = attempt

    def abort_requested(self) -> bool:
        if self._abort.is_set() and self._abort_attempt != self._attempt:
            self._abort.clear()  # a late abort of an attempt already over
        return self._abort.is_set()

    def pause_requested(self, attempt: int) -> bool:
        return self._pause_attempt == attempt

    def wait(self, seconds: float) -> None:
        """Sleep up to ``seconds``, waking early at an abort."""
        self._abort.wait(seconds)

    def wait_for(self, done: threading.Event, seconds: float) -> None:
        """Sleep until ``done`` is set, an abort comes (or one is pending), or ``seconds`` pass."""
        with self._waking:
            self._woken_at_abort.add(done)
        try:
            if not self._abort.is_set():  # set after this, the abort sets ``done`` too
                done.wait(seconds)
        finally:
            with self._waking:
                self._woken_at_abort.discard(done)


class FaultPlan(Protocol):
    """Faults injected into a segment's steps (``workers.fault_injection``)."""

    def after_compute(self, compute_s: float) -> float:
        """Called once the rank's share is computed; returns its compute seconds, with any
        slowdown the plan adds."""

    def before_cross_group_sum(self) -> None:
        """Called as the rank waits for the gradients' cross-group sum (begun in its last
        backward); may fail it."""

    def in_outer_step(self) -> None:
        """Called as the rank waits for each collective of DiLoCo's outer step; may end the
        process."""

    def perturb(self, step: int, bucket: int, flat: torch.Tensor) -> None:
        """Called with each bucket of gradients the rank computed for ``step``, as it hands it
        to the cross-group sum (or fingerprints a replay's); may change it in place."""


class NoFaults:
    def after_compute(self, compute_s: float) -> float:
        return compute_s

    def before_cross_group_sum(self) -> None:
        pass

    def in_outer_step(self) -> None:
        pass

    def perturb(self, step: int, bucket: int, flat: torch.Tensor) -> None:
        pass


NO_FAULTS = NoFaults()

"""The rank's side of fault injection: a worker that carries out the faults its step
requests carry (see ``elastic.core.faults``) around the production step.

The fleet starts this worker instead of ``RankWorker`` only for runs that inject faults or
straggler noise, so the production step has no injection branches.
"""

from __future__ import annotations

import os
import threading
import time

import ray
import torch
from torch.distributed.fsdp import FSDPModule

from elastic.core.faults import InjectedFault, InjectedStepRequest
from workers.protocol import RankSpec, StepReport
from workers.train_step import accumulate_gradients
from workers.worker import RankWorker


class InjectedCollectiveFailure(RuntimeError):
    pass


def burn_cpu(seconds: float) -> None:
    """Busy work, so an injected slowdown shows in CPU time the way a slow device would."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


class FaultInjectingWorker(RankWorker):
    def __init__(self, spec: RankSpec, hooks):
        super().__init__(spec, hooks)
        self.slow_factor = 1.0
        self.noise_rng = torch.Generator().manual_seed(spec.seed * 100_003 + spec.global_rank)

    def train_step(self, request: InjectedStepRequest) -> StepReport:
        for fault in request.faults:
            self._fire(fault)
        return super().train_step(request)

    def _fire(self, fault: InjectedFault) -> None:
        if fault.kind in ("kill", "kill-group"):
            if fault.after_s:
                threading.Timer(fault.after_s, os._exit, (1,)).start()  # dies mid-step
            else:
                os._exit(1)
        if fault.kind == "slow":
            self.slow_factor = fault.factor
        if fault.kind == "hang":
            hang_in = next(
                (m for m in self.model.modules() if isinstance(m, FSDPModule) and m is not self.model), self.model
            )
            hang_in.register_forward_pre_hook(lambda *_: threading.Event().wait())

    def _compute(self, request: InjectedStepRequest, batches, loss_of=accumulate_gradients) -> tuple[float, float]:
        loss_share, compute_s = super()._compute(request, batches, loss_of)
        extra = (self.slow_factor - 1.0) * compute_s
        if request.noise:
            # Work can only be added, so noise of amplitude a is a slowdown of a +/- a.
            extra += compute_s * request.noise * 2.0 * torch.rand((), generator=self.noise_rng).item()
        burn_cpu(extra)
        return loss_share, compute_s + extra

    def _reduce_across_groups(self, request: InjectedStepRequest, deadline: float) -> None:
        if any(fault.kind == "fail-collective" for fault in request.faults):
            self._leave_replicas()
            raise InjectedCollectiveFailure(f"injected collective failure on rank {self.spec.global_rank}")
        super()._reduce_across_groups(request, deadline)


FaultInjectingRankActor = ray.remote(concurrency_groups={"control": 1, "checkpoint": 1})(FaultInjectingWorker)

"""The rank's side of fault injection: a worker that carries out the faults its run spec
carries (see ``elastic.core.faults``) as the run's first step starts, around the
production run.

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

from elastic.core.faults import InjectedFault, InjectedRunSpec
from workers.integrity import flip_bit
from workers.rank_spec import RankSpec
from workers.worker import CONCURRENCY_GROUPS, RankWorker


class InjectedCollectiveFailure(RuntimeError):
    pass


def burn_cpu(seconds: float) -> None:
    """Busy work, so an injected slowdown shows in CPU time the way a slow device would."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


class FaultInjectingWorker(RankWorker):
    def __init__(self, spec: RankSpec, pickled_hooks: bytes):
        super().__init__(spec, pickled_hooks)
        self.slow_factor = 1.0
        self.fail_next_collective = False

    def _take_place(self, spec: RankSpec) -> None:
        super()._take_place(spec)
        self.noise_rng = torch.Generator().manual_seed(spec.seed * 100_003 + spec.global_rank)

    def run(self, spec: InjectedRunSpec):
        for fault in spec.faults:
            self._fire(fault)
        yield from super().run(spec)

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
        if fault.kind == "fail-collective":
            self.fail_next_collective = True
        if fault.kind == "flip":
            flip_bit(self.model)

    def _compute(self, spec: InjectedRunSpec, step: int, batches, global_tokens: int) -> tuple[float, float]:
        loss_share, compute_s = super()._compute(spec, step, batches, global_tokens)
        extra = (self.slow_factor - 1.0) * compute_s
        if spec.noise:
            # Work can only be added, so noise of amplitude a is a slowdown of a +/- a.
            extra += compute_s * spec.noise * 2.0 * torch.rand((), generator=self.noise_rng).item()
        burn_cpu(extra)
        return loss_share, compute_s + extra

    def _reduce_across_groups(self, spec: InjectedRunSpec, deadline: float) -> None:
        if self.fail_next_collective:
            self.fail_next_collective = False
            self._leave_replicas()
            raise InjectedCollectiveFailure(f"injected collective failure on rank {self.spec.global_rank}")
        super()._reduce_across_groups(spec, deadline)


FaultInjectingRankActor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(FaultInjectingWorker)

"""The rank's side of fault injection: the ``FaultPlan`` (``workers.control_surface``) of the
runs whose specs carry faults or straggler noise (``elastic.core.faults``).

A rank fires its run's faults as the run's first step starts; some act at once (a kill, a
hang set in the model, a flipped bit), others through the plan the step calls: a slowdown
or noise added to its compute, a failure of its next cross-group sum, wrong values in the
gradients it hands that sum. Production runs pass
``NO_FAULTS`` and their step has no injection branches.
"""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from elastic.core.faults import InjectedFault, InjectedSegmentSpec
from elastic.core.protocol import SegmentSpec
from workers.integrity import INTEGER_VIEWS, flip_bit
from workers.control_surface import NO_FAULTS, FaultPlan
from workers.world import World

# A float's stored mantissa bits: its top one flipped changes a value by up to half itself.
MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}


class InjectedCollectiveFailure(RuntimeError):
    pass


def burn_cpu(seconds: float) -> None:
    """Busy work, so an injected slowdown shows in CPU time the way a slow device would."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


# A block's backward takes about twice its forward: work added in the forward alone, this
# many times the forward's own, slows the whole step by about the factor.
STEP_OVER_FORWARD = 3.0


def work_sites(model: nn.Module) -> list[nn.Module]:
    """Where a fault acts inside the forward: the outermost modules FSDP2 wraps (the model
    itself aside), else the outermost modules holding parameters of their own. Both run a
    forward in every layout, where the model, or a rank's pipeline stages, may run none of
    their own; outermost alone, so no work is counted twice through nested modules."""
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule) and m is not model]
    named = named or [(name, m) for name, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None]
    outermost: list[tuple[str, nn.Module]] = []
    for name, module in named:  # named_modules lists a module before the modules inside it
        if not any(outer == "" or name.startswith(outer + ".") for outer, _ in outermost):
            outermost.append((name, module))
    return [module for _, module in outermost]


def slow_blocks(model: nn.Module, factor: float) -> None:
    """Slow the rank by ``factor`` inside its forward, as a slow device would, not after its
    compute: its group's peers meet it in the collectives of a later block."""
    started: dict[int, float] = {}

    def before(module, _inputs) -> None:
        started[id(module)] = time.thread_time()

    def after(module, _inputs, _output) -> None:
        burn_cpu((factor - 1.0) * STEP_OVER_FORWARD * (time.thread_time() - started.pop(id(module))))

    for block in work_sites(model):
        block.register_forward_pre_hook(before)
        block.register_forward_hook(after)


class InjectedFaults:
    """One rank's injected faults. A slowdown lasts for the rest of the process's life, and
    the noise draws from one stream per rank, across its runs."""

    def __init__(self, seed: int, global_rank: int, world: World):
        self.global_rank = global_rank
        self.world = world
        self.noise_rng = torch.Generator().manual_seed(seed * 100_003 + global_rank)
        self.noise = 0.0
        self.slow_factor = 1.0
        self.fail_next_collective = False
        self.dying = False
        self.dies_in_outer_step = False
        self.first_step = 0  # the segment's, as its faults fire
        # the device computes wrong (``compute``): from which step, how often, by what relative error
        self.computes_wrong: tuple[int, int, float] | None = None

    def plan(self, spec: SegmentSpec, model: nn.Module) -> FaultPlan:
        """The segment's plan, its faults fired: ``NO_FAULTS`` for a segment that injects none."""
        if not isinstance(spec, InjectedSegmentSpec):
            return NO_FAULTS
        self.noise = spec.noise
        self.first_step = spec.first_step
        for fault in spec.faults:
            self._fire(fault, model)
        return self

    def _fire(self, fault: InjectedFault, model: nn.Module) -> None:
        if fault.kind in ("kill", "kill-group"):
            if fault.during:
                self.dies_in_outer_step = True
            elif fault.after_s:
                # Dies mid-step while its peers compute; the step it was fired in never
                # reaches its sum, so the death lands in that step however short it is.
                threading.Timer(fault.after_s, os._exit, (1,)).start()
                self.dying = True
            else:
                os._exit(1)
        if fault.kind == "slow":
            self.slow_factor = fault.factor
        if fault.kind == "slow-device":
            slow_blocks(model, fault.factor)
        if fault.kind == "hang":
            work_sites(model)[0].register_forward_pre_hook(lambda *_: threading.Event().wait())
        if fault.kind == "fail-collective":
            self.fail_next_collective = True
        if fault.kind == "flip":
            flip_bit(model)
        if fault.kind == "slow-link":
            self.world.throttle(fault.rate)
        if fault.kind == "compute":
            self.computes_wrong = (self.first_step, fault.every, fault.relative)

    def after_compute(self, compute_s: float) -> float:
        extra = (self.slow_factor - 1.0) * compute_s
        if self.noise:
            # Work can only be added, so noise of amplitude a is a slowdown of a +/- a.
            extra += compute_s * self.noise * 2.0 * torch.rand((), generator=self.noise_rng).item()
        burn_cpu(extra)
        return compute_s + extra

    def in_outer_step(self) -> None:
        if self.dies_in_outer_step:
            os._exit(1)

    def perturb(self, step: int, bucket: int, flat: torch.Tensor) -> None:
        if self.computes_wrong is None:
            return
        since, every, relative = self.computes_wrong
        if step < since or (step - since) % every:
            return
        if relative:
            flat.mul_(1.0 + relative)
        elif bucket == 0:  # one bit: the top of the mantissa of the bucket's largest value
            largest = int(flat.abs().argmax())
            flat.view(INTEGER_VIEWS[flat.element_size()])[largest] ^= 1 << (MANTISSA_BITS[flat.dtype] - 1)

    def before_cross_group_sum(self) -> None:
        if self.dying:
            threading.Event().wait()  # until the timer ends the process
        if self.fail_next_collective:
            self.fail_next_collective = False
            self.world.leave_replicas()
            raise InjectedCollectiveFailure(f"injected collective failure on rank {self.global_rank}")

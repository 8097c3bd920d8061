"""The gradients' sum over the replicate group, started while backward still runs.

The gradients are cut into buckets (``bucket_bytes``), fixed once from the parameter
order (the last parameters first, as backward produces them), so every group's rank at a
position builds the same buckets. On the step's last micro-batch a bucket goes out as soon
as each of its gradients is final: FSDP2 calls a parameter's post-accumulate-grad hook once
its reduce-scatter has added into the sharded gradient, autograd does for a parameter FSDP2
does not hold. Buckets go out strictly in bucket order, so every rank issues the same
collectives in the same order however its hooks fire; a bucket whose parameters got no
gradient holds the later ones back until backward ends. A bucket's flat copy lives from its
send until its sum is written back, not a copy of every gradient for the whole sum.

Waiting is the caller's (``wait``): the step's deadline and the driver's abort apply to each
bucket as they did to the one flat all-reduce this replaces.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from elastic.core.compute_replay import combine
from workers.failures import CollectiveFailed
from workers.integrity import bit_sum

# A bucket holds at most DDP's default (large enough for NCCL's and gloo's bandwidth), and a
# model has at least ``MIN_BUCKETS`` of them where that leaves each at least ``MIN_BUCKET_BYTES``:
# a model smaller than one bucket would otherwise send its whole sum after backward.
BUCKET_BYTES = 25 * 2**20
MIN_BUCKETS = 8
MIN_BUCKET_BYTES = 2**16


class SumTimes(NamedTuple):
    """A step's cross-group gradient sum: first bucket sent to last bucket summed
    (``total_s``), and the part of it after backward ended (``exposed_s``)."""

    total_s: float
    exposed_s: float


def _unchanged(bucket: int, flat: torch.Tensor) -> None:
    pass


def trained(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer moves, in the model's order."""
    return [param for param in model.parameters() if param.requires_grad]


def local_gradient(param: nn.Parameter) -> torch.Tensor:
    """This rank's shard of the parameter's gradient (zeros where backward gave it none)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def local_gradient_numel(param: nn.Parameter) -> int:
    return (param._local_tensor if isinstance(param, DTensor) else param).numel()


def unflatten_into(gradients: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``flat``'s leading values written back into ``gradients``, in order (a sum's result)."""
    offset = 0
    for gradient in gradients:
        gradient.copy_(flat[offset : offset + gradient.numel()].view_as(gradient))
        offset += gradient.numel()


def plan_buckets(sizes: list[int], bucket_bytes: float) -> list[list[int]]:
    """Consecutive indices into ``sizes`` (bytes each), cut where a bucket would exceed
    ``bucket_bytes``; a parameter larger than that is a bucket of its own."""
    buckets: list[list[int]] = []
    filled = 0
    for index, size in enumerate(sizes):
        if not buckets or (filled + size > bucket_bytes and filled > 0):
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets


class _InFlight(NamedTuple):
    flat: torch.Tensor
    work: object


class GradientSum:
    """The cross-group sum of ``params``' gradients (``trained``: a model's), bucket by bucket.

    ``overlap=False`` sends every bucket once backward has ended (with a bucket size of
    infinity, the one flat all-reduce of old: ``bench/overhead.py`` measures both). ``values``:
    where a parameter's summands are and its sum goes (default its gradient's shard)."""

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype, bucket_bytes: float | None = None,
                 overlap: bool = True, values: Callable[[nn.Parameter], torch.Tensor] = local_gradient):
        self.values = values
        params = params[::-1]
        self.dtype = dtype
        sizes = [local_gradient_numel(param) * dtype.itemsize for param in params]
        if bucket_bytes is None:
            bucket_bytes = min(BUCKET_BYTES, max(sum(sizes) / MIN_BUCKETS, MIN_BUCKET_BYTES))
        self.buckets = [[params[index] for index in bucket] for bucket in plan_buckets(sizes, bucket_bytes)]
        self.payload_bytes = sum(sizes)  # what one sum hands the replicate group
        self._bucket_of = {id(param): number for number, bucket in enumerate(self.buckets) for param in bucket}
        self._group = None
        self._waiting: list[int] = []  # per bucket: gradients not final yet
        self._in_flight: list[_InFlight | None] = []  # per bucket sent, in bucket order; None once summed
        self._error: Exception | None = None
        self._first_sent_at = math.inf
        # Each bucket as it is handed on: where a fault changes it (a device computing wrong),
        # and the fingerprint of what was handed, where the step is a spot check
        self.perturb: Callable[[int, torch.Tensor], None] = _unchanged
        self.fingerprinting = False
        self.handed_fingerprint = 0
        if overlap:
            for param in params:
                param.register_post_accumulate_grad_hook(self._gradient_final)

    def handed_bytes(self, ranks: int) -> int:
        """What one sum hands the replicate group, of however many ``ranks``."""
        return self.payload_bytes

    @property
    def sent_in_backward(self) -> int:
        """Buckets of the step in progress sent so far."""
        return len(self._in_flight)

    def start(self, replicate_group) -> None:
        """The backward about to run is the step's last: send each bucket as its gradients
        become final."""
        self._group = replicate_group
        self._waiting = [len(bucket) for bucket in self.buckets]
        self._in_flight = []
        self._error = None
        self._first_sent_at = math.inf
        self.handed_fingerprint = 0

    def before_micro_batch(self, index: int, micro_batches: int, replicate_group) -> None:
        """Called before each of the step's ``micro_batches``: the last one's backward sends
        the buckets (none without a replicate group: no other group to sum with)."""
        if index == micro_batches - 1 and replicate_group is not None:
            self.start(replicate_group)

    def abandon(self) -> None:
        """The step failed or is discarded: what was sent is left to the world being torn
        down, and the next backward sends nothing until ``start``."""
        self._group = None
        self._in_flight = []

    def _gradient_final(self, param: nn.Parameter) -> None:
        if self._group is None:
            return  # an earlier micro-batch's backward: the gradient is not final yet
        self._waiting[self._bucket_of[id(param)]] -= 1
        while len(self._in_flight) < len(self.buckets) and self._waiting[len(self._in_flight)] == 0:
            self._send(len(self._in_flight))

    def _flat(self, number: int) -> torch.Tensor:
        """Bucket ``number``'s values as they are handed on: flat, in the sum's dtype, perturbed."""
        flat = torch.cat([self.values(param).reshape(-1) for param in self.buckets[number]]).to(self.dtype)
        self.perturb(number, flat)
        return flat

    def fingerprint(self) -> int:
        """What a sum would hand on now (every bucket, perturbed alike), fingerprinted: a
        replay's, sending nothing."""
        fingerprint = 0
        for number in range(len(self.buckets)):
            fingerprint = combine(fingerprint, bit_sum(self._flat(number)))
        return fingerprint

    def _send(self, number: int) -> None:
        self._first_sent_at = min(self._first_sent_at, time.perf_counter())
        flat = self._flat(number)
        if self.fingerprinting:
            self.handed_fingerprint = combine(self.handed_fingerprint, bit_sum(flat))
        work = None
        if self._error is None:
            try:
                work = self._group.allreduce([flat])
            except RuntimeError as error:  # a peer is gone; raised to the step by ``finish``
                self._error = error
        self._in_flight.append(_InFlight(flat, work))

    def finish(self, wait: Callable, backward_ended: float | None = None) -> SumTimes:
        """Send what backward did not, wait for each bucket in turn (``wait(work)`` raises
        when the step is aborted or past its deadline), and write the sums into the
        gradients. Raises ``CollectiveFailed`` when a bucket could not be sent.
        ``backward_ended``: when backward returned (``time.perf_counter``), if not now."""
        backward_ended = time.perf_counter() if backward_ended is None else backward_ended
        if self._group is None:
            raise RuntimeError("GradientSum.finish without start")
        try:
            while len(self._in_flight) < len(self.buckets):
                self._send(len(self._in_flight))
            if self._error is not None:
                raise CollectiveFailed(f"cross-group gradient sum failed: {self._error}") from self._error
            for number, bucket in enumerate(self.buckets):
                flat, work = self._in_flight[number]
                self._in_flight[number] = None  # its flat copy goes once summed
                wait(work)
                unflatten_into([self.values(param) for param in bucket], flat)
        finally:
            self._group = None
            self._in_flight = []
        ended = time.perf_counter()
        return SumTimes(ended - self._first_sent_at, ended - backward_ended)

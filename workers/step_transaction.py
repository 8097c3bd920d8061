"""One training step as a transaction of a rank with its group and its replicas in the other
groups: compute, sum across groups, vote, then every rank applies the step or every rank
discards it.

1. *Compute*: forward and backward over the rank's micro-batches. Between micro-batches
   the group agrees whether the driver asked to stop (``at_micro_batch``).
2. *Cross-group sum*: the gradients, then a few scalars (loss share, counted tokens, pause
   and requests for the records), summed with the ranks at the same position in every other group
   over the replicate group (``workers.world``). The wait on it can be cut short by the
   driver's abort or the step's deadline (``wait_replicate``). Where the step begins an
   integrity check, the replicas' fingerprints are compared first (``workers.integrity``).
3. *Vote*: every rank of the group gets every rank's ballot, so all decide the same: whether
   every sum succeeded, the step's loss and gradient norm, whether replicas disagreed, and
   whether to stop after this step.
4. *Apply* at the step's learning rate and clipping factor, or *discard*: gradients zeroed
   and the generators rewound to where the step began. A step fails (raises) when this
   rank's sum failed or a peer's did (``StepDiscarded``); it is ``Discarded`` by every rank
   of every group when its loss or norm is not finite or replicas disagreed.

Beside the step, the same parts serve an evaluation's held-out loss (computed as a step's
share is, committing nothing) and the gather of the segment's records across the groups
(``elastic.core.segment_loop``). What the driver asks of the step, and the faults a segment
injects, come in through the rank's control surface (``workers.control_surface``). No Ray here:
the rank actor (``workers.worker``) drives the transaction, and
``tests/test_step_transaction.py`` drives it on gloo process groups alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from elastic.core.data_plan import RankShare, token_rescale
from elastic.core.gradient_clipping import clip_coefficient, global_norm
from elastic.core.integrity import IntegrityMismatch, check_due
from elastic.core.loss_scale import LossScale
from elastic.core.protocol import NonFinite, Phase, RankTimes, SegmentSpec, StepRecord
from elastic.core.topology import counts_loss
from workers import rng
from workers.control_surface import NO_FAULTS, ActivityTracker, ComputeTimer, DriverSignals, FaultPlan
from workers.experts import RoutedLayout, balance_experts, expert_layers, expert_load
from workers.failures import (
    CollectiveAborted,
    CollectiveFailed,
    CollectiveTimedOut,
    StepDiscarded,
    StepInterrupted,
    VoteFailed,
)
from workers.gradient_sum import GradientSum, SumTimes
from workers.integrity import start_check
from workers.model import ModelArgs
from workers.pipeline import Pipeline
from workers.rank_spec import RankSpec
from workers.train_step import (
    Batch,
    MicroBatchLoss,
    accumulate_counted,
    counted_tokens,
    evaluate_counted,
    scale_gradients,
    squared_gradient_norm,
)
from workers.world import World

REPLICATE_POLL_S = 0.001


@dataclass(frozen=True)
class CrossGroupScalars:
    """One position's sums over the groups."""

    loss_share: float
    counted_tokens: float
    pause: float
    records_due: float = 0.0  # the groups' first ranks: any whose records interval is over
    routed_tokens: tuple[float, ...] = ()  # per expert of the expert layers (``RoutedLayout.routed_tokens``)


@dataclass(frozen=True)
class Ballot:
    """One rank's part of its group's vote on a step, sent as one float64 row (``row``, read
    back by ``of_row``): every rank's row has the same width, the routed tokens' places
    included (zeros where the rank counts none)."""

    succeeded: bool
    loss_share: float  # the step's loss, summed over the groups: the rank that counts the loss sends it
    counted_tokens: float  # likewise
    pause: bool
    integrity_mismatch: bool
    grad_sq_norm: float  # this rank's part of the squared gradient norm (``squared_gradient_norm``)
    times: RankTimes
    routed_tokens: tuple[float, ...]  # summed over the groups: a TP row's first rank sends them

    def row(self) -> torch.Tensor:
        return torch.tensor([float(self.succeeded), self.loss_share, self.counted_tokens, float(self.pause),
                             float(self.integrity_mismatch), self.grad_sq_norm, *self.times, *self.routed_tokens],
                            dtype=torch.float64)

    @classmethod
    def of_row(cls, row: list[float]) -> Ballot:
        times_at = 6
        routed_at = times_at + len(RankTimes._fields)
        return cls(row[0] == 1.0, row[1], row[2], row[3] > 0, row[4] > 0, row[5],
                   RankTimes(*row[times_at:routed_at]), tuple(row[routed_at:]))


@dataclass(frozen=True)
class Vote:
    """What every rank of a group decided together about a step."""

    every_rank_succeeded: bool
    loss: float  # the step's loss over the global token count (before ``token_rescale``)
    counted_tokens: int  # the targets that count, over the whole step
    pause: bool
    integrity_mismatch: bool  # some position's replicas disagreed about the state the step began from
    grad_norm: float  # the global gradient norm (after the cross-group sum, one group's parts make it)
    times: tuple[RankTimes, ...]  # by group rank
    routed_tokens: tuple[float, ...] = ()  # the step's, over every rank of every group


@dataclass(frozen=True)
class Committed:
    """A step every rank of the group applied."""

    record: StepRecord
    pause: bool  # the ranks agreed to stop after it
    records_due: bool  # the groups' first ranks send the segment's records after it


@dataclass(frozen=True)
class Discarded:
    """A step every rank of every group discarded, and why: its loss or norm was not finite
    (the same sums everywhere), or replicas disagreed about the state it began from (every
    group has a rank at the position that found it, and the vote tells the others)."""

    nonfinite: NonFinite | None = None
    integrity: IntegrityMismatch | None = None  # this rank's position's finding, if it has one


class StepTransaction:
    """The steps of one rank on the model and optimizer its group built."""

    def __init__(self, rank: RankSpec, world: World, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss: MicroBatchLoss, device: torch.device, activity: ActivityTracker, signals: DriverSignals,
                 stages: Sequence[torch.nn.Module] = ()):
        self.rank = rank
        self.world = world
        self.model = model
        self.optimizer = optimizer
        self.loss = loss
        self.device = device
        self.activity = activity
        self.signals = signals
        # the schedule over the rank's stages, where the group is a pipeline (the next-token form
        # only: the hooks check refuses a batch_loss_fn with stages)
        self.pipeline = (Pipeline(rank.pipeline, rank.pp_index, stages, world.mesh["pp"].get_group(), device,
                                  loss.loss_fn, activity) if stages else None)
        self.compute_timer = ComputeTimer(rank.use_gpu)
        # The expert layers whose load the step sums, records and balances by: the rank's own
        # (a pipeline stage's are some of the model's), in the whole model's places.
        self.experts = expert_layers(model)
        self.routed_layout = routed_layout(model, stages, self.experts)
        self.gradient_sum = GradientSum(model, torch.bfloat16 if rank.replicate_dtype == "bf16" else torch.float32)
        # the global ranks of this rank's group, in group-rank order
        self.group_ranks = tuple(rank.global_rank - rank.group_rank + peer for peer in range(rank.ranks_per_group))
        # Stages hold different parameters: each counts its own toward the gradient norm.
        self.mesh_coordinate = {name: index for name, index in world.mesh_coordinate.items() if name != "pp"}
        # The last stage computes the loss; a TP row's ranks share it, counted by the first.
        self.counts_loss = counts_loss(rank.position, rank.pipeline.pp)
        # The schedule scales these; the optimizer's own lr changes every step, and a heal or
        # restore loads the lr a peer last stepped with.
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        # generator states before the step in progress drew; None between steps
        self._rng_before_step: rng.RngState | None = None
        # fp16's, at the step in progress: the segment's spec gives it at its first step, and each
        # commit moves it on by the rule the driver follows (elastic.core.loss_scale)
        self.loss_scale: LossScale | None = None

    def step(self, spec: SegmentSpec, share: RankShare, batches: Future, records_due: bool,
             faults: FaultPlan = NO_FAULTS) -> Committed | Discarded:
        """Step ``share.step`` of the segment ``spec`` on ``batches`` (the loader's, collated on
        the CPU). ``records_due``: this rank asks for the segment's records to go out after it.
        Raises when the step failed here or on a peer of the group; the step is discarded
        then too."""
        try:
            return self._step(spec, share, batches, records_due, faults)
        except Exception:
            self.discard_uncommitted()
            raise

    def _step(self, spec: SegmentSpec, share: RankShare, batches: Future, records_due: bool,
              faults: FaultPlan) -> Committed | Discarded:
        started = time.perf_counter()
        deadline = started + spec.deadline_s
        step = share.step
        if step == spec.first_step:
            self.loss_scale = spec.loss_scale
        replicate_group = self.world.replicate_group
        check = (start_check(step, self.rank.group, self.model, self.optimizer, replicate_group, self.device)
                 if replicate_group is not None and check_due(step, spec.integrity_every) else None)
        self.activity.set(step, Phase.DATA)
        on_device = [batch.to(self.device) for batch in batches.result()]
        data_s = time.perf_counter() - started
        loss_share, counted, compute_s = self._compute(step, on_device, share.global_tokens, faults)
        comm_started = time.perf_counter()
        self.activity.set(step, Phase.REPLICATE)
        sum_error, mismatch, sum_times = None, None, SumTimes(0.0, 0.0)
        try:
            if check is not None:
                self.wait_replicate(check.work, deadline)
                mismatch = check.verdict(self.rank.position)
            sum_times, crossed = self._sum_across_groups(spec, loss_share, counted, records_due,
                                                         deadline, faults, comm_started)
        except (CollectiveAborted, CollectiveTimedOut, CollectiveFailed) as error:
            # a ballot of every rank's size: the routed tokens' places held with zeros
            sum_error = error
            crossed = CrossGroupScalars(0.0, 0.0, 0.0, routed_tokens=(0.0,) * self.routed_layout.width)
        comm_s = time.perf_counter() - comm_started
        grad_sq_norm = 0.0 if sum_error else squared_gradient_norm(self.model, self.mesh_coordinate)
        times = RankTimes(data_s, compute_s, comm_s, time.perf_counter() - started, *sum_times)
        self.activity.set(step, Phase.VOTE)
        try:
            vote = self._vote(sum_error is None, crossed, mismatch is not None, grad_sq_norm, times)
        except Exception as error:
            raise VoteFailed(f"rank {self.rank.global_rank}: the group's vote on step {step} failed: {error}") from error
        if sum_error is not None:
            raise sum_error
        if not vote.every_rank_succeeded:
            raise StepDiscarded(f"rank {self.rank.global_rank}: step {step} discarded: a peer's cross-group sum failed")
        outcome = self._apply_or_discard(spec, share, vote, mismatch, records_due=crossed.records_due > 0)
        self.activity.set(step, Phase.DONE)
        return outcome

    def _compute(self, step: int, batches: list[Batch], global_tokens: int,
                 faults: FaultPlan) -> tuple[float, float, float]:
        """This rank's share of the step: (loss share, what it counted, its own compute seconds)."""
        self.activity.set(step, Phase.COMPUTE)
        self._rng_before_step = rng.capture(self.rank.use_gpu)
        self.compute_timer.start()

        if self.pipeline is not None:
            # The schedule runs every micro-batch in one call: the group cannot stop inside it
            # (the driver's abort takes effect at the cross-group sum), and the buckets of that
            # sum go out once it has ended.
            loss_share = self.pipeline.loss_share(batches, global_tokens, self.scale)
            if self.world.replicate_group is not None:
                self.gradient_sum.start(self.world.replicate_group)
            return loss_share, counted_tokens(batches), faults.after_compute(self.compute_timer.seconds())

        def before_micro_batch(index: int) -> None:
            self.at_micro_batch(step, index)
            self.gradient_sum.before_micro_batch(index, len(batches), self.world.replicate_group)

        loss_share, counted = accumulate_counted(self.model, self.loss, batches, global_tokens, before_micro_batch,
                                                 self.experts, self.scale)
        return loss_share, counted, faults.after_compute(self.compute_timer.seconds())

    def _sum_across_groups(self, spec: SegmentSpec, loss_share: float, counted: float, records_due: bool,
                           deadline: float, faults: FaultPlan, backward_ended: float
                           ) -> tuple[SumTimes, CrossGroupScalars]:
        """The gradients' sum (begun in backward) to its end, then the step's scalars, summed
        with this position's ranks in the other groups."""
        faults.before_cross_group_sum()
        sum_times = SumTimes(0.0, 0.0)
        if self.world.replicate_group is not None:
            sum_times = self.gradient_sum.finish(lambda work: self.wait_replicate(work, deadline), backward_ended)
        crossed = self._cross_group_scalars(loss_share, counted, self.signals.pause_requested(spec.attempt), records_due,
                                            deadline)
        # An abort the driver sent (a step failed elsewhere) ends this group's run after
        # this step, which every contribution reached: a group that stops earlier than
        # another leaves the other's next cross-group sum to be aborted and discarded.
        return sum_times, replace(crossed, pause=crossed.pause + float(self.signals.abort_requested()))

    def _apply_or_discard(self, spec: SegmentSpec, share: RankShare, vote: Vote, mismatch: IntegrityMismatch | None,
                          records_due: bool) -> Committed | Discarded:
        """What every rank of every group does with a step whose sums all succeeded: apply it
        at its learning rate and clipping factor, or discard it when replicas disagreed or
        its loss or norm is not finite (the same sums everywhere)."""
        rescale = token_rescale(share.global_tokens, vote.counted_tokens)
        loss, norm = vote.loss * rescale, vote.grad_norm * rescale / self.scale
        if vote.integrity_mismatch or not (math.isfinite(loss) and math.isfinite(norm)):
            self.discard_uncommitted()
            if vote.integrity_mismatch:
                return Discarded(integrity=mismatch)
            overflow = self.loss_scale is not None and math.isfinite(loss) and not self.loss_scale.exhausted
            if overflow:  # every rank of every group saw the same sums: each halves its scale alike
                self.loss_scale = self.loss_scale.after_overflow()
            return Discarded(nonfinite=NonFinite(share.step, loss, norm, overflow))
        clip_scale = clip_coefficient(norm, spec.clip_grad_norm)
        self._apply(spec.schedule.factor(share.step), clip_scale * rescale / self.scale)
        if self.loss_scale is not None:
            self.loss_scale = self.loss_scale.after_commit()
        balance_experts(self.experts, self.routed_layout, vote.routed_tokens)
        record = StepRecord(share.step, self.rank.group, loss, norm, clip_scale, self.optimizer.param_groups[0]["lr"],
                            share.global_samples, share.group_samples, share.next_cursor, self.group_ranks,
                            vote.times, counted=vote.counted_tokens,
                            expert_load=expert_load(self.routed_layout, vote.routed_tokens))
        return Committed(record, vote.pause, records_due)

    def at_micro_batch(self, step: int, index: int) -> None:
        """Between micro-batches the group agrees whether to stop, over a CPU all-reduce of
        the abort flag: every rank of the group is at this same boundary (FSDP keeps them in
        step), so they all stop here or all go on, and none waits in a collective its peers
        left. Nothing here waits for the device."""
        self.activity.set(step, Phase.COMPUTE, index)
        if index == 0:
            return
        stop = torch.tensor([int(self.signals.abort_requested())])
        if self.world.control_group is not None:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=self.world.control_group)
        if stop.item():
            raise StepInterrupted(f"rank {self.rank.global_rank}: step {step} interrupted before micro-batch {index}")

    def wait_replicate(self, work, deadline: float) -> None:
        """Wait until a cross-group collective has finished on the device, the driver aborts
        the step, or the step's deadline passes.

        ``is_completed`` asks NCCL's CUDA events whether the device is done; the future of
        an NCCL work is already complete once the kernel is enqueued, so waiting on it would
        release nothing.
        """
        rank = self.rank.global_rank
        try:
            while not work.is_completed():
                if self.signals.abort_requested():
                    raise CollectiveAborted(f"rank {rank}: cross-group collective aborted by the driver")
                if time.perf_counter() > deadline:
                    raise CollectiveTimedOut(f"rank {rank}: cross-group collective still open at the step's deadline")
                self.signals.wait(REPLICATE_POLL_S)
            work.wait()
        except (CollectiveAborted, CollectiveTimedOut):
            raise
        except RuntimeError as error:
            raise CollectiveFailed(f"rank {rank}: cross-group collective failed: {error}") from error

    def _cross_group_scalars(self, loss_share: float, counted: int, pause_seen: bool, records_due: bool,
                             deadline: float) -> CrossGroupScalars:
        """The loss shares, counted tokens, pause requests and records due of this position
        summed over the groups, in float64: identical at this position in every group."""
        scalars = torch.tensor([loss_share, float(counted), float(pause_seen), float(records_due),
                                *self.routed_layout.routed_tokens(self.experts)], dtype=torch.float64)
        if self.world.replicate_group is not None:
            on_device = scalars.to(self.device)
            self.wait_replicate(self.world.replicate_group.allreduce([on_device]), deadline)
            scalars = on_device.cpu()
        values = scalars.tolist()
        return CrossGroupScalars(*values[:4], routed_tokens=tuple(values[4:]))

    def _vote(self, succeeded: bool, crossed: CrossGroupScalars, mismatch: bool, grad_sq_norm: float,
              times: RankTimes) -> Vote:
        """Every rank of the group gets every rank's ``Ballot`` (one all-gather on the CPU
        group) and adds them up in rank order, so all decide the same: apply or discard, and
        whether to stop after this step (a pause every group saw the same, or an abort)."""
        counts_loss = self.counts_loss
        ballot = Ballot(
            succeeded, crossed.loss_share if counts_loss else 0.0, crossed.counted_tokens if counts_loss else 0.0,
            crossed.pause > 0, mismatch, grad_sq_norm, times,
            # A TP row's ranks route the same tokens: its first counts them.
            crossed.routed_tokens if self.rank.tp_index == 0 else (0.0,) * len(crossed.routed_tokens))
        row = ballot.row()
        if self.world.control_group is None:
            rows = [row]
        else:
            rows = [torch.empty_like(row) for _ in self.group_ranks]
            dist.all_gather(rows, row, group=self.world.control_group)
        ballots = [Ballot.of_row(row) for row in torch.stack(rows).tolist()]
        return Vote(
            every_rank_succeeded=all(ballot.succeeded for ballot in ballots),
            loss=sum(ballot.loss_share for ballot in ballots),
            counted_tokens=round(sum(ballot.counted_tokens for ballot in ballots)),
            pause=any(ballot.pause for ballot in ballots),
            integrity_mismatch=any(ballot.integrity_mismatch for ballot in ballots),
            grad_norm=global_norm({group_rank: ballot.grad_sq_norm for group_rank, ballot in enumerate(ballots)}),
            times=tuple(ballot.times for ballot in ballots),
            routed_tokens=tuple(map(sum, zip(*(ballot.routed_tokens for ballot in ballots)))),
        )

    @property
    def scale(self) -> float:
        """What the step's backward multiplied the loss by: fp16's loss scale, else 1."""
        return self.loss_scale.value if self.loss_scale is not None else 1.0

    def _apply(self, lr_scale: float, grad_scale: float) -> None:
        scale_gradients(self.model, grad_scale)
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base_lr * lr_scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self._rng_before_step = None

    def discard_uncommitted(self) -> None:
        """Back to the committed state: the step's gradients zeroed, its draws undone."""
        if self._rng_before_step is not None:
            rng.restore(self._rng_before_step)
            self._rng_before_step = None
        self.gradient_sum.abandon()
        self.optimizer.zero_grad(set_to_none=False)

    def held_out_loss(self, step: int, batches: list[Batch], global_tokens: int) -> tuple[float, float, float]:
        """This rank's share of the held-out loss of the committed state, what it counted, and
        its compute seconds: computed as a step's share is, with the same agreement to stop,
        committing nothing."""
        self.activity.set(step, Phase.COMPUTE)
        # The held-out loss leaves the training generators where they were.
        with torch.random.fork_rng(devices=[self.device] if self.rank.use_gpu else []):
            self.compute_timer.start()
            if self.pipeline is not None:
                loss_share, counted = self.pipeline.held_out_loss_share(batches, global_tokens), counted_tokens(batches)
            else:
                loss_share, counted = evaluate_counted(self.model, self.loss, batches, global_tokens,
                                                       on_micro_batch=lambda index: self.at_micro_batch(step, index))
            compute_s = self.compute_timer.seconds()
        self.activity.set(step, Phase.DONE)
        return loss_share, counted, compute_s

    def gather_across_groups(self, rows: list[list[float]], deadline: float) -> np.ndarray | None:
        """The ``rows`` of this position's rank in every group, ``[replica rank, row, value]``; None when
        the gather fails: a peer group is gone, and the next cross-group sum fails and ends
        the segment as any failed sum does."""
        replicate_group = self.world.replicate_group
        own = torch.tensor(rows, dtype=torch.float64).to(self.device)
        gathered = [torch.empty_like(own) for _ in range(replicate_group.size())]
        try:
            self.wait_replicate(replicate_group.allgather([gathered], [own]), deadline)
        except (CollectiveAborted, CollectiveTimedOut, CollectiveFailed):
            return None
        return torch.stack(gathered).cpu().numpy()


def routed_layout(model: torch.nn.Module, stages: Sequence[torch.nn.Module], held: Sequence) -> RoutedLayout:
    """The places of the whole model's expert layers in a step's routed counts: from the
    reference model's arguments, which every stage keeps whole; a custom model's, from the
    expert layers it holds (it has no stages with experts: each would count its own)."""
    args = getattr(stages[0] if stages else model, "args", None)
    return RoutedLayout.of(args) if isinstance(args, ModelArgs) else RoutedLayout.of_held(held)

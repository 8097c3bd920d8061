"""One training step as a transaction of a rank with its group and its replicas in the other
groups: compute, sum across groups, vote, then every rank applies the step or every rank
discards it.

1. *Compute*: forward and backward over the rank's micro-batches. Between micro-batches
   the group agrees whether the driver asked to stop (``at_micro_batch``).
2. *Cross-group sum*: the gradients, then one row of a few values (loss share, counted
   tokens, pause and requests for the records, the tokens routed to each expert), summed
   with the ranks at the same position in every other group over the replicate group
   (``workers.world``). The wait on it can be cut short by the driver's abort or the step's
   deadline (``wait_replicate``). Where the step begins an integrity check, the replicas'
   fingerprints are compared first (``workers.integrity``).
3. *Vote*: every rank of the group gets every rank's ballot, so all decide the same: whether
   every sum succeeded, the step's loss and gradient norm, whether replicas disagreed, and
   whether to stop after this step.
4. *Apply* at the step's learning rate and clipping factor, or *discard*: gradients zeroed
   and the generators rewound to where the step began. A step fails (raises) when this
   rank's sum failed or a peer's did (``StepDiscarded``); it is ``Discarded`` by every rank
   of every group when its loss or norm is not finite or replicas disagreed.

Each feature the step carries besides its gradients (the loss, the agreement to go on, the
integrity check, the gradient norm, the timing, fp16's loss scale, the experts' balance) is a
contribution (``workers.step_contributions``): it declares its named slots in the row and the
ballot, whose places are laid out once from them, reads the vote, and acts on the commit or
the discard.

Beside the step, the same parts serve an evaluation's held-out loss (computed as a step's
share is, committing nothing) and the gather of the segment's records across the groups
(``elastic.core.segment_loop``). What the driver asks of the step, and the faults a segment
injects, come in through the rank's control surface (``workers.control_surface``). No Ray here:
the rank actor (``workers.worker``) drives the transaction, and
``tests/test_step_transaction.py`` drives it on gloo process groups alone.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np
import torch
import torch.distributed as dist

from elastic.core.data_plan import RankShare, token_rescale
from elastic.core.gradient_clipping import clip_coefficient
from elastic.core.protocol import (
    GroupRecords,
    NonFinite,
    Phase,
    RankTimes,
    SegmentRecords,
    SegmentSpec,
    StepRecord,
    record_row,
)
from elastic.core.segment_loop import SendRecords
from elastic.core.topology import counts_loss
from workers import rng
from workers.control_surface import NO_FAULTS, ActivityTracker, ComputeTimer, DriverSignals, FaultPlan
from workers.failures import (
    CollectiveAborted,
    CollectiveFailed,
    CollectiveTimedOut,
    StepDiscarded,
    StepInterrupted,
    VoteFailed,
)
from workers.gradient_sum import GradientSum, SumTimes, trained
from workers.outer_sync import OuterSync
from workers.pipeline import Pipeline
from workers.rank_spec import RankSpec
from workers.step_contributions import (
    Agreement,
    Committed,
    ComputeReplay,
    Contribution,
    CrossGroupTraffic,
    Discarded,
    ExpertBalance,
    GradientNorm,
    IntegrityCheck,
    JoiningRank,
    LossScaling,
    RowLayout,
    StepLoss,
    Timing,
    Values,
)
from workers.train_step import (
    Batch,
    MicroBatchLoss,
    accumulate_counted,
    counted_tokens,
    evaluate_counted,
    scale_gradients,
)
from workers.world import World

# How often a wait asks whether a cross-group collective has ended.
REPLICATE_POLL_S = 0.001
# A rendezvous's wait, whose end is signalled, still looks again this often: a lost signal costs
# at most this, not the step's deadline.
SIGNALLED_RECHECK_S = 0.1


class _Rendezvous:
    """A replicate group's rendezvous (a future) waited for as a collective's work is; its end
    is signalled (``ended``, set on the rendezvous's own thread), so its wait need not poll."""

    def __init__(self, joining: Future):
        self.joining = joining
        self.ended = threading.Event()
        joining.add_done_callback(lambda _: self.ended.set())

    def is_completed(self) -> bool:
        return self.joining.done()

    def wait(self) -> None:
        self.joining.result()


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
        self.gradient_sum = GradientSum(trained(model), torch.bfloat16 if rank.replicate_dtype == "bf16" else torch.float32)
        # DiLoCo's rounds (``sync.mode``): each group steps as a learner, and the gradients cross
        # groups only as a round's pseudo-gradients (``workers.outer_sync``)
        self.outer = (OuterSync(rank.outer_rounds, model, optimizer, whole_model=not stages)
                      if rank.outer_rounds is not None else None)
        # the global ranks of this rank's group, in group-rank order
        self.group_ranks = tuple(rank.global_rank - rank.group_rank + peer for peer in range(rank.ranks_per_group))
        # The schedule scales these; the optimizer's own lr changes every step, and a heal or
        # restore loads the lr a peer last stepped with.
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        # generator states before the step in progress drew; None between steps
        self._rng_before_step: rng.RngState | None = None
        # What each feature adds to the step (``workers.step_contributions``), in the order of
        # their slots in the two rows: the cross-group sum's keeps the order it always had.
        self.step_loss = StepLoss(counts_loss(rank.position, rank.layout.pp))
        self.agreement = Agreement(signals)
        self.integrity = IntegrityCheck(rank.group, rank.position, model, optimizer, device)
        self.replay = ComputeReplay(rank.group, rank.group_rank, rank.position, rank.layout)
        self.gradient_norm = GradientNorm(model, world.mesh_coordinate, per_learner=self.outer is not None)
        self.timing = Timing()
        self.traffic = CrossGroupTraffic()
        self.expert_balance = ExpertBalance(model, stages, first_of_tp_row=rank.tp_index == 0)
        self.loss_scaling = LossScaling()
        self.joining = JoiningRank(model, optimizer, self.expert_balance, self._apply)
        self.contributions: tuple[Contribution, ...] = (self.step_loss, self.agreement, self.integrity,
                                                        self.gradient_norm, self.timing, self.expert_balance,
                                                        self.loss_scaling, self.joining, self.traffic, self.replay)
        self.sum_layout = RowLayout({part: part.cross_group_slots for part in self.contributions})
        self.ballot_layout = RowLayout({part: part.ballot_slots for part in self.contributions})

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
        self.loss_scaling.begin(spec, step)
        if self.outer is not None and (self.outer.round_start is None or self.outer.rounds.at_boundary(step)):
            self.outer.begin_round()  # a round's first step, or a learner's first in a round it joined
        self.agreement.begin(spec.attempt, records_due,
                             may_pause=self.outer is None or self.outer.rounds.ends_at(step))
        self.integrity.start(step, spec.integrity_every, self.world.cross_group)
        replays = self.replay.begin(step, spec.replay_every, spec.groups)
        self.gradient_sum.perturb = lambda bucket, flat: faults.perturb(step, bucket, flat)
        self.gradient_sum.fingerprinting = replays is not None
        self.activity.set(step, Phase.DATA)
        loaded = batches.result()
        on_device = [batch.to(self.device) for batch in loaded.own]
        data_s = time.perf_counter() - started
        if self.joining.idle:
            self.step_loss.share, self.step_loss.counted, compute_s = self._idle(step, deadline)
        else:
            if replays is not None:
                self.replay.replayed = self._replayed(step, [batch.to(self.device) for batch in loaded.replayed],
                                                      share.global_tokens)
            self.step_loss.share, self.step_loss.counted, compute_s = self._compute(step, on_device,
                                                                                    share.global_tokens, faults)
        comm_started = time.perf_counter()
        self.activity.set(step, Phase.REPLICATE)
        sum_error, sum_times = None, SumTimes(0.0, 0.0)
        if self.outer is not None:  # a learner's gradients are its own: their norm goes into the sum
            self.gradient_norm.measure(summed=True)
        try:
            self.integrity.compare(lambda work: self.wait_replicate(work, deadline))
            sum_times, sums = self._sum_across_groups(deadline, faults, comm_started)
        except (CollectiveAborted, CollectiveTimedOut, CollectiveFailed) as error:
            # a ballot of every rank's size: the sums' places held with zeros
            sum_error, sums = error, self.sum_layout.zeros()
        comm_s = time.perf_counter() - comm_started
        self.agreement.succeeded = sum_error is None
        if self.outer is None:
            self.gradient_norm.measure(summed=sum_error is None)
        self.timing.own = RankTimes(data_s, compute_s, comm_s, time.perf_counter() - started, *sum_times)
        self.traffic.own = self._cross_group_bytes(step)
        self.activity.set(step, Phase.VOTE)
        try:
            self._vote(sums)
        except Exception as error:
            raise VoteFailed(f"rank {self.rank.global_rank}: the group's vote on step {step} failed: {error}") from error
        if sum_error is not None:
            raise sum_error
        if not self.agreement.every_rank_succeeded:
            raise StepDiscarded(f"rank {self.rank.global_rank}: step {step} discarded: a peer's cross-group sum failed")
        outcome = self._apply_or_discard(spec, share, faults)
        self.activity.set(step, Phase.DONE)
        return outcome

    def _compute(self, step: int, batches: list[Batch], global_tokens: int,
                 faults: FaultPlan) -> tuple[float, float, float]:
        """This rank's share of the step: (loss share, what it counted, its own compute seconds)."""
        self.activity.set(step, Phase.COMPUTE)
        self._rng_before_step = rng.capture(self.rank.use_gpu)
        self.compute_timer.start()
        scale = self.loss_scaling.value

        if self.pipeline is not None:
            # The schedule runs every micro-batch in one call: the group cannot stop inside it
            # (the driver's abort takes effect at the cross-group sum), and the buckets of that
            # sum go out once it has ended.
            loss_share = self.pipeline.loss_share(batches, global_tokens, scale)
            if self.gradient_group is not None:
                self.gradient_sum.start(self.gradient_group)
            return loss_share, counted_tokens(batches), faults.after_compute(self.compute_timer.seconds())

        def before_micro_batch(index: int) -> None:
            self.at_micro_batch(step, index)
            self.gradient_sum.before_micro_batch(index, len(batches), self.gradient_group)

        loss_share, counted = accumulate_counted(self.model, self.loss, batches, global_tokens, before_micro_batch,
                                                 self.expert_balance.held, scale)
        return loss_share, counted, faults.after_compute(self.compute_timer.seconds())

    def _replayed(self, step: int, batches: list[Batch], global_tokens: int) -> int:
        """A spot check: the next group's share of the step computed here, from the same state
        (every group holds it), and the fingerprint of the gradients it would hand the
        cross-group sum; then the gradients zeroed for the rank's own share. The generators
        are left as they were, and the experts' counts are the own share's first micro-batch's
        to set."""
        with torch.random.fork_rng(devices=[self.device] if self.rank.use_gpu else []):
            if self.pipeline is not None:
                self.pipeline.loss_share(batches, global_tokens, self.loss_scaling.value)
            else:
                accumulate_counted(self.model, self.loss, batches, global_tokens,
                                   lambda index: self.at_micro_batch(step, index), self.expert_balance.held,
                                   self.loss_scaling.value)
        fingerprint = self.gradient_sum.fingerprint()
        self.optimizer.zero_grad(set_to_none=False)
        return fingerprint

    def _idle(self, step: int, deadline: float) -> tuple[float, float, float]:
        """A joining rank's share while it catches up: no samples, zeros in the sums. One that
        kept as many updates as it may waits for its state first."""
        self.activity.set(step, Phase.COMPUTE)
        self._rng_before_step = rng.capture(self.rank.use_gpu)
        catching_up = self.joining.catching_up
        if catching_up is not None:
            catching_up.check()
            if catching_up.must_wait():
                catching_up.state(max(0.0, deadline - time.perf_counter()))
        self.expert_balance.idle()
        if self.gradient_group is not None:
            self.gradient_sum.start(self.gradient_group)
        return 0.0, 0, 0.0

    def _cross_group_bytes(self, step: int) -> int:
        """What this rank hands the cross-group sums in ``step``: the row, the gradients' buckets
        or, where DiLoCo's outer step follows, the pseudo-gradients' (sent after the vote)."""
        if self.world.replicate_group is None:
            return 0
        row = self.sum_layout.width * 8  # float64
        if self.outer is None:
            return row + self.gradient_sum.payload_bytes
        return row + self.outer.handed_bytes(step, self.world.replicate_group.size())

    @property
    def gradient_group(self):
        """The process group the step's gradients are summed over: the replicate group, but for
        DiLoCo's learners (none), and for a rank alone at its position (none)."""
        return self.world.cross_group if self.outer is None else None

    def _sum_across_groups(self, deadline: float, faults: FaultPlan,
                           backward_ended: float) -> tuple[SumTimes, dict[Contribution, Values]]:
        """The gradients' sum (begun in backward) to its end, then the contributions' row,
        summed with this position's ranks in the other groups in float64: identical at this
        position in every group."""
        faults.before_cross_group_sum()
        replicate_group = self.world.cross_group
        sum_times = SumTimes(0.0, 0.0)
        if self.gradient_group is not None:
            sum_times = self.gradient_sum.finish(lambda work: self.wait_replicate(work, deadline), backward_ended)
            self.replay.own = self.gradient_sum.handed_fingerprint
        row = self.sum_layout.row({part: part.summand() for part in self.contributions})
        if replicate_group is not None:
            on_device = row.to(self.device)
            self.wait_replicate(replicate_group.allreduce([on_device]), deadline)
            row = on_device.cpu()
        # An abort the driver sent (a step failed elsewhere) ends this group's run after
        # this step, which every contribution reached: a group that stops earlier than
        # another leaves the other's next cross-group sum to be aborted and discarded.
        self.agreement.aborted = self.signals.abort_requested()
        return sum_times, self.sum_layout.read(row.tolist())

    def _vote(self, sums: dict[Contribution, Values]) -> None:
        """Every rank of the group gets every rank's ballot (one all-gather on the CPU group),
        and each contribution reads them in rank order, so all decide the same: apply or
        discard, and whether to stop after this step (a pause every group saw the same, or an
        abort)."""
        row = self.ballot_layout.row({part: part.ballot(sums[part]) for part in self.contributions})
        if self.world.control_group is None:
            rows = [row]
        else:
            rows = [torch.empty_like(row) for _ in self.group_ranks]
            dist.all_gather(rows, row, group=self.world.control_group)
        ballots = [self.ballot_layout.read(row) for row in torch.stack(rows).tolist()]
        for part in self.contributions:
            part.after_vote([ballot[part] for ballot in ballots])

    def _apply_or_discard(self, spec: SegmentSpec, share: RankShare, faults: FaultPlan) -> Committed | Discarded:
        """What every rank of every group does with a step whose sums all succeeded: apply it
        at its learning rate and clipping factor, or discard it when replicas disagreed or
        its loss or norm is not finite (the same sums everywhere). Each contribution then acts
        on the outcome and fills its part of it."""
        rescale = token_rescale(share.global_tokens, self.step_loss.counted_tokens)
        # a DiLoCo learner's gradient is the mean over its own group's targets
        grad_rescale = (rescale if self.outer is None
                        else token_rescale(share.global_tokens, self.step_loss.group_counted))
        scale = self.loss_scaling.value
        loss, norm = self.step_loss.loss * rescale, self.gradient_norm.norm * grad_rescale / scale
        finite = math.isfinite(loss) and math.isfinite(norm) and self.gradient_norm.learners_finite
        if self.integrity.disagreed or self.replay.disagreed or not finite:
            self.discard_uncommitted()
            found = self.integrity.disagreed or self.replay.disagreed
            discarded = Discarded(nonfinite=None if found else NonFinite(share.step, loss, norm))
            for part in self.contributions:
                discarded = part.on_discard(discarded)
            return discarded
        clip_scale = clip_coefficient(norm, spec.clip_grad_norm)
        lr_scale, grad_scale = spec.schedule.factor(share.step), clip_scale * grad_rescale / scale
        if self.joining.commit(lr_scale, grad_scale, self.expert_balance.routed):
            self._apply(lr_scale, grad_scale)
        self._rng_before_step = None
        outer_sum = SumTimes(0.0, 0.0)
        if self.outer is not None:
            self.outer.committed(self.step_loss.group_counted)
            outer_sum = self._outer_steps(share.step, spec.deadline_s, faults)
        record = StepRecord(share.step, self.rank.group, loss, norm, clip_scale, self.optimizer.param_groups[0]["lr"],
                            share.global_samples, share.group_samples, share.next_cursor, self.group_ranks,
                            times=(), counted=self.step_loss.counted_tokens,  # times: ``Timing``'s
                            outer_step=self.outer is not None and bool(self.outer.rounds.syncs_after(share.step)),
                            outer_sum_s=outer_sum.total_s, outer_sum_exposed_s=outer_sum.exposed_s)
        for part in self.contributions:
            record = part.on_commit(record)
        return Committed(record, self.agreement.pause, self.agreement.records_due, self.joining.everyone_caught_up)

    def _outer_steps(self, step: int, deadline_s: float, faults: FaultPlan) -> SumTimes:
        """DiLoCo's outer steps after the step's inner update (``OuterSync.after_update``): each
        of their collectives awaited within the step's deadline and the driver's abort (and
        where the fault plan kills the rank inside one, as it begins)."""
        deadline = time.perf_counter() + deadline_s
        if self.outer.rounds.syncs_after(step):
            faults.in_outer_step()
        return self.outer.after_update(step, self.world.cross_group, self.world.outer_cross_group,
                                       lambda work: self.wait_replicate(work, deadline))

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

    def enter_replicas(self, spec: SegmentSpec) -> None:
        """Be in the cross-group groups of the segment's build (``SegmentSpec.replicas_build``),
        over the segment's groups, before its first step: the rank rebuilds them itself,
        touching only its own position's, with no call of the driver's; a rank that left them
        (its step failed) or holds an older build's joins the new one. Bounded as a
        cross-group wait is (``wait_replicate``: the driver's abort, the step's deadline); a
        rendezvous given up is left to end on its own thread."""
        if self.world.replicas_build == spec.replicas_build:
            return
        self.activity.set(spec.first_step, Phase.REPLICATE)
        joining = self.world.joining_replicas(spec.replicas_build, spec.groups.index(self.rank.group),
                                              len(spec.groups))
        try:
            self.wait_replicate(_Rendezvous(joining), time.perf_counter() + spec.deadline_s)
        except BaseException:
            self.world.give_up_replicas(joining)
            raise
        self.world.take_replicas(joining.result())

    def wait_replicate(self, work, deadline: float) -> None:
        """Wait until a cross-group collective has finished on the device, the driver aborts
        the step, or the step's deadline passes.

        A collective's wait polls: ``is_completed`` asks NCCL's CUDA events whether the device
        is done (the future of an NCCL work is already complete once the kernel is enqueued, so
        waiting on it would release nothing), and a completion signalled from gloo's worker
        thread runs Python there, under the GIL, between buckets (tried: the paced 4-rank step
        of ``bench/failure_cost.py`` took 0.85 s against 0.66 s polling, one run each).
        A rendezvous's end is signalled (``_Rendezvous.ended``) and the rank sleeps until it or an abort
        comes: that wait lasts as long as the slowest replica takes to arrive, and a 1 ms poll
        cost a rank waiting 5 s for its replicas about 60 ms of CPU (``bench/failure_cost.py``).
        """
        rank = self.rank.global_rank
        ended = work.ended if isinstance(work, _Rendezvous) else None
        try:
            while not work.is_completed():
                if self.signals.abort_requested():
                    raise CollectiveAborted(f"rank {rank}: cross-group collective aborted by the driver")
                left = deadline - time.perf_counter()
                if left < 0:
                    raise CollectiveTimedOut(f"rank {rank}: cross-group collective still open at the step's deadline")
                if ended is None:
                    self.signals.wait(REPLICATE_POLL_S)
                    continue
                ended.clear()  # set by an abort of an attempt already over, read above
                if not work.is_completed():
                    self.signals.wait_for(ended, min(left, SIGNALLED_RECHECK_S))
            work.wait()
        except (CollectiveAborted, CollectiveTimedOut):
            raise
        except RuntimeError as error:
            raise CollectiveFailed(f"rank {rank}: cross-group collective failed: {error}") from error

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

    def records_message(self, send: SendRecords, deadline: float) -> GroupRecords | SegmentRecords | None:
        """What the group's first rank sends of its records: gathered, every group's, from the
        segment's first group (None from the others); else, or when the gather fails, its group's own."""
        own = GroupRecords(self.rank.group, send.records)
        if not send.gathered:
            return own
        rows = self.gather_across_groups([record_row(record) for record in send.records], deadline)
        if rows is None:  # a peer group is gone: the group's own steps still reach the driver
            return own
        return SegmentRecords.from_rows(send.records, rows) if self.world.replica_rank == 0 else None

    def gather_across_groups(self, rows: list[list[float]], deadline: float) -> np.ndarray | None:
        """The ``rows`` of this position's rank in every group, ``[replica rank, row, value]``; None when
        the gather fails: a peer group is gone, and the next cross-group sum fails and ends
        the segment as any failed sum does."""
        replicate_group = self.world.cross_group
        own = torch.tensor(rows, dtype=torch.float64).to(self.device)
        gathered = [torch.empty_like(own) for _ in range(replicate_group.size())]
        try:
            self.wait_replicate(replicate_group.allgather([gathered], [own]), deadline)
        except (CollectiveAborted, CollectiveTimedOut, CollectiveFailed):
            return None
        return torch.stack(gathered).cpu().numpy()


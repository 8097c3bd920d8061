"""The rank actor: one process per GPU (or CPU slot) running its replica group's share.

Each replica group is its own torch.distributed world (the default process group, with the
group's 2-D ``(shard, tp)`` mesh on it), rendezvousing on the driver's TCPStore under a
generation prefix. Across groups, ranks at the same position sum gradients over a
*replicate* process group built directly on the store, outside the default world, so it can
be torn down and rebuilt when membership changes without touching the group's own world.

Ranks step on their own during a *run* (``run``): each plans its share of every step from
the run's spec with the driver's own pure code, reads the next step's samples while the
current one computes, and decides each step with its group in a vote after the cross-group
sum. Every rank of a group applies the step (at the step's learning rate and clipping
factor) or every rank discards it (and rewinds its generators). The driver is not on the
step's path: it watches the groups' records and acts at failures and boundaries.

Methods in the ``control`` concurrency group run on a second thread, so the driver can
probe, pause or abort a rank whose training thread is busy or stuck; ``finish_checkpoint`` waits for a
background upload on a third, while training goes on.
"""

from __future__ import annotations

import datetime
import math
import os
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import ray
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from checkpointing.healing import export_local_state, import_local_state
from checkpointing.rank_io import RankCheckpointIO, UploadResult
from workers import rng
from elastic.core.data_plan import DataCursor, RankShare, rank_share, token_rescale
from elastic.core.gradient_clipping import clip_coefficient, global_norm
from elastic.core.integrity import IntegrityMismatch, check_due
from elastic.core.memory_tier import Holdings
from elastic.core.protocol import (
    BuildReport,
    EvalRequest,
    GroupProgress,
    HookFailed,
    NonFinite,
    Progress,
    RankTimes,
    RunEnd,
    RunMessage,
    RunRecords,
    RunSpec,
    StepRecord,
    StepReport,
    record_row,
)
from workers.failures import (
    CollectiveAborted,
    CollectiveFailed,
    CollectiveTimedOut,
    StepDiscarded,
    StepInterrupted,
    VoteFailed,
    classify,
    describe_failure,
    raised_in_collective,
)
from workers.integrity import start_check
from workers.memory_tier import MemoryTier, from_wire
from workers.keyed_store import KeyedStore
from workers.rank_spec import RankSpec
from workers.train_step import (
    accumulate_gradients,
    collate,
    counted_tokens,
    evaluate_loss,
    scale_gradients,
    squared_gradient_norm,
    sum_across_groups,
)

REPLICATE_POLL_S = 0.001
CPU = torch.device("cpu")

warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


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


def abort_process_groups_on_gpu(group=None) -> None:
    """Abort NCCL communicators instead of destroying them: a destroy waits for the work in
    flight, which never ends when a peer is gone, and keeps its GPU buffers meanwhile."""
    dist.distributed_c10d._abort_process_group(group)


@dataclass(frozen=True)
class CrossGroupScalars:
    """One position's sums over the groups."""

    loss_share: float
    counted_tokens: float
    pause: float
    report: float = 0.0  # the groups' first ranks: any whose report interval is over


@dataclass(frozen=True)
class Vote:
    """What every rank of a group decided together about a step."""

    every_rank_succeeded: bool
    loss: float  # the step's loss over the global token count (before ``token_rescale``)
    counted_tokens: int  # the targets that count, over the whole step
    pause: bool
    integrity_mismatch: bool  # some position's replicas disagreed about the state the step began from
    grad_norm: float  # the global gradient norm (after the cross-group sum, one group's parts make it)
    times: tuple[tuple[float, float, float, float], ...]  # by group rank: data, compute, comm, wall seconds


@dataclass(frozen=True)
class Discarded:
    """A step every rank of every group discarded, and why: its loss or norm was not finite
    (the same sums everywhere), or replicas disagreed about the state it began from (every
    group has a rank at the position that found it, and the vote tells the others)."""

    nonfinite: NonFinite | None = None
    integrity: IntegrityMismatch | None = None  # this rank's position's finding, if it has one


def load_hooks(pickled_hooks: bytes):
    """The user's hooks, unpickled by the rank, not by Ray as it creates the actor: an error
    here (code the ranks cannot import) is the hooks' own, and stops the run."""
    try:
        return ray.cloudpickle.loads(pickled_hooks)
    except ImportError as error:
        raise ImportError(f"{error}: the ranks cannot import the code that defines the hooks; ship it with the job "
                          "(ray job submit --working-dir, or runtime_env py_modules)") from error


class RankWorker:
    def __init__(self, spec: RankSpec, pickled_hooks: bytes):
        self.pickled_hooks = pickled_hooks
        self.hooks = None  # loaded by the first build (a spare's, ahead by ``warm``)
        self.device = torch.device("cuda", 0) if spec.use_gpu else torch.device("cpu")
        if spec.use_gpu:
            torch.cuda.set_device(self.device)
            # A timed-out NCCL collective aborts its communicator and raises here, instead of
            # the watchdog killing the process (mode 1): the driver, not NCCL, decides who is
            # evicted, and a rank that timed out waiting on a dead peer is not the culprit.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        else:
            torch.set_num_threads(1)
        self.compute_timer = ComputeTimer(spec.use_gpu)
        self.replicate_dtype = torch.bfloat16 if spec.replicate_dtype == "bf16" else torch.float32
        self.timeout = datetime.timedelta(seconds=spec.collective_timeout_s)
        self.store = KeyedStore(dist.TCPStore(
            spec.store_host, spec.store_port, is_master=False, timeout=self.timeout, wait_for_workers=False
        ), spec.store_secret)
        self.model = None
        self.optimizer = None
        self.replicate_group = None
        self.replica_rank = 0
        self.control_group = None
        # generator states before the step in progress drew; None between steps
        self._rng_before_step: rng.RngState | None = None
        self._pause_run = -1
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader")
        self._progress_lock = threading.Lock()
        self._module_entries = 0
        self._abort = threading.Event()
        self._abort_attempt = -1
        self._attempt = -1
        # Gloo process groups given up with work in flight: gloo cannot abort a collective
        # and destroying one would block until it times out, so they are kept until the
        # process ends. NCCL groups are aborted instead.
        self._abandoned: list = []
        self._take_place(spec)
        self._set_progress(-1, "idle")

    def _take_place(self, spec: RankSpec) -> None:
        """What depends on the rank's place in the layout."""
        self.spec = spec
        # the global ranks of this rank's group, in group-rank order
        self.group_ranks = [spec.global_rank - spec.group_rank + rank for rank in range(spec.shard * spec.tp)]
        self.checkpoint_io = RankCheckpointIO(spec.storage, spec.global_rank, spec.upload_in_process)
        self.memory = MemoryTier(spec.global_rank, spec.collective_timeout_s)

    # progress, read by the control thread

    def _set_progress(self, step: int, phase: str, micro_batch: int = 0) -> None:
        with self._progress_lock:
            self._step, self._phase, self._micro_batch = step, phase, micro_batch
            self._phase_started = time.monotonic()
            if phase == "data":
                self._module_entries = 0

    def _count_module_entry(self, *_args) -> None:
        self._module_entries += 1

    @ray.method(concurrency_group="control")
    def probe(self) -> Progress:
        with self._progress_lock:
            return Progress(
                self.spec.global_rank,
                self._step,
                self._phase,
                self._micro_batch,
                self._module_entries,
                time.monotonic() - self._phase_started,
            )

    @ray.method(concurrency_group="control")
    def abort_step(self, attempt: int) -> None:
        """Give up on the step dispatched as ``attempt``: stop at the next micro-batch boundary the group agrees on, or
        at the cross-group all-reduce, whichever comes first.

        A rank computing its own share is healthy: it ends its micro-batch, so its group keeps
        its committed state and stays a source to heal from. A rank stuck inside its group's
        FSDP or TP collectives cannot be released; the driver replaces it.
        """
        self._abort_attempt = attempt
        self._abort.set()

    def _abort_requested(self) -> bool:
        if self._abort.is_set() and self._abort_attempt != self._attempt:
            self._abort.clear()  # a late abort of an attempt already over
        return self._abort.is_set()

    def _at_micro_batch(self, step: int, index: int) -> None:
        """Between micro-batches the group agrees whether to stop, over a CPU all-reduce of
        the abort flag: every rank of the group is at this same boundary (FSDP keeps them in
        step), so they all stop here or all go on, and none waits in a collective its peers
        left. Nothing here waits for the device."""
        self._set_progress(step, "compute", index)
        if index == 0:
            return
        stop = torch.tensor([int(self._abort_requested())])
        if self.control_group is not None:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=self.control_group)
        if stop.item():
            raise StepInterrupted(f"rank {self.spec.global_rank}: step {step} interrupted before micro-batch {index}")

    def _wait_replicate(self, work, deadline: float) -> None:
        """Wait until the all-reduce has finished on the device, the driver aborts the step,
        or the step's deadline passes.

        ``is_completed`` asks NCCL's CUDA events whether the device is done; the future of
        an NCCL work is already complete once the kernel is enqueued, so waiting on it would
        release nothing.
        """
        rank = self.spec.global_rank
        try:
            while not work.is_completed():
                if self._abort_requested():
                    raise CollectiveAborted(f"rank {rank}: cross-group collective aborted by the driver")
                if time.perf_counter() > deadline:
                    raise CollectiveTimedOut(f"rank {rank}: cross-group collective still open at the step's deadline")
                self._abort.wait(REPLICATE_POLL_S)
            work.wait()
        except (CollectiveAborted, CollectiveTimedOut):
            raise
        except RuntimeError as error:
            raise CollectiveFailed(f"rank {rank}: cross-group collective failed: {error}") from error

    # membership

    def node(self) -> dict:
        return {"ip": ray_node_ip(), "pid": os.getpid(), "global_rank": self.spec.global_rank}

    # a warm spare: started ahead, before it knows which rank it will be

    def warm(self) -> dict:
        """Do ahead what a start costs besides the process: load the hooks and run the
        model's code once (on the meta device: no memory), and create the CUDA context."""
        self.hooks = load_hooks(self.pickled_hooks)
        try:
            with torch.device("meta"):
                self.hooks.model_fn()
        except Exception:  # noqa: BLE001 - a model_fn that reads weights needs real memory: its build runs it
            pass
        if self.spec.use_gpu:
            torch.empty(1, device=self.device)
        return self.node()

    def assume(self, spec: RankSpec) -> dict:
        """Take the place of a rank that is gone; the group's build follows."""
        if self.model is not None:
            raise RuntimeError(f"rank {self.spec.global_rank} is a rank already, not a spare")
        self._take_place(spec)
        return self.node()

    def build(self, generation: int) -> BuildReport:
        """(Re)join the group's world under ``generation`` and build a fresh model on its mesh."""
        started = time.perf_counter()
        spec = self.spec
        self._leave_replicas()
        if dist.is_initialized():
            self.checkpoint_io.settle(spec.collective_timeout_s)
            if spec.use_gpu:
                abort_process_groups_on_gpu()
            else:
                dist.destroy_process_group()
        backend = "cpu:gloo,cuda:nccl" if spec.use_gpu else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"gen{generation}/group{spec.group}/", self.store),
            rank=spec.group_rank,
            world_size=spec.shard * spec.tp,
            timeout=self.timeout,
        )
        mesh = init_device_mesh(self.device.type, (spec.shard, spec.tp), mesh_dim_names=("shard", "tp"))
        self.checkpoint_io.attach(dist.new_group(backend="gloo", timeout=self.timeout))
        # Its own group: the checkpoint upload thread must not interleave with these.
        self.control_group = dist.new_group(backend="gloo", timeout=self.timeout) if spec.shard * spec.tp > 1 else None
        torch.manual_seed(spec.seed)  # every rank builds the same initial model
        try:
            if self.hooks is None:
                self.hooks = load_hooks(self.pickled_hooks)
            with self.device:
                model = self.hooks.model_fn()
            self.model = self.hooks.parallelize_fn(model, mesh) or model
            self.optimizer = self.hooks.optimizer_fn(self.model.parameters())
        except Exception as error:
            if raised_in_collective(error):  # a peer or the transport: worth another try
                raise
            raise HookFailed(describe_failure(error)) from error
        # The schedule scales these; the optimizer's own lr changes every step, and a heal or
        # restore loads the lr a peer last stepped with.
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.mesh = mesh
        self.mesh_coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        self._rng_before_step = None
        torch.manual_seed(rng.training_seed(spec.seed, spec.shard_index))
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                # prepend: counted before FSDP's all-gather, so a rank blocked in compute lags
                # the peers blocked in the next module's all-gather.
                module.register_forward_pre_hook(self._count_module_entry, prepend=True)
        return BuildReport(spec.global_rank, time.perf_counter() - started, ray_node_ip())

    def _leave_replicas(self) -> None:
        if self.replicate_group is not None:
            if self.spec.use_gpu:
                self.replicate_group.abort()
            else:
                self._abandoned.append(self.replicate_group)
        self.replicate_group = None

    def join_replicas(self, generation: int, replica_rank: int, replica_size: int) -> float:
        started = time.perf_counter()
        self._leave_replicas()
        self.replica_rank = replica_rank
        if replica_size > 1:
            shard_index, tp_index = self.spec.position
            store = dist.PrefixStore(f"gen{generation}/replicate{shard_index}.{tp_index}/", self.store)
            if self.spec.use_gpu:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = self.timeout  # the default is 10 minutes
                self.replicate_group = dist.ProcessGroupNCCL(store, replica_rank, replica_size, options)
            else:
                self.replicate_group = dist.ProcessGroupGloo(store, replica_rank, replica_size, self.timeout)
        return time.perf_counter() - started

    # the run: steps the ranks take on their own

    @ray.method(concurrency_group="control")
    def request_pause(self, run: int) -> None:
        """Stop ``run`` at a step boundary: the ranks agree on which in their votes."""
        self._pause_run = run

    def run(self, spec: RunSpec) -> Iterator[RunMessage]:
        """Train ``spec``'s steps, each a transaction the ranks decide among themselves. The
        run's records go out after the first step, then about every ``spec.report_interval_s``
        (gathered by the groups' first ranks, sent by the run's first group), and each group's
        first rank sends what it holds when its run ends; every rank yields its ``RunEnd`` last."""
        self._attempt = spec.run
        leads_group = self.spec.group_rank == 0
        records: list[StepRecord] = []
        lap = time.perf_counter()
        started, reported = lap, -1  # the report interval last sent in, counted from the run's start
        share = self._share(spec, spec.first_step, spec.cursor)
        batches = self._prefetch(share)
        while True:
            upcoming = self._share(spec, share.step + 1, share.next_cursor) if share.step + 1 < spec.stop_step else None
            upcoming_batches = self._prefetch(upcoming) if upcoming is not None else None
            report_due = leads_group and int((time.perf_counter() - started) / spec.report_interval_s) > reported
            try:
                record, pause, report = self._transaction(spec, share, batches, report_due)
            except Exception as error:  # the step is discarded; the driver decides who is evicted
                if records:
                    yield GroupProgress(self.spec.group, tuple(records))
                yield RunEnd(self.spec.global_rank, share.step, self._failed(share.step, error))
                return
            if isinstance(record, Discarded):
                if records:
                    yield GroupProgress(self.spec.group, tuple(records))
                yield RunEnd(self.spec.global_rank, share.step, nonfinite=record.nonfinite, integrity=record.integrity)
                return
            if spec.memory_every and (share.step + 1) % spec.memory_every == 0:
                self.memory.snapshot(share.step + 1, share.next_cursor, self.model, self.optimizer,
                                     rng.capture(self.spec.use_gpu))
            now = time.perf_counter()
            if leads_group:  # the group's records: every rank decided the same
                records.append(replace(record, step_s=now - lap))  # the whole loop: the step's true cost
            lap = now
            ends = upcoming is None or pause
            if leads_group and (ends or report):
                message = self._records_message(records, report and not ends, time.perf_counter() + spec.deadline_s)
                if message is not None:
                    yield message
                records, reported = [], int((now - started) / spec.report_interval_s)
            if ends:
                yield RunEnd(self.spec.global_rank, share.step + 1)
                return
            share, batches = upcoming, upcoming_batches

    def _share(self, spec: RunSpec, step: int, cursor: DataCursor) -> RankShare:
        return rank_share(spec, step, cursor, self.spec.group, self.spec.shard_index, self.spec.shard)

    def _prefetch(self, share: RankShare) -> Future:
        """Read the step's samples on the loader thread while the current step computes."""
        return self.loader.submit(lambda: [collate(self.hooks.dataset, mb, CPU) for mb in share.micro_batches])

    def _records_message(self, records: list[StepRecord], gather: bool, deadline: float) -> RunMessage | None:
        """What the group's first rank sends of its records: with ``gather`` (the groups'
        first ranks agreed to in the last step's cross-group sum), every group's, gathered,
        from the run's first group (None from the others); else, or when the gather fails,
        its group's own."""
        own = GroupProgress(self.spec.group, tuple(records))
        if not gather or self.replicate_group is None:
            return own
        rows = torch.tensor([record_row(record) for record in records], dtype=torch.float64).to(self.device)
        gathered = [torch.empty_like(rows) for _ in range(self.replicate_group.size())]
        try:
            self._wait_replicate(self.replicate_group.allgather([gathered], [rows]), deadline)
        except (CollectiveAborted, CollectiveTimedOut, CollectiveFailed):
            # A peer group is gone: the next cross-group sum fails and ends the run as any
            # failed sum does. The committed steps still reach the driver.
            return own
        if self.replica_rank != 0:
            return None
        return RunRecords.from_rows(tuple(records), [member.cpu().tolist() for member in gathered])

    def _transaction(self, spec: RunSpec, share: RankShare, batches: Future,
                     report_due: bool) -> tuple[StepRecord | Discarded, bool, bool]:
        """One step: compute, sum across groups, vote; then every rank of the group applies
        it or every rank discards it. Returns the committed record, whether to pause and
        whether the groups' first ranks send their records now; or the step every group
        discarded (``Discarded``)."""
        started = time.perf_counter()
        step = share.step
        check = (start_check(step, self.spec.group, self.model, self.optimizer, self.replicate_group, self.device)
                 if self.replicate_group is not None and check_due(step, spec.integrity_every) else None)
        self._set_progress(step, "data")
        on_device = [batch.to(self.device) for batch in batches.result()]
        data_s = time.perf_counter() - started
        self._set_progress(step, "compute")
        self._rng_before_step = rng.capture(self.spec.use_gpu)
        loss_share, compute_s = self._compute(spec, step, on_device, share.global_tokens)
        self._set_progress(step, "replicate")
        comm_started = time.perf_counter()
        sum_error, mismatch = None, None
        try:
            if check is not None:
                self._wait_replicate(check.work, started + spec.deadline_s)
                mismatch = check.verdict(self.spec.position)
            self._reduce_across_groups(spec, started + spec.deadline_s)
            crossed = self._cross_group_scalars(loss_share, counted_tokens(on_device), self._pause_run == spec.run,
                                                report_due, started + spec.deadline_s)
            # An abort the driver sent (a step failed elsewhere) ends this group's run after
            # this step, which every contribution reached: a group that stops earlier than
            # another leaves the other's next cross-group sum to be aborted and discarded.
            crossed = replace(crossed, pause=crossed.pause + float(self._abort_requested()))
        except (CollectiveAborted, CollectiveTimedOut, CollectiveFailed) as error:
            sum_error, crossed = error, CrossGroupScalars(0.0, 0.0, 0.0)
        comm_s = time.perf_counter() - comm_started
        grad_sq_norm = 0.0 if sum_error else squared_gradient_norm(self.model, self.mesh_coordinate)
        times = (data_s, compute_s, comm_s, time.perf_counter() - started)
        self._set_progress(step, "vote")
        try:
            vote = self._vote(sum_error is None, crossed, mismatch is not None, grad_sq_norm, times)
        except Exception as error:
            raise VoteFailed(f"rank {self.spec.global_rank}: the group's vote on step {step} failed: {error}") from error
        if sum_error is not None:
            raise sum_error
        if not vote.every_rank_succeeded:
            raise StepDiscarded(f"rank {self.spec.global_rank}: step {step} discarded: a peer's cross-group sum failed")
        rescale = token_rescale(share.global_tokens, vote.counted_tokens)
        loss, norm = vote.loss * rescale, vote.grad_norm * rescale
        if vote.integrity_mismatch or not (math.isfinite(loss) and math.isfinite(norm)):
            self._discard_uncommitted()
            self._set_progress(step, "done")
            if vote.integrity_mismatch:
                return Discarded(integrity=mismatch), True, False
            return Discarded(nonfinite=NonFinite(step, loss, norm)), True, False
        clip_scale = clip_coefficient(norm, spec.clip_grad_norm)
        self._apply(spec.schedule.factor(step), clip_scale * rescale)
        self._set_progress(step, "done")
        record = StepRecord(step, self.spec.group, loss, norm, clip_scale, self.optimizer.param_groups[0]["lr"],
                            share.global_samples, share.group_samples, share.next_cursor, tuple(self.group_ranks),
                            vote.times)
        return record, vote.pause, crossed.report > 0

    def _cross_group_scalars(self, loss_share: float, counted: int, pause_seen: bool, report_due: bool,
                             deadline: float) -> CrossGroupScalars:
        """The loss shares, counted tokens, pause requests and due reports of this position
        summed over the groups, in float64: identical at this position in every group."""
        scalars = torch.tensor([loss_share, float(counted), float(pause_seen), float(report_due)], dtype=torch.float64)
        if self.replicate_group is not None:
            on_device = scalars.to(self.device)
            self._wait_replicate(self.replicate_group.allreduce([on_device]), deadline)
            scalars = on_device.cpu()
        return CrossGroupScalars(*scalars.tolist())

    def _vote(self, succeeded: bool, crossed: CrossGroupScalars, mismatch: bool, grad_sq_norm: float,
              times: tuple[float, float, float, float]) -> Vote:
        """Every rank of the group gets every rank's ballot (one all-gather on the CPU group)
        and adds them up in rank order, so all decide the same: apply or discard, and whether
        to stop after this step (a pause every group saw the same, or an abort)."""
        leads_tp = self.spec.tp_index == 0
        # A TP row's ranks hold the same samples: its first rank counts them.
        sums = [crossed.loss_share, crossed.counted_tokens] if leads_tp else [0.0, 0.0]
        ballot = torch.tensor([float(succeeded), *sums, crossed.pause, float(mismatch), grad_sq_norm, *times],
                              dtype=torch.float64)
        if self.control_group is None:
            ballots = [ballot]
        else:
            ballots = [torch.empty_like(ballot) for _ in self.group_ranks]
            dist.all_gather(ballots, ballot, group=self.control_group)
        table = torch.stack(ballots).tolist()
        return Vote(
            every_rank_succeeded=all(row[0] == 1.0 for row in table),
            loss=sum(row[1] for row in table),
            counted_tokens=round(sum(row[2] for row in table)),
            pause=any(row[3] > 0 for row in table),
            integrity_mismatch=any(row[4] > 0 for row in table),
            grad_norm=global_norm({group_rank: row[5] for group_rank, row in enumerate(table)}),
            times=tuple(RankTimes(*row[6:10]) for row in table),
        )

    def _apply(self, lr_scale: float, grad_scale: float) -> None:
        scale_gradients(self.model, grad_scale)
        for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base_lr * lr_scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        self._rng_before_step = None

    def _discard_uncommitted(self) -> None:
        if self._rng_before_step is not None:
            rng.restore(self._rng_before_step)
            self._rng_before_step = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)

    def _failed(self, step: int, error: Exception) -> StepReport:
        group_broken = (self._phase in ("data", "compute") and not isinstance(error, StepInterrupted)
                        or isinstance(error, VoteFailed))
        failure = classify(error, self._phase)
        self._leave_replicas()
        self._discard_uncommitted()
        self._set_progress(step, "failed")
        return StepReport(self.spec.global_rank, step, error=describe_failure(error), failure=failure,
                          group_broken=group_broken)

    def evaluate(self, request: EvalRequest) -> StepReport:
        """The held-out loss of the committed state over the request's samples."""
        started = time.perf_counter()
        self._attempt = request.attempt
        try:
            self._set_progress(request.step, "data")
            batches = [collate(self.hooks.eval_dataset, mb, self.device) for mb in request.micro_batches]
            data_s = time.perf_counter() - started
            self._set_progress(request.step, "compute")
            # The held-out loss leaves the training generators where they were.
            with torch.random.fork_rng(devices=[self.device] if self.spec.use_gpu else []):
                self.compute_timer.start()
                loss_share = evaluate_loss(self.model, self.hooks.loss_fn, batches, request.global_tokens,
                                           on_micro_batch=lambda index: self._at_micro_batch(request.step, index))
                compute_s = self.compute_timer.seconds()
            self._set_progress(request.step, "done")
            return StepReport(self.spec.global_rank, request.step, loss_share=loss_share,
                              counted_tokens=counted_tokens(batches), data_s=data_s, compute_s=compute_s,
                              wall_s=time.perf_counter() - started)
        except Exception as error:
            return self._failed(request.step, error)

    def _compute(self, spec: RunSpec, step: int, batches, global_tokens: int) -> tuple[float, float]:
        """This rank's share of the step: (loss share, its own compute seconds)."""
        self.compute_timer.start()
        loss_share = accumulate_gradients(self.model, self.hooks.loss_fn, batches, global_tokens,
                                          on_micro_batch=lambda index: self._at_micro_batch(step, index))
        return loss_share, self.compute_timer.seconds()

    def _reduce_across_groups(self, spec: RunSpec, deadline: float) -> None:
        if self.replicate_group is not None:
            sum_across_groups(
                self.model, self.replicate_group, lambda work: self._wait_replicate(work, deadline),
                self.replicate_dtype,
            )

    # healing

    def export_state(self) -> dict:
        """Committed state: between runs nothing is pending."""
        return {**export_local_state(self.model, self.optimizer), "rng": rng.capture(self.spec.use_gpu)}

    def import_state(self, state: dict) -> None:
        import_local_state(self.model, self.optimizer, state)
        self._rng_before_step = None
        self._discard_uncommitted()
        rng.restore(state["rng"])

    # the memory tier

    def set_buddy(self, handle) -> None:
        """The rank that keeps the copies of this rank's state (None: none)."""
        self.memory.set_buddy(handle)

    @ray.method(concurrency_group="memory")
    def hold_copy(self, owner: int, step: int, cursor: DataCursor, state: dict) -> None:
        """Keep ``owner``'s committed state at ``step`` (as sent: ``to_wire``): this rank is its buddy."""
        self.memory.hold(owner, step, cursor, state)

    @ray.method(concurrency_group="memory")
    def export_held(self, owner: int, step: int) -> dict:
        return self.memory.held_state(owner, step)

    def import_held(self, state: dict) -> None:
        """Take a buddy's copy of this rank's committed state (``export_held``)."""
        self.import_state(from_wire(state))

    @ray.method(concurrency_group="control")
    def memory_holdings(self) -> Holdings:
        return self.memory.holdings()

    def restore_memory(self, step: int) -> None:
        """Go back to this rank's own copy of its committed state at ``step``."""
        self.import_state(self.memory.own_state(step))

    # checkpoints

    def save_checkpoint(self, url: str) -> float:
        """Stage committed state for an async upload to ``url``; returns the stall in seconds."""
        return self.checkpoint_io.save(self.model, self.optimizer, url, rng.capture(self.spec.use_gpu))

    @ray.method(concurrency_group="checkpoint")
    def finish_checkpoint(self) -> UploadResult:
        return self.checkpoint_io.wait()

    # Not in the checkpoint group: that one is held by the finish_checkpoint waiting on the
    # stuck upload.
    @ray.method(concurrency_group="control")
    def abandon_checkpoint(self) -> None:
        """The driver failed this save: its upload ran past ``checkpoint.upload_timeout_s``."""
        self.checkpoint_io.abandon()

    def load_checkpoint(self, url: str, step: int, generators: rng.RngState | None) -> float:
        """Load the committed state of ``step``; ``generators``: the states saved for this
        rank's position, or None when the checkpoint has none for it (saved at another
        layout), and the stream restarts from the seed and the step."""
        seconds = self.checkpoint_io.load(self.model, self.optimizer, url)
        self._rng_before_step = None
        self._discard_uncommitted()
        if generators is None:
            torch.manual_seed(rng.training_seed(self.spec.seed, self.spec.shard_index, step))
        else:
            rng.restore(generators)
        return seconds

    def local_parameters(self) -> list[torch.Tensor]:
        """Committed local parameter shards, for comparing final states across runs."""
        return export_local_state(self.model, self.optimizer)["model"]


def ray_node_ip() -> str:
    return ray.util.get_node_ip_address()


# Control calls, upload waits and buddy copies each run on a thread of their own, beside training.
CONCURRENCY_GROUPS = {"control": 1, "checkpoint": 1, "memory": 1}
RankActor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(RankWorker)

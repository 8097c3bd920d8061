"""The rank actor: one process per GPU (or CPU slot) running its replica group's share.

Each replica group is its own torch.distributed world (the default process group, with the
group's 2-D ``(shard, tp)`` mesh on it), rendezvousing on the driver's TCPStore under a
generation prefix. Across groups, ranks at the same position sum gradients over a
*replicate* process group built directly on the store, outside the default world, so it can
be torn down and rebuilt when membership changes without touching the group's own world.

Steps are transactions: ``train_step`` leaves its gradients (and the random draws it made)
pending, and the next request says whether the driver saw every rank succeed (apply them, at
the step's learning rate and clipping factor) or not (drop them and rewind the generators).

Methods in the ``control`` concurrency group run on a second thread, so the driver can
probe or abort a rank whose training thread is stuck; ``finish_checkpoint`` waits for a
background upload on a third, while training goes on.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
import warnings

import ray
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from checkpointing.healing import export_local_state, import_local_state
from checkpointing.rank_io import RankCheckpointIO, UploadResult
from workers import rng
from workers.failures import CollectiveAborted, CollectiveFailed, CollectiveTimedOut, StepInterrupted, classify
from workers.protocol import (
    BuildReport,
    Commit,
    Progress,
    RankSpec,
    StepReport,
    StepRequest,
    describe_error,
)
from workers.train_step import (
    accumulate_gradients,
    collate,
    evaluate_loss,
    scale_gradients,
    squared_gradient_norm,
    sum_across_groups,
)

REPLICATE_POLL_S = 0.001

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


class RankWorker:
    def __init__(self, spec: RankSpec, hooks):
        self.spec = spec
        self.hooks = hooks
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
        self.store = dist.PrefixStore(spec.store_prefix, dist.TCPStore(
            spec.store_host, spec.store_port, is_master=False, timeout=self.timeout, wait_for_workers=False
        ))
        self.model = None
        self.optimizer = None
        self.replicate_group = None
        self.control_group = None
        self.pending = False
        # generator states before the pending step's draws; None when nothing is pending
        self._rng_before_step: rng.RngState | None = None
        self._progress_lock = threading.Lock()
        self._module_entries = 0
        self._abort = threading.Event()
        self._abort_attempt = -1
        self._attempt = -1
        # Gloo process groups given up with work in flight: gloo cannot abort a collective
        # and destroying one would block until it times out, so they are kept until the
        # process ends. NCCL groups are aborted instead.
        self._abandoned: list = []
        self.checkpoint_io = RankCheckpointIO(spec.storage, spec.global_rank, spec.upload_in_process)
        self._set_progress(-1, "idle")

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
                    raise CollectiveAborted(f"rank {rank}: replicate all-reduce aborted by the driver")
                if time.perf_counter() > deadline:
                    raise CollectiveTimedOut(f"rank {rank}: replicate all-reduce still open at the step's deadline")
                self._abort.wait(REPLICATE_POLL_S)
            work.wait()
        except (CollectiveAborted, CollectiveTimedOut):
            raise
        except RuntimeError as error:
            raise CollectiveFailed(f"rank {rank}: replicate all-reduce failed: {error}") from error

    # membership

    def node(self) -> dict:
        return {"ip": ray_node_ip(), "pid": os.getpid(), "global_rank": self.spec.global_rank}

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
        with self.device:
            model = self.hooks.model_fn()
        self.model = self.hooks.parallelize_fn(model, mesh) or model
        self.optimizer = self.hooks.optimizer_fn(self.model.parameters())
        # The schedule scales these; the optimizer's own lr changes every step, and a heal or
        # restore loads the lr a peer last stepped with.
        self.base_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.mesh = mesh
        self.mesh_coordinate = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate()))
        self.pending = False
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

    # the step transaction

    def _settle_pending(self, commit: Commit | None) -> None:
        if self.pending and commit is not None:
            scale_gradients(self.model, commit.grad_scale)
            for group, base_lr in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = base_lr * commit.lr_scale
            self.optimizer.step()
            self._rng_before_step = None
        self._discard_uncommitted()

    def _discard_uncommitted(self) -> None:
        if self._rng_before_step is not None:
            rng.restore(self._rng_before_step)
            self._rng_before_step = None
        self.optimizer.zero_grad(set_to_none=False)
        self.pending = False

    def _committed_rng(self) -> rng.RngState:
        return self._rng_before_step or rng.capture(self.spec.use_gpu)

    def commit(self, commit: Commit) -> None:
        self._settle_pending(commit)

    def train_step(self, request: StepRequest) -> StepReport:
        """One step (or, with ``request.evaluate``, one held-out evaluation) on this rank."""
        started = time.perf_counter()
        rank = self.spec.global_rank
        self._attempt = request.attempt
        try:
            self._set_progress(request.step, "data")
            self._settle_pending(request.commit_previous)
            dataset = self.hooks.eval_dataset if request.evaluate else self.hooks.dataset
            batches = [collate(dataset, mb, self.device) for mb in request.micro_batches]
            data_s = time.perf_counter() - started

            self._set_progress(request.step, "compute")
            if request.evaluate:
                # The held-out loss leaves the training generators where they were.
                with torch.random.fork_rng(devices=[self.device] if self.spec.use_gpu else []):
                    loss_share, compute_s = self._compute(request, batches, evaluate_loss)
                self._set_progress(request.step, "done")
                return StepReport(rank, request.step, loss_share=loss_share, data_s=data_s, compute_s=compute_s,
                                  wall_s=time.perf_counter() - started)
            self._rng_before_step = rng.capture(self.spec.use_gpu)
            loss_share, compute_s = self._compute(request, batches)

            self._set_progress(request.step, "replicate")
            comm_started = time.perf_counter()
            self._reduce_across_groups(request, started + request.deadline_s)
            comm_s = time.perf_counter() - comm_started
            grad_sq_norm = squared_gradient_norm(self.model, self.mesh_coordinate)
            self.pending = True
            self._set_progress(request.step, "done")
            return StepReport(
                rank,
                request.step,
                loss_share=loss_share,
                data_s=data_s,
                compute_s=compute_s,
                comm_s=comm_s,
                wall_s=time.perf_counter() - started,
                grad_sq_norm=grad_sq_norm,
            )
        except Exception as error:  # any failure discards the step; the driver decides who is evicted
            group_broken = self._phase in ("data", "compute") and not isinstance(error, StepInterrupted)
            self._leave_replicas()
            self._discard_uncommitted()
            self._set_progress(request.step, "failed")
            return StepReport(
                rank,
                request.step,
                error=describe_error(error),
                failure=classify(error, self._phase),
                group_broken=group_broken,
                wall_s=time.perf_counter() - started,
            )

    def _compute(self, request: StepRequest, batches, loss_of=accumulate_gradients) -> tuple[float, float]:
        """This rank's share of the step (or of the evaluation, with ``evaluate_loss``): (loss
        share, its own compute seconds)."""
        self.compute_timer.start()
        loss_share = loss_of(
            self.model,
            self.hooks.loss_fn,
            batches,
            request.global_tokens,
            on_micro_batch=lambda index: self._at_micro_batch(request.step, index),
        )
        return loss_share, self.compute_timer.seconds()

    def _reduce_across_groups(self, request: StepRequest, deadline: float) -> None:
        if self.replicate_group is not None:
            sum_across_groups(
                self.model, self.replicate_group, lambda work: self._wait_replicate(work, deadline),
                self.replicate_dtype,
            )

    # healing

    def export_state(self) -> dict:
        """Committed state only: the driver commits or discards pending gradients first."""
        return {**export_local_state(self.model, self.optimizer), "rng": self._committed_rng()}

    def import_state(self, state: dict) -> None:
        import_local_state(self.model, self.optimizer, state)
        self._rng_before_step = None
        self._discard_uncommitted()
        rng.restore(state["rng"])

    # checkpoints

    def save_checkpoint(self, url: str) -> float:
        """Stage committed state for an async upload to ``url``; returns the stall in seconds."""
        return self.checkpoint_io.save(self.model, self.optimizer, url, self._committed_rng())

    @ray.method(concurrency_group="checkpoint")
    def finish_checkpoint(self) -> UploadResult:
        return self.checkpoint_io.wait()

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


RankActor = ray.remote(concurrency_groups={"control": 1, "checkpoint": 1})(RankWorker)

"""The rank actor: one process per GPU (or CPU slot) running its replica group's share.

The actor is the shell around a rank's parts: its process groups (``workers.world``), its
steps (``workers.step_transaction``), its copies in host memory (``workers.memory_tier``) and
its checkpoints (``checkpointing.rank_io``). It answers the driver's calls, and during a
*segment* (``run``) steps on its own: it plans its share of every step from the segment's spec with
the driver's own pure code, reads the next step's samples while the current one computes,
and follows the segment protocol (``elastic.core.segment_loop``). The driver is not on the step's
path: it watches the groups' records and acts at failures and boundaries.

Methods in the ``control`` concurrency group run on a second thread, so the driver can
probe, pause or abort a rank whose training thread is busy or stuck; ``finish_checkpoint`` waits for a
background upload on a third, while training goes on.
"""

from __future__ import annotations

import os
import time
import warnings
from functools import partial
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import ray
import torch

from checkpointing.healing import export_local_state, import_local_state, local_state
from checkpointing.pretrained import load_pretrained
from workers.model_build import first_model
from checkpointing.rank_io import RankCheckpointIO, UploadResult
from workers import rng, state_transfer
from elastic.core.data_plan import DataCursor
from elastic.core.memory_tier import Holdings
from elastic.core.protocol import (
    BuildOutcome,
    EvalRequest,
    GroupRecords,
    HookFailed,
    Phase,
    RankActivity,
    RankOutcome,
    SegmentEnd,
    SegmentMessage,
    SegmentSpec,
)
from elastic.core.segment_loop import RankSegmentLoop, memory_snapshot_due
from workers.failures import describe_failure, failure_outcome, raised_in_collective
from workers.fault_injection import InjectedFaults
from workers.memory_tier import MemoryTier, from_wire, parameter_bytes, state_bytes
from workers.pipeline import stage_model
from workers.rank_spec import RankSpec
from workers.catch_up import begin_copies
from workers.step_feed import StepFeed
from workers.control_surface import ActivityTracker, DriverSignals, FaultPlan
from workers.step_transaction import Discarded, StepTransaction
from workers.attempt_watch import AttemptWatch
from workers.segment_handoff import SegmentHandoff
from workers.world import World, connect_store

CPU = torch.device("cpu")

warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
# The group's mesh names its flattened dimensions (``shard`` over ``expert_shard`` and ``ep``;
# ``shard_cp``) on the root mesh, where a user's parallelize_fn reads them too: torch 2.11 to 2.13 slice them there,
# with a warning of a deprecation that none of them carries out.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def load_hooks(pickled_hooks: bytes):
    """The user's hooks, unpickled by the rank, not by Ray as it creates the actor: an error
    here (code the ranks cannot import) is the hooks' own, and stops the run."""
    try:
        return ray.cloudpickle.loads(pickled_hooks)
    except ImportError as error:
        raise ImportError(f"{error}: the ranks cannot import the code that defines the hooks; ship it with the job "
                          "(ray job submit --working-dir, or runtime_env py_modules)") from error


def rank_device(use_gpu: bool) -> torch.device:
    """The device this process's rank computes on, set up for it."""
    if not use_gpu:
        torch.set_num_threads(1)
        return CPU
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    # A timed-out NCCL collective aborts its communicator and raises here, instead of the
    # watchdog killing the process (mode 1): the driver, not NCCL, decides who is evicted,
    # and a rank that timed out waiting on a dead peer is not the culprit.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    return device


class RankWorker:
    def __init__(self, spec: RankSpec, pickled_hooks: bytes):
        self.pickled_hooks = pickled_hooks
        self.hooks = None  # loaded by the first build (a spare's, ahead by ``warm``)
        self.device = rank_device(spec.use_gpu)
        self.store = connect_store(spec)
        self.model = None
        self.optimizer = None
        self.transaction: StepTransaction | None = None  # the steps on the model its group built
        self.feed: StepFeed | None = None  # the data of its steps
        self.loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loader")
        self.copies = ThreadPoolExecutor(max_workers=2, thread_name_prefix="catch-up")  # a catch-up's copies
        self.activity = ActivityTracker()
        self.signals = DriverSignals()
        self.attempt_watch = AttemptWatch(partial(connect_store, spec), self.signals)
        self.handoff = SegmentHandoff(connect_store(spec))
        self._take_place(spec)

    def _take_place(self, spec: RankSpec) -> None:
        """What depends on the rank's place in the layout."""
        self.spec = spec
        self.world = World(spec, self.store)
        self.checkpoint_io = RankCheckpointIO(spec.storage, spec.global_rank, spec.upload_in_process)
        self.memory = MemoryTier(spec.global_rank, spec.collective_timeout_s)
        self.injected_faults = InjectedFaults(spec.seed, spec.global_rank, self.world)

    # the control thread

    @ray.method(concurrency_group="control")
    def probe(self) -> RankActivity:
        return self.activity.read(self.spec.global_rank)

    @ray.method(concurrency_group="control")
    def release_step(self, attempt: int) -> None:
        """The rank's group is broken and the rank has not reported since the abort: it waits
        on a peer that left the step (a pipeline stage for its neighbour's activations, a TP
        or FSDP collective, the vote). Close the connections of the group's world, so the
        wait raises and the rank reports as a victim instead of being replaced; its peers'
        waits on it raise too. Nothing is done once the attempt has ended: the world may be a
        new build by then."""
        self.signals.during(attempt, self.world.close_connections)

    @ray.method(concurrency_group="control")
    def request_pause(self, attempt: int) -> None:
        """Stop the segment dispatched as ``attempt`` at a step boundary: the ranks agree on which in their votes."""
        self.signals.request_pause(attempt)

    # membership

    # On the control thread: a rank that waits for its next segment answers whether it lives.
    @ray.method(concurrency_group="control")
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

    def build(self, world_build: int) -> BuildOutcome:
        """(Re)join the group's world as its build number ``world_build`` and build a fresh model on its mesh."""
        started = time.perf_counter()
        spec = self.spec
        if self.world.joined:  # an upload in flight uses the world about to be left
            self.checkpoint_io.settle(spec.collective_timeout_s)
        mesh = self.world.join_group(world_build)
        self.checkpoint_io.attach(self.world.checkpoint_group)
        torch.manual_seed(spec.seed)  # every rank builds the same initial model
        try:
            if self.hooks is None:
                self.hooks = load_hooks(self.pickled_hooks)
            place = partial(stage_model, split_fn=self.hooks.split_fn, parallelize_fn=self.hooks.parallelize_fn,
                            layout=spec.pipeline, pp_index=spec.pp_index, mesh=mesh)
            load = spec.pretrained and partial(load_pretrained, source=spec.pretrained, options=spec.storage,
                                               process_group=self.world.checkpoint_group)
            self.model, stages = first_model(self.hooks.model_fn, place, self.device, load)
            self.optimizer = self.hooks.optimizer_fn(self.model.parameters())
        except Exception as error:
            if raised_in_collective(error):  # a peer or the transport: worth another try
                raise
            raise HookFailed(describe_failure(error)) from error
        self.transaction = StepTransaction(spec, self.world, self.model, self.optimizer, self.hooks.micro_loss,
                                           self.device, self.activity, self.signals, stages)
        self.feed = StepFeed(spec, self.hooks, self.loader)
        torch.manual_seed(rng.training_seed(spec.seed, spec.shard_index, stage=spec.pp_index))
        self.activity.count_entries_of(self.model)
        return BuildOutcome(spec.global_rank, time.perf_counter() - started, ray_node_ip(),
                            parameter_bytes=parameter_bytes(self.model))

    # the segment: steps the ranks take on their own

    def run(self, spec: SegmentSpec) -> Iterator[SegmentMessage]:
        """Train ``spec``'s segment, then each segment the driver hands on through the run's
        store (``workers.segment_handoff``), until it releases the rank."""
        while spec is not None:
            yield from self._segment(spec)
            spec = self.handoff.next_spec(spec.attempt, self.spec.global_rank, self.spec.group)

    def _segment(self, spec: SegmentSpec) -> Iterator[SegmentMessage]:
        """Train ``spec``'s steps, each a transaction the ranks decide among themselves, and
        send the segment's records and its end as ``elastic.core.segment_loop`` decides; every rank
        yields its ``SegmentEnd`` last."""
        faults = self.injected_faults.plan(spec, self.model)  # fired now, as the first step starts
        self.signals.begin(spec.attempt)
        self.attempt_watch.watch(spec.attempt)
        try:
            try:
                self.transaction.enter_replicas(spec)
            except Exception as error:  # a replica gone or the driver's abort: nothing stepped
                yield self._end(spec.first_step, self._failed(spec.first_step, error))
                return
            if spec.catch_up is not None:
                self.transaction.joining.begin(begin_copies(
                    self.copies, spec.catch_up, f"catch-up{spec.attempt}", self.spec.global_rank, self.world,
                    spec.groups, self._host_state, state_bytes))
                if spec.catch_up.before_first_step and not self.transaction.joining.holds_state:
                    try:
                        self.transaction.joining.take_state_now(spec.deadline_s)
                    except Exception as error:  # the copy failed: the rank holds no state
                        yield self._end(spec.first_step, self._failed(spec.first_step, error))
                        return
            yield from self._steps(spec, faults)
        finally:
            self.signals.end()

    def _steps(self, spec: SegmentSpec, faults: FaultPlan) -> Iterator[SegmentMessage]:
        loop = RankSegmentLoop(spec, leads_group=self.spec.group_rank == 0, now=time.perf_counter())
        stepping = loop.planning()  # the spec the step in hand was planned by
        share = self.feed.share(stepping, spec.first_step, spec.cursor)
        batches = self.feed.prefetch(share)
        while True:
            planned_caught_up = loop.caught_up
            upcoming = (self.feed.share(loop.planning(), share.step + 1, share.next_cursor)
                        if share.step + 1 < spec.stop_step else None)
            upcoming_batches = self.feed.prefetch(upcoming) if upcoming is not None else None
            try:
                outcome = self.transaction.step(stepping, share, batches, loop.step_starts(time.perf_counter()), faults)
            except Exception as error:  # the step is discarded; the driver decides who is evicted
                yield from self._held_records(loop)
                yield self._end(share.step, self._failed(share.step, error))
                return
            if isinstance(outcome, Discarded):
                yield from self._held_records(loop)
                yield self._end(share.step, nonfinite=outcome.nonfinite, integrity=outcome.integrity,
                                replay=outcome.replay)
                return
            if memory_snapshot_due(stepping, share.step + 1):
                self.memory.snapshot(share.step + 1, share.next_cursor, self.model, self.optimizer,
                                     rng.capture(self.spec.use_gpu))
            after = loop.committed(outcome.record, outcome.pause, outcome.records_due, time.perf_counter(),
                                   outcome.caught_up)
            if after.send is not None:
                message = self.transaction.records_message(after.send, time.perf_counter() + spec.deadline_s)
                if message is not None:
                    yield message
            if after.segment_ends:
                yield self._end(share.step + 1)
                return
            if upcoming is not None and loop.caught_up != planned_caught_up:  # the joining groups take shares now
                upcoming = self.feed.share(loop.planning(), upcoming.step, share.next_cursor)
                upcoming_batches = self.feed.prefetch(upcoming)
            stepping, share, batches = loop.planning(), upcoming, upcoming_batches

    def _end(self, next_step: int, failure: RankOutcome | None = None, **found) -> SegmentEnd:
        """The rank's ``SegmentEnd``. A joining rank still catching up first waits for its state
        and applies what it kept (every step it kept is committed); one the state cannot reach
        holds none, and ends failed with its group broken."""
        try:
            self.transaction.joining.finish()
        except Exception as error:  # noqa: BLE001 - reported as the rank's failure
            failure = failure or failure_outcome(self.spec.global_rank, next_step, error, self.activity.phase)
        if not self.transaction.joining.holds_state:
            failure = replace(failure, group_broken=True)
        return SegmentEnd(self.spec.global_rank, next_step, failure, healed=self.transaction.joining.take_receipt(),
                          waits_for_next=True, **found)

    def _held_records(self, loop: RankSegmentLoop) -> Iterator[GroupRecords]:
        held = loop.held()
        if held:
            yield GroupRecords(self.spec.group, held)

    def _failed(self, step: int, error: Exception) -> RankOutcome:
        outcome = failure_outcome(self.spec.global_rank, step, error, self.activity.phase)
        self.world.fail_replicas()
        self.activity.set(step, Phase.FAILED)
        return outcome

    def evaluate(self, request: EvalRequest) -> RankOutcome:
        """The held-out loss of the committed state over the request's samples."""
        started = time.perf_counter()
        self.signals.begin(request.attempt)
        self.attempt_watch.watch(request.attempt)
        try:
            self.activity.set(request.step, Phase.DATA)
            batches = self.feed.held_out(request.micro_batches, self.device)
            data_s = time.perf_counter() - started
            share, counted, compute_s = self.transaction.held_out_loss(request.step, batches, request.global_tokens)
            return RankOutcome(self.spec.global_rank, request.step, loss_share=share,
                               counted_tokens=counted, data_s=data_s, compute_s=compute_s,
                               wall_s=time.perf_counter() - started)
        except Exception as error:
            return self._failed(request.step, error)
        finally:
            self.signals.end()

    # healing

    def send_state(self, heal: int, targets: list[int]) -> int:
        """Stream the committed state (between segments nothing is pending) to ``targets``, each
        in ``receive_state`` of the same ``heal`` at once; returns the bytes sent to each."""
        groups = [self.world.heal_pair(f"heal{heal}", self.spec.global_rank, target) for target in targets]
        return state_transfer.send_state(groups, {**local_state(self.model, self.optimizer),
                                                  "rng": rng.capture(self.spec.use_gpu)})

    def receive_state(self, heal: int, source: int) -> int:
        """Take ``source``'s committed state as it sends it (``send_state``); returns its bytes."""
        state = state_transfer.receive_state(self.world.heal_pair(f"heal{heal}", source, self.spec.global_rank))
        return self.import_state(state)

    def export_state(self) -> dict:
        """Committed state in host memory, for the object store: the heal's fallback."""
        return self._host_state()

    def _host_state(self) -> dict:
        return {**export_local_state(self.model, self.optimizer), "rng": rng.capture(self.spec.use_gpu)}

    def import_state(self, state: dict) -> int:
        """Load ``state``; returns its tensors' bytes."""
        import_local_state(self.model, self.optimizer, state)
        self.transaction.discard_uncommitted()
        rng.restore(state["rng"])
        return state_bytes(state)

    # the memory tier

    @ray.method(concurrency_group="control")
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
        if self.transaction.outer is not None:
            self.transaction.outer.hold_momentum()
        seconds = self.checkpoint_io.load(self.model, self.optimizer, url)
        self.transaction.discard_uncommitted()
        if generators is None:
            torch.manual_seed(rng.training_seed(self.spec.seed, self.spec.shard_index, step, self.spec.pp_index))
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

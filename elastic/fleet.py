"""The Ray edge of the driver: placement groups, rank actors and the rendezvous store.

Every Ray call of the driver lives here: placement, starting and killing ranks, starting a
run and reading its stream, pausing, probing and aborting, evaluations, copying state,
checkpoint calls. A run is one call per rank at a boundary (a streaming generator); its
steps make no call at all.
The controller and the checkpoint coordinator speak to ranks only through these methods, in
plain data (ranks, requests, reports), so a fake fleet drives them in tests without Ray.
Failures come back as the two exceptions of ``elastic.fleet_api``, which names the interface
the controller uses. Every control call has a deadline: ``collective_timeout_s`` plus a
margin for the quick ones (the cross-group rebuild), ``state_timeout_s`` for those that move the state (heal, save, restore).
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import ray
import torch.distributed as dist
from ray import ObjectRefGenerator
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic.config import TrainConfig
from elastic.fleet_api import CallFailed, Pending, RanksLost, RunStream
from elastic.core.memory_tier import Holdings, MemoryRestore
from elastic.core.topology import Topology
from elastic.core.protocol import (
    EvalRequest,
    HookFailed,
    Failure,
    PROGRESS_MESSAGES,
    Progress,
    RunEnd,
    RunMessage,
    RunSpec,
    StepReport,
    describe_error,
)
from workers.rank_spec import RankSpec
from workers.worker import RankActor

log = logging.getLogger("elastic.fleet")


# A quick control call (the cross-group rebuild) gets the collective timeout plus this margin.
CONTROL_MARGIN_S = 30.0
# A live rank answers what its memory tier holds on its control thread, in milliseconds.
HOLDINGS_TIMEOUT_S = 2.0


@dataclass
class Rendezvous:
    """The TCPStore every process group rendezvouses on, hosted by the driver.

    It listens only on the address the ranks reach the driver at: loopback for a local run
    (a Ray the driver started), the driver node's address on a cluster. torch's store
    server takes no bind address, so it is handed a socket bound there. It has no
    authentication either, and any client that reaches the port can list every key: the
    ranks bind each key and value to a secret that reaches them only through Ray
    (``workers.keyed_store``), so a client without it finds nothing usable and can plant
    nothing a rank trusts. The NetworkPolicy in ``deploy/kuberay`` keeps other pods from
    connecting at all.
    """

    host: str
    store: dist.TCPStore
    secret: str  # hex

    @classmethod
    def start(cls, host: str | None = None) -> Rendezvous:
        host = host or ray.util.get_node_ip_address()
        family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, kind)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False, use_libuv=True,
                              master_listen_fd=listener.detach())
        return cls(host, store, secrets.token_hex(32))

    @property
    def port(self) -> int:
        return self.store.port


def rank_spec(config: TrainConfig, topology: Topology, rendezvous: Rendezvous, global_rank: int) -> RankSpec:
    """What a rank's process is started with: its place in the layout, the store, its settings."""
    shard_index, tp_index = topology.position_of(global_rank)
    return RankSpec(
        global_rank=global_rank,
        group=topology.group_of(global_rank),
        group_rank=topology.group_rank(global_rank),
        shard_index=shard_index,
        tp_index=tp_index,
        shard=topology.shard,
        tp=topology.tp,
        seed=config.seed,
        use_gpu=config.scaling.uses_gpu,
        store_host=rendezvous.host,
        store_port=rendezvous.port,
        store_secret=rendezvous.secret,
        collective_timeout_s=config.fault_tolerance.collective_timeout_s,
        storage=config.checkpoint.storage_options(),
        upload_in_process=config.checkpoint.upload_in_process(config.scaling.uses_gpu),
        replicate_dtype=config.compute.replicate_precision,
    )


class Fleet:
    def __init__(self, config: TrainConfig, hooks, topology: Topology, rendezvous: Rendezvous,
                 actor_class=RankActor):
        self.config = config
        self.scaling = config.scaling
        self.topology = topology
        self.rendezvous = rendezvous
        self.actor_class = actor_class
        self.hooks_ref = ray.put(ray.cloudpickle.dumps(hooks))  # bytes: each rank unpickles them itself
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.placements: dict[int, PlacementGroup] = {}
        # One readiness reference per placement group: each ready() call submits a new task,
        # and a fresh one on every poll floods a busy node until none is ever scheduled.
        self.readiness: dict[int, ray.ObjectRef] = {}

    # placement

    def reserve(self, group: int) -> None:
        bundle = {"CPU": self.scaling.cpus_per_rank}
        if self.scaling.gpus_per_rank:
            bundle["GPU"] = self.scaling.gpus_per_rank
        strategy = "STRICT_PACK" if self.scaling.uses_gpu else "PACK"
        placement = placement_group([dict(bundle) for _ in range(self.topology.ranks_per_group)], strategy=strategy)
        self.placements[group] = placement
        self.readiness[group] = placement.ready()

    def placed(self, group: int) -> bool:
        ready, _ = ray.wait([self.readiness[group]], timeout=0)
        return bool(ready)

    def has_spare_slot(self) -> bool:
        """Whether the cluster could place one more rank now, outside every reserved group."""
        free = ray.available_resources()
        return (free.get("CPU", 0.0) >= self.scaling.cpus_per_rank
                and free.get("GPU", 0.0) >= self.scaling.gpus_per_rank)

    def release(self, group: int) -> None:
        placement = self.placements.pop(group, None)
        self.readiness.pop(group, None)
        if placement is not None:
            remove_placement_group(placement)

    # rank processes

    def start(self, ranks) -> Pending:
        """Start (or replace) the ranks' processes in their groups' bundles."""
        refs = {}
        for rank in ranks:
            self.kill(rank)
            actor = self.actor_class.options(
                num_cpus=self.scaling.cpus_per_rank,
                num_gpus=self.scaling.gpus_per_rank or 0,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placements[self.topology.group_of(rank)],
                    placement_group_bundle_index=self.topology.group_rank(rank),
                ),
            ).remote(rank_spec(self.config, self.topology, self.rendezvous, rank), self.hooks_ref)
            self.actors[rank] = actor
            refs[rank] = actor.node.remote()
        return Pending(refs)

    def build(self, ranks, generation: int) -> Pending:
        return self._call(ranks, "build", generation)

    def alive(self, rank: int, timeout: float = 5.0) -> bool:
        return rank in self.responsive([rank], timeout)

    def responsive(self, ranks, timeout: float = 5.0) -> set[int]:
        """The ranks whose processes answer within ``timeout``, asked all at once."""
        return set(self._answers(ranks, "node", timeout))

    def _answers(self, ranks, method: str, timeout: float) -> dict[int, object]:
        """What the ranks that answer ``method`` within ``timeout`` answered, asked all at once."""
        refs = {getattr(self.actors[rank], method).remote(): rank for rank in ranks if rank in self.actors}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout) if refs else ([], [])
        answered = {}
        for ref in ready:
            try:
                answered[refs[ref]] = ray.get(ref, timeout=0)
            except RayError:
                continue
        return answered

    def kill(self, global_rank: int) -> None:
        actor = self.actors.pop(global_rank, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def kill_group(self, group: int) -> None:
        for rank in self.topology.global_ranks(group):
            self.kill(rank)
        self.release(group)

    # calls in flight

    def _call(self, ranks, method: str, *args) -> Pending:
        return Pending({rank: getattr(self.actors[rank], method).remote(*args) for rank in ranks})

    def done(self, pending: Pending, timeout: float = 0.0) -> bool:
        refs = list(pending.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        return len(ready) == len(refs)

    def results(self, pending: Pending, timeout: float | None = None, call: str = "") -> dict[int, object]:
        """Every rank's result, waited for together until ``timeout``; ``RanksLost`` names
        every rank whose process is gone, and ``CallFailed`` every living rank that raised or
        did not answer in time. Any Ray error counts: a task error, out of memory, a timeout."""
        refs = list(pending.refs.values())
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        ready = set(ready)
        results, lost, failed, hooks_failed = {}, {}, {}, {}
        for rank, ref in pending.refs.items():
            if ref not in ready:
                failed[rank] = f"no answer within {timeout:.0f}s"
                continue
            try:
                results[rank] = ray.get(ref, timeout=0)
            except RayActorError as error:
                lost[rank] = describe_error(error, 300)
            except RayTaskError as error:
                if isinstance(error.cause, HookFailed):  # its own one line, not Ray's traceback
                    failed[rank] = hooks_failed[rank] = str(error.cause)
                else:
                    failed[rank] = describe_error(error, 500)
            except (RayError, GetTimeoutError) as error:
                failed[rank] = describe_error(error, 500)
        if lost:
            raise RanksLost(list(lost), "; ".join(f"rank {r}: {e}" for r, e in sorted(lost.items())), call)
        if failed:
            raise CallFailed(list(failed), "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items())), call,
                             hooks_failed)
        return results

    # runs

    def start_run(self, specs: dict[int, RunSpec]) -> RunStream:
        """Start a run on every rank; a spec shared by ranks is sent once."""
        shared: dict[int, ray.ObjectRef] = {}
        generators = {}
        for rank, spec in specs.items():
            ref = shared.setdefault(id(spec), ray.put(spec))
            generators[rank] = self.actors[rank].run.options(num_returns="streaming").remote(ref)
        run = next(iter(specs.values())).run
        return RunStream(run, generators)

    def next_messages(self, stream: RunStream, timeout: float,
                      ranks: Iterable[int] | None = None) -> list[tuple[int, RunMessage | None]]:
        """The messages that arrive within ``timeout`` (at least one unless it passes), one
        per rank at most, from ``ranks`` (default: every rank still in the stream); ``None``
        for a rank whose process is gone. A rank leaves the stream with its ``RunEnd``."""
        watched = stream.generators if ranks is None else {
            rank: stream.generators[rank] for rank in ranks if rank in stream.generators}
        generators = list(watched.values())
        if not generators:
            return []
        ready, rest = ray.wait(generators, num_returns=1, timeout=max(0.0, timeout))
        if ready and rest:
            ready += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        rank_of = {id(generator): rank for rank, generator in watched.items()}
        arrived = []
        for generator in ready:
            rank = rank_of[id(generator)]
            message = self._next_message(rank, generator)
            if not isinstance(message, PROGRESS_MESSAGES):
                del stream.generators[rank]
            arrived.append((rank, message))
        return arrived

    @staticmethod
    def _next_message(rank: int, generator: ObjectRefGenerator) -> RunMessage | None:
        try:
            return ray.get(next(generator))
        except (StopIteration, RayActorError):
            return None
        except RayError as error:  # the run itself raised: a defect, reported as the rank's failure
            return RunEnd(rank, -1, StepReport(rank, -1, error=describe_error(error), failure=Failure.OWN_COMPUTE,
                                               group_broken=True))

    def request_pause(self, ranks, run: int) -> None:
        for rank in ranks:
            if rank in self.actors:
                self.actors[rank].request_pause.remote(run)

    # evaluations

    def evaluate(self, requests: dict[int, EvalRequest]) -> Pending:
        return Pending({rank: self.actors[rank].evaluate.remote(request) for rank, request in requests.items()})

    def next_reports(self, pending: Pending, timeout: float) -> list[tuple[int, StepReport | None]]:
        """Reports that arrive within ``timeout`` (at least one unless it passes), taken out
        of ``pending``; ``None`` for a rank whose process is gone."""
        rank_of = {ref: rank for rank, ref in pending.refs.items()}
        ready, _ = ray.wait(list(rank_of), num_returns=1, timeout=max(0.0, timeout))
        arrived = []
        for ref in ready:
            rank = rank_of[ref]
            del pending.refs[rank]
            try:
                arrived.append((rank, ray.get(ref)))
            except RayError:
                arrived.append((rank, None))
        return arrived

    def abort_step(self, ranks, attempt: int) -> None:
        for rank in ranks:
            if rank in self.actors:
                self.actors[rank].abort_step.remote(attempt)

    def probe(self, ranks, timeout: float) -> dict[int, Progress]:
        refs = {rank: self.actors[rank].probe.remote() for rank in ranks if rank in self.actors}
        progress = {}
        for rank, ref in refs.items():
            try:
                progress[rank] = ray.get(ref, timeout=timeout)
            except (GetTimeoutError, RayError):
                continue
        return progress

    # state

    @property
    def quick_call_s(self) -> float:
        return self.config.fault_tolerance.collective_timeout_s + CONTROL_MARGIN_S

    @property
    def state_call_s(self) -> float:
        return self.config.fault_tolerance.state_timeout_s

    def copy_state(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each source rank's committed state into its target rank."""
        self.results(Pending({
            target: self.actors[target].import_state.remote(self.actors[source].export_state.remote())
            for source, target in pairs
        }), self.state_call_s, "import_state")

    def join_replicas(self, assignments: dict[int, tuple[int, int, int]]) -> None:
        """``rank -> (generation, replica rank, replica count)``: rebuild the cross-group groups."""
        self.results(Pending({
            rank: self.actors[rank].join_replicas.remote(*assignment) for rank, assignment in assignments.items()
        }), self.quick_call_s, "join_replicas")

    def local_parameters(self, ranks) -> dict[int, list]:
        return self.results(self._call(ranks, "local_parameters"), self.state_call_s, "local_parameters")

    # the memory tier

    def set_buddies(self, buddies: dict[int, int | None]) -> None:
        """Tell each rank which rank keeps the copies of its state in memory (None: none)."""
        self.results(Pending({
            rank: self.actors[rank].set_buddy.remote(None if buddy is None else self.actors[buddy])
            for rank, buddy in buddies.items()
        }), self.quick_call_s, "set_buddy")

    def memory_holdings(self, ranks) -> dict[int, Holdings]:
        """What each rank holds in host memory; a rank that is gone, or still starting (a fresh
        process holds nothing), does not answer in time and is left out."""
        return self._answers(ranks, "memory_holdings", HOLDINGS_TIMEOUT_S)

    def restore_memory(self, plan: MemoryRestore) -> None:
        """Every rank of ``plan`` back at its step: from its own copy, or a holder's copy of its state."""
        own = {rank: self.actors[rank].restore_memory.remote(plan.step) for rank in plan.own}
        transfers = {owner: self.actors[owner].import_held.remote(self.actors[holder].export_held.remote(
            owner, plan.step)) for holder, owner in plan.transfers}
        self.results(Pending(own | transfers), self.state_call_s, "restore_memory")

    # checkpoints

    def save(self, ranks, url: str) -> None:
        """Stage the ranks' committed state for an upload to ``url`` (the training stall)."""
        self.results(self._call(ranks, "save_checkpoint", url), self.state_call_s, "save_checkpoint")

    def finish_saves(self, ranks) -> Pending:
        return self._call(ranks, "finish_checkpoint")

    def abandon_saves(self, ranks) -> None:
        """End the ranks' uploads of a save given up on: each kills its upload process."""
        self.results(Pending({
            rank: self.actors[rank].abandon_checkpoint.remote() for rank in ranks if rank in self.actors
        }), self.quick_call_s, "abandon_checkpoint")

    def restore(self, ranks, url: str, step: int, generators: dict[int, dict[str, bytes] | None]) -> None:
        """Load the checkpoint at ``url`` (of ``step``) into the ranks, each with its saved
        generator states (``None``: restart its stream from the seed and ``step``)."""
        self.results(Pending({
            rank: self.actors[rank].load_checkpoint.remote(url, step, generators[rank]) for rank in ranks
        }), self.state_call_s, "load_checkpoint")

    def shutdown(self) -> None:
        for rank in list(self.actors):
            self.kill(rank)
        for group in list(self.placements):
            self.release(group)

"""The Ray edge of the driver: placement groups, rank actors and the rendezvous store.

Everything that touches Ray's API for actors lives here, so the controller reads as the
step protocol and its decisions stay testable without Ray.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
import torch.distributed as dist
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic.config import TrainConfig
from elastic.membership import Membership
from workers.protocol import RankSpec
from workers.worker import RankActor

log = logging.getLogger("elastic.fleet")

ACTOR_ERRORS = (RayActorError,)


@dataclass
class Rendezvous:
    """The TCPStore every process group rendezvouses on, hosted by the driver."""

    host: str
    store: dist.TCPStore

    @classmethod
    def start(cls) -> Rendezvous:
        host = ray.util.get_node_ip_address()
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        return cls(host, store)

    @property
    def port(self) -> int:
        return self.store.port


class Fleet:
    def __init__(self, config: TrainConfig, hooks, membership: Membership, rendezvous: Rendezvous):
        self.config = config
        self.scaling = config.scaling
        self.membership = membership
        self.rendezvous = rendezvous
        self.hooks_ref = ray.put(hooks)
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.placements: dict[int, PlacementGroup] = {}
        # One readiness reference per placement group: each ready() call submits a new task,
        # and a fresh one on every poll floods a busy node until none is ever scheduled.
        self.readiness: dict[int, ray.ObjectRef] = {}

    # placement

    def reserve(self, group: int) -> PlacementGroup:
        bundle = {"CPU": self.scaling.cpus_per_rank}
        if self.scaling.gpus_per_rank:
            bundle["GPU"] = self.scaling.gpus_per_rank
        strategy = "STRICT_PACK" if self.scaling.uses_gpu else "PACK"
        placement = placement_group([dict(bundle) for _ in range(self.scaling.ranks_per_group)], strategy=strategy)
        self.placements[group] = placement
        self.readiness[group] = placement.ready()
        return placement

    def placed(self, group: int, timeout: float = 0.0) -> bool:
        ready, _ = ray.wait([self.readiness[group]], timeout=timeout)
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

    # actors

    def spec(self, global_rank: int) -> RankSpec:
        shard_index, tp_index = self.membership.position_of(global_rank)
        return RankSpec(
            global_rank=global_rank,
            group=self.membership.group_of(global_rank),
            shard_index=shard_index,
            tp_index=tp_index,
            shard=self.scaling.shard,
            tp=self.scaling.tp,
            seed=self.config.seed,
            use_gpu=self.scaling.uses_gpu,
            store_host=self.rendezvous.host,
            store_port=self.rendezvous.port,
            collective_timeout_s=self.config.fault_tolerance.collective_timeout_s,
            storage=self.config.checkpoint.storage_options(),
            upload_in_process=self.config.checkpoint.upload_in_process(self.scaling.uses_gpu),
            replicate_dtype=self.config.compute.replicate_precision,
        )

    def start_rank(self, global_rank: int) -> ray.ObjectRef:
        """Start (or replace) a rank's actor in its group's bundle; returns a readiness ref."""
        group = self.membership.group_of(global_rank)
        bundle_index = global_rank % self.scaling.ranks_per_group
        actor = RankActor.options(
            num_cpus=self.scaling.cpus_per_rank,
            num_gpus=self.scaling.gpus_per_rank or 0,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placements[group], placement_group_bundle_index=bundle_index
            ),
        ).remote(self.spec(global_rank), self.hooks_ref)
        self.actors[global_rank] = actor
        return actor.node.remote()

    def kill(self, global_rank: int) -> None:
        actor = self.actors.pop(global_rank, None)
        if actor is not None:
            ray.kill(actor, no_restart=True)

    def kill_group(self, group: int) -> None:
        for rank in self.membership.global_ranks(group):
            self.kill(rank)
        self.release(group)

    def call(self, ranks, method: str, *args) -> dict[int, ray.ObjectRef]:
        return {rank: getattr(self.actors[rank], method).remote(*args) for rank in ranks}

    def abort_step(self, ranks, attempt: int) -> None:
        for rank in ranks:
            if rank in self.actors:
                self.actors[rank].abort_step.remote(attempt)

    def probe(self, ranks, timeout: float) -> dict:
        refs = {rank: self.actors[rank].probe.remote() for rank in ranks if rank in self.actors}
        progress = {}
        for rank, ref in refs.items():
            try:
                progress[rank] = ray.get(ref, timeout=timeout)
            except (GetTimeoutError, *ACTOR_ERRORS):
                continue
        return progress

    def shutdown(self) -> None:
        for rank in list(self.actors):
            self.kill(rank)
        for group in list(self.placements):
            self.release(group)

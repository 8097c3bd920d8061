"""The rank processes and the bundles they live in: the placement groups, starting and
killing rank actors, and the warm spares (``elastic.core.spares``) kept started ahead.

Each group's ranks have a placement group of their own (its bundles packed on one node on
GPUs), the spares one more, spread over nodes; ``Slots`` keeps which process is in which
bundle, since a spare that takes a rank's place stays where it started.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elastic.setup.config import TrainConfig
from elastic.core.protocol import describe_error
from elastic.core.spares import SPARES, Slot, Slots, Spare
from elastic.core.topology import Topology
from elastic.fleet.api import Pending
from elastic.fleet.rendezvous import Rendezvous
from checkpointing.pretrained import PretrainedSource, pretrained_source
from workers.rank_spec import SPARE, RankSpec
from workers.worker import RankActor


def rank_spec(config: TrainConfig, topology: Topology, rendezvous: Rendezvous, global_rank: int,
              pretrained: PretrainedSource | None = None) -> RankSpec:
    """What a rank's process is started with: its place in the layout, the store, its settings,
    and the weights its builds load (``pretrained``)."""
    position = topology.position_of(global_rank)
    scaling = config.scaling
    return RankSpec(
        global_rank=global_rank,
        group=topology.group_of(global_rank),
        group_rank=topology.group_rank(global_rank),
        shard_index=position.shard,
        tp_index=position.tp,
        pp_index=position.pp,
        pp_schedule=scaling.pp_schedule,
        stages_per_rank=scaling.stages_per_rank,
        micro_batch=config.micro_batch,
        layout=topology,
        cp_index=position.cp,
        seed=config.seed,
        use_gpu=config.scaling.uses_gpu,
        gpu_collectives=config.scaling.gpu_collectives,
        store_host=rendezvous.host,
        store_port=rendezvous.port,
        store_secret=rendezvous.secret,
        collective_timeout_s=config.fault_tolerance.collective_timeout_s,
        storage=config.checkpoint.storage_options(),
        upload_in_process=config.checkpoint.upload_in_process(config.scaling.uses_gpu),
        replicate_dtype=config.compute.replicate_precision,
        outer_rounds=config.sync.outer_rounds,
        pretrained=pretrained,
    )


def start_error(error: RayError) -> str | None:
    """What a rank's process raised as it started, in one line (the error's last, which names
    its cause), where ``error`` says so: the rank's code could not be imported there, or its
    constructor raised. The code's or its environment's error, which a fresh process raises
    again, not a death; None for any other error."""
    if not (isinstance(error, RayActorError) and error.actor_init_failed):
        return None
    return f"its process could not start the rank's code: {str(error).strip().splitlines()[-1]}"


@dataclass
class SpareProcess:
    actor: ray.actor.ActorHandle
    warming: ray.ObjectRef | None  # its warm-up call; None once it answered
    node: str | None = None


class RankProcesses:
    def __init__(self, config: TrainConfig, hooks, topology: Topology, rendezvous: Rendezvous,
                 actor_class=RankActor):
        self.config = config
        self.scaling = config.scaling
        self.topology = topology
        self.rendezvous = rendezvous
        self.actor_class = actor_class
        # A built group holds the run's initial state: the weights of model.init_from, until
        # the run is known to resume from its own checkpoint.
        self.pretrained = pretrained_source(config.model, config.checkpoint.storage_options())
        self.hooks_ref = ray.put(ray.cloudpickle.dumps(hooks))  # bytes: each rank unpickles them itself
        self.actors: dict[int, ray.actor.ActorHandle] = {}
        self.placements: dict[int | str, PlacementGroup] = {}  # by group, and SPARES
        self.slots = Slots()  # which process is in which bundle
        self.spare_processes: dict[int, SpareProcess] = {}
        self.spares_started = 0
        # One readiness reference per placement group: each ready() call submits a new task,
        # and a fresh one on every poll floods a busy node until none is ever scheduled.
        self.readiness: dict[int | str, ray.ObjectRef] = {}

    # placement

    def reserve(self, group: int) -> None:
        # A group's GPUs on one node; a pipeline's stages on as few as can hold them.
        strategy = "STRICT_PACK" if self.scaling.uses_gpu and self.scaling.pp == 1 else "PACK"
        self._place(group, self.topology.ranks_per_group, strategy)

    def reserve_spares(self) -> None:
        """The spares' own bundles, spread over nodes where the cluster has several: a node
        lost with ranks on it then keeps spares elsewhere."""
        if self.scaling.spares:
            self._place(SPARES, self.scaling.spares, "SPREAD")

    def _place(self, placement: int | str, bundles: int, strategy: str) -> None:
        bundle = {"CPU": self.scaling.cpus_per_rank}
        if self.scaling.gpus_per_rank:
            bundle["GPU"] = self.scaling.gpus_per_rank
        self.placements[placement] = placement_group([dict(bundle) for _ in range(bundles)], strategy=strategy)
        self.readiness[placement] = self.placements[placement].ready()
        self.slots.add_placement(placement, bundles)

    def placed(self, placement: int | str) -> bool:
        if placement not in self.readiness:
            return False
        ready, _ = ray.wait([self.readiness[placement]], timeout=0)
        return bool(ready)

    def resume_from_checkpoint(self) -> None:
        """The run resumes from its own checkpoints: builds never read model.init_from again."""
        self.pretrained = None

    def has_spare_slot(self) -> bool:
        """Whether a rank could be replaced now without waiting for the cluster: a warm spare
        is ready, or one more rank fits outside every reserved bundle."""
        if any(spare.warming is None for spare in self.spare_processes.values()):
            return True
        free = ray.available_resources()
        return (free.get("CPU", 0.0) >= self.scaling.cpus_per_rank
                and free.get("GPU", 0.0) >= self.scaling.gpus_per_rank)

    def release(self, placement: int | str) -> None:
        self.readiness.pop(placement, None)
        if placement in self.placements:
            remove_placement_group(self.placements.pop(placement))

    # rank processes

    def start(self, ranks, spares: dict[int, int] | None = None) -> Pending:
        """Start (or replace) the ranks' processes: ``spares`` (rank -> spare id) take their
        ranks' places, the others start in their groups' bundles (see ``Slots``)."""
        spares = spares or {}
        for rank in ranks:
            self.kill(rank)
        refs = {}
        for rank in ranks:
            spec = rank_spec(self.config, self.topology, self.rendezvous, rank, self.pretrained)
            if rank in spares:
                self.actors[rank] = self.spare_processes.pop(spares[rank]).actor
                self.slots.spare_takes_place(spares[rank], rank)
                refs[rank] = self.actors[rank].assume.remote(spec)  # after its warm-up, if still warming
                continue
            home = (self.topology.group_of(rank), self.topology.group_rank(rank))
            self.actors[rank] = self._process(self.slots.for_rank(rank, home, self.placed), spec)
            refs[rank] = self.actors[rank].node.remote()
        return Pending(refs)

    def _process(self, slot: Slot, spec: RankSpec) -> ray.actor.ActorHandle:
        placement, bundle = slot
        return self.actor_class.options(
            num_cpus=self.scaling.cpus_per_rank,
            num_gpus=self.scaling.gpus_per_rank or 0,
            max_restarts=0,
            max_task_retries=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placements[placement], placement_group_bundle_index=bundle),
        ).remote(spec, self.hooks_ref)

    # warm spares

    def start_spares(self, count: int) -> list[int]:
        """Start up to ``count`` spares in vacant bundles; returns the ids of those started."""
        spec = replace(rank_spec(self.config, self.topology, self.rendezvous, 0, self.pretrained), global_rank=SPARE,
                       group=SPARE)
        started = []
        for _ in range(count):
            slot = self.slots.for_spare(self.spares_started, self.placed)
            if slot is None:
                break
            actor = self._process(slot, spec)
            self.spare_processes[self.spares_started] = SpareProcess(actor, actor.warm.remote())
            started.append(self.spares_started)
            self.spares_started += 1
        return started

    def spares(self) -> list[Spare]:
        """Every spare, ready once its warm-up answered; one whose process died or whose
        warm-up raised is reported once, with why, and forgotten."""
        spares = []
        for spare_id, spare in list(self.spare_processes.items()):
            if spare.warming is not None and ray.wait([spare.warming], timeout=0)[0]:
                try:
                    spare.node, spare.warming = ray.get(spare.warming)["ip"], None
                except RayError as error:
                    self._drop_spare(spare_id)
                    spares.append(Spare(spare_id, False, lost=describe_error(error, 300),
                                        warm_up_raised=isinstance(error, RayTaskError) or bool(start_error(error))))
                    continue
            spares.append(Spare(spare_id, spare.warming is None, spare.node))
        return spares

    def _drop_spare(self, spare_id: int) -> None:
        ray.kill(self.spare_processes.pop(spare_id).actor, no_restart=True)
        self.slots.leave(spare=spare_id)

    def kill(self, global_rank: int) -> None:
        actor = self.actors.pop(global_rank, None)
        self.slots.leave(rank=global_rank)
        if actor is not None:
            ray.kill(actor, no_restart=True)
        for placement in self.slots.releasable():
            self.release(placement)

    def kill_group(self, group: int) -> None:
        """End the group's ranks and the spares in its bundles, and release its placement
        (once no rank of another group, a spare that took a place, lives there)."""
        for rank in self.topology.global_ranks(group):
            self.kill(rank)
        for spare_id in self.slots.spares_in(group):
            self._drop_spare(spare_id)
        if self.slots.give_up(group):
            self.release(group)

    def shutdown(self) -> None:
        for rank in list(self.actors):
            self.kill(rank)
        for spare_id in list(self.spare_processes):
            self._drop_spare(spare_id)
        for placement in list(self.placements):
            self.release(placement)

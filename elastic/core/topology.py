"""The layout of a run: replica groups of ``pp x shard x cp x tp`` ranks, numbered globally.

The one owner of the parallel layout: its degrees (``pp``, ``shard``, ``cp``, ``tp``, and
``ep``, which splits the shard dimension), every formula over them (the ranks of a group, the
ranks FSDP2 shards over, whether the experts are split), the group's mesh (its dimensions,
every one named at every degree, and those flattened from others: ``workers.world.group_mesh``
only builds it, and the ranks read the degrees back from it), the
numbering and the record a checkpoint and a summary keep. The config builds it
(``ScalingConfig.topology``); a rank reads its group's from what it is started with
(``workers.rank_spec.RankSpec.layout``).

The rank <-> (group, pipeline index, shard index, cp index, tp index) formulas: a group's
ranks are consecutive, and inside a group the tp index varies fastest,
then the cp index, then the shard index, then the pipeline stage, so a group rank doubles as
the rank's bundle index in its group's placement group (TP neighbours packed together, then
context-parallel ones) and as its rank in the group's world. The ``cp`` ranks of a shard
position take the same rows, each its own chunks of every sequence
(``workers.context_parallel``).
With expert parallelism the shard ranks are ``shard / ep`` blocks of ``ep`` consecutive ones:
a block splits the experts among its ranks, and the blocks shard each rank's experts
(``workers.world.group_mesh`` lays the group's mesh out so).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


# The pipeline schedules (``scaling.pp_schedule``) that run one stage per rank; the others
# loop several stages over the ranks.
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")


class Position(NamedTuple):
    """Where a rank sits in its group: ranks at the same position in different groups hold
    the same part of the model and sum their gradients across groups."""

    pp: int
    shard: int
    tp: int
    cp: int = 0


def counts_loss(position: Position, pp: int) -> bool:
    """Whether the loss share of the rank at ``position`` (of ``pp`` stages) counts: the last
    stage computes the loss, and its tp ranks share one, counted by the first (its cp ranks
    each compute their own tokens' part)."""
    return position.pp == pp - 1 and position.tp == 0


# A group's mesh: its dimensions, slowest first, and those flattened from them (the flattened
# one's name to the names it spans), as ``Topology.mesh_shape`` lays them out.
MESH_DIMENSIONS = ("pp", "expert_shard", "ep", "cp", "tp")
MESH_FLATTENED = {"shard": ("expert_shard", "ep"), "shard_cp": ("expert_shard", "ep", "cp")}


class MeshShape(NamedTuple):
    """A group's device mesh: its dimensions' sizes and names, slowest first, and the
    dimensions flattened from others (the flattened one's name to the names it spans)."""

    sizes: tuple[int, ...]
    names: tuple[str, ...]
    flattened: dict[str, tuple[str, ...]]

    def size(self, name: str) -> int:
        """The size of dimension ``name``, flattened or not: ``mesh[name].size()`` on the mesh."""
        spanned = self.flattened.get(name, (name,))
        sizes = dict(zip(self.names, self.sizes))
        return math.prod(sizes[part] for part in spanned)


@dataclass(frozen=True)
class Topology:
    shard: int
    tp: int
    max_groups: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def ranks_per_group(self) -> int:
        return self.pp * self.shard * self.cp * self.tp

    @property
    def fsdp_ranks(self) -> int:
        """The ranks FSDP2 shards a group's parameters over (1: none, the model unwrapped)."""
        return self.shard * self.cp * self.tp

    @property
    def parameter_shards(self) -> int:
        """The pieces FSDP2 cuts each parameter (of a tp rank's part) into: ``shard x cp``."""
        return self.shard * self.cp

    @property
    def sequence_shards(self) -> int:
        """The pieces sequence parallelism cuts a sequence into: each cp rank's share, cut
        again over its tp ranks."""
        return self.cp * self.tp

    @property
    def expert_parallel(self) -> bool:
        """Whether a mixture's experts are split over the ``ep`` shard ranks, dispatched to by
        all-to-all (``workers.parallelize.split_experts``)."""
        return self.ep > 1

    @property
    def experts_held_whole(self) -> bool:
        """Whether each shard rank holds its split experts whole (``ep == shard``), which FSDP2
        then leaves alone; below it FSDP2 shards them over the ``shard / ep`` blocks."""
        return self.expert_parallel and self.ep == self.shard

    def group_dimensions(self) -> dict[str, int]:
        """A group's dimensions by name, whose product is its ranks (cp where it splits sequences)."""
        return {"pp": self.pp, "shard": self.shard, **({"cp": self.cp} if self.cp > 1 else {}), "tp": self.tp}

    def mesh_shape(self) -> MeshShape:
        """The group's mesh: ``(pp, expert_shard, ep, cp, tp)``, every dimension named at every
        degree (1 included), with ``shard`` flattened from ``expert_shard x ep`` and ``shard_cp``
        from ``expert_shard x ep x cp``, so that a ``parallelize_fn`` reads each degree from the
        mesh alone (``mesh["ep"].size()``, ``mesh["shard"].size()``, ``mesh["cp"].size()``).
        The shard ranks are ``shard / ep`` blocks (``expert_shard``) of ``ep`` consecutive ones
        (a shard rank's block is ``shard_index // ep``, its place in it ``shard_index % ep``):
        the experts split over ``ep`` (at ``ep == 1``, not split; at ``ep == shard``, over every
        shard rank, ``expert_shard`` of size 1) and sharded by FSDP2 over ``expert_shard``, the
        rest of the model over ``shard``, or over ``shard_cp`` with context parallelism (the cp
        ranks hold different tokens, so their gradients add up like the shard ranks'). In
        TorchTitan's ``ParallelDims`` names: ``shard`` is ``dp_shard``, ``shard_cp``
        ``dp_shard_cp``, ``expert_shard`` ``dp_shard_mod_ep``; our ``ep`` lies inside
        ``shard`` alone (no cp or tp ranks in it)."""
        return MeshShape((self.pp, self.shard // self.ep, self.ep, self.cp, self.tp), MESH_DIMENSIONS,
                         dict(MESH_FLATTENED))

    @property
    def max_ranks(self) -> int:
        return self.max_groups * self.ranks_per_group

    def global_ranks(self, group: int) -> range:
        return range(group * self.ranks_per_group, (group + 1) * self.ranks_per_group)

    def ranks_of(self, groups: Iterable[int]) -> list[int]:
        return [rank for group in groups for rank in self.global_ranks(group)]

    def group_of(self, global_rank: int) -> int:
        return global_rank // self.ranks_per_group

    def group_rank(self, global_rank: int) -> int:
        """The rank inside its group's world, and its bundle index in the group's placement."""
        return global_rank % self.ranks_per_group

    def position_of(self, global_rank: int) -> Position:
        stage_shard_cp, tp_index = divmod(self.group_rank(global_rank), self.tp)
        stage_and_shard, cp_index = divmod(stage_shard_cp, self.cp)
        return Position(*divmod(stage_and_shard, self.shard), tp_index, cp_index)

    def shard_index(self, global_rank: int) -> int:
        return self.position_of(global_rank).shard

    def counts_loss(self, global_rank: int) -> bool:
        return counts_loss(self.position_of(global_rank), self.pp)

    def stream_of(self, global_rank: int) -> str:
        """The name of the random stream the rank draws from, as a checkpoint keeps it: one per
        shard position and stage, shared by its tp and cp ranks (the first saves it). The first
        stage's is named by the shard index alone, as before there were stages."""
        position = self.position_of(global_rank)
        return str(position.shard) if position.pp == 0 else f"{position.shard}.stage{position.pp}"

    def saves_stream(self, global_rank: int) -> bool:
        """Whether the rank saves its random stream (``stream_of``) in a checkpoint."""
        position = self.position_of(global_rank)
        return position.tp == 0 and position.cp == 0

    def record(self) -> dict[str, int]:
        """What a checkpoint manifest says of the layout that wrote it."""
        return {**self.degrees(), "max_groups": self.max_groups}

    def degrees(self) -> dict[str, int]:
        """A group's degrees by name, ``ep`` (a split of ``shard``) with them."""
        return {"pp": self.pp, "shard": self.shard, "cp": self.cp, "tp": self.tp, "ep": self.ep}

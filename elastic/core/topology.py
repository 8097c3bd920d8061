"""The layout of a run: replica groups of ``pp x shard x cp x tp`` ranks, numbered globally.

The one owner of the rank <-> (group, pipeline index, shard index, cp index, tp index)
formulas: a group's ranks are consecutive, and inside a group the tp index varies fastest,
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
        return {"pp": self.pp, "shard": self.shard, "cp": self.cp, "tp": self.tp, "max_groups": self.max_groups}

"""The layout of a run: replica groups of ``shard x tp`` ranks, numbered globally.

The one owner of the rank <-> (group, shard index, tp index) formulas: a group's ranks are
consecutive, and inside a group the tp index varies fastest, so a group rank doubles as the
rank's bundle index in its group's placement group and as its rank in the group's world.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    shard: int
    tp: int
    max_groups: int = 1

    @property
    def ranks_per_group(self) -> int:
        return self.shard * self.tp

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

    def position_of(self, global_rank: int) -> tuple[int, int]:
        """``(shard index, tp index)``: ranks at the same position in different groups hold
        the same shard and sum their gradients across groups."""
        return divmod(self.group_rank(global_rank), self.tp)

    def shard_index(self, global_rank: int) -> int:
        return self.position_of(global_rank)[0]

    def leads_tp(self, global_rank: int) -> bool:
        """Whether the rank is its tp group's first: tp ranks share a loss, counted once."""
        return self.position_of(global_rank)[1] == 0

    def record(self) -> dict[str, int]:
        """What a checkpoint manifest says of the layout that wrote it."""
        return {"shard": self.shard, "tp": self.tp, "max_groups": self.max_groups}

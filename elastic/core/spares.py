"""Warm spares: rank processes started ahead, which a group takes instead of starting one.

Starting a rank's process (a Ray worker, importing torch, loading the hooks, a CUDA context)
takes seconds, while its group is out of the quorum and the others carry its batch. A spare
has done all of that already (``scaling.spares`` of them, kept topped up in the background):
a group that must replace a rank gives the spare the rank's place, and only builds its
world and heals. Pure: the fleet reports its spares (``Spare``), this module decides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Spare:
    id: int
    ready: bool  # started and warmed up; a spare still starting is taken only when no ready one is left
    node: str | None = None  # where it runs, once it is ready
    lost: str | None = None  # why it is gone (reported once): its process died, or its warm-up raised
    warm_up_raised: bool = False  # the hooks' own error, which every new spare would raise again


def choose_spares(ranks: Iterable[int], spares: Iterable[Spare], node_of: Mapping[int, str],
                  near: Mapping[int, str] | None = None) -> dict[int, int]:
    """``rank -> spare id`` for the ranks that take a spare (the rest start a process).

    Ready spares first, then spares still starting (ahead of a fresh start all the same).
    Among them, where ``near`` names the node a rank's group must stay on (on GPUs a group
    is packed on one node: its TP and FSDP collectives run over NVLink), one on that node;
    then one on a node other than the one the rank was last on (``node_of``): the rank may
    have been lost with its node, or been slow because of it."""
    near = near or {}

    def preference(rank: int, spare: Spare) -> tuple:
        away = rank in near and spare.node != near[rank]
        same_node = spare.node is not None and spare.node == node_of.get(rank)
        return (not spare.ready, away, same_node, spare.id)

    free = list(spares)
    chosen = {}
    for rank in sorted(ranks):
        if not free:
            break
        spare = min(free, key=lambda candidate: preference(rank, candidate))
        free.remove(spare)
        chosen[rank] = spare.id
    return chosen


SPARES = "spares"  # the placement of the spares' own bundles
Slot = tuple[int | str, int]  # (placement: a group, or SPARES; bundle index)


class Slots:
    """Which process occupies each bundle of the run's placements: a rank's or a spare's.

    A rank's process starts in its own bundle of its group's placement (its *home*), but a
    spare that takes a rank's place keeps the bundle it started in, so a rank may live in
    the spares' placement or another group's, and the home it left takes the next spare:
    the run holds as many bundles as it has ranks and spares, whichever process is where.
    A placement given up while a rank of another group still lives in it is *retired*: no
    process starts there any more, and it is released once its last rank is gone.
    """

    def __init__(self):
        self.sizes: dict[int | str, int] = {}  # placement -> its bundles
        self.of_rank: dict[int, Slot] = {}
        self.of_spare: dict[int, Slot] = {}
        self.retired: set[int | str] = set()

    def add_placement(self, placement: int | str, bundles: int) -> None:
        self.sizes[placement] = bundles

    def vacant(self, placed: Callable[[int | str], bool]) -> list[Slot]:
        """The bundles no process occupies, of placements the cluster has placed: the
        spares' own first, then the groups' in order."""
        taken = set(self.of_rank.values()) | set(self.of_spare.values())
        order = sorted(self.sizes, key=lambda placement: (placement != SPARES, str(placement)))
        return [(placement, bundle) for placement in order
                if placement not in self.retired and placed(placement)
                for bundle in range(self.sizes[placement]) if (placement, bundle) not in taken]

    def for_rank(self, rank: int, home: Slot, placed: Callable[[int | str], bool]) -> Slot:
        """Where a fresh process of ``rank`` starts: its home, else any vacant bundle (its
        home holds a spare or another group's rank); with none, its home all the same (the
        process waits there for the bundle)."""
        vacant = self.vacant(placed)
        slot = home if home in vacant or not vacant else vacant[0]
        self.of_rank[rank] = slot
        return slot

    def for_spare(self, spare: int, placed: Callable[[int | str], bool]) -> Slot | None:
        """Where a new spare starts: the first vacant bundle (None: none is vacant)."""
        vacant = self.vacant(placed)
        if not vacant:
            return None
        self.of_spare[spare] = vacant[0]
        return vacant[0]

    def spare_takes_place(self, spare: int, rank: int) -> None:
        self.of_rank[rank] = self.of_spare.pop(spare)

    def leave(self, rank: int | None = None, spare: int | None = None) -> None:
        if rank is not None:
            self.of_rank.pop(rank, None)
        if spare is not None:
            self.of_spare.pop(spare, None)

    def spares_in(self, placement: int | str) -> list[int]:
        return [spare for spare, slot in self.of_spare.items() if slot[0] == placement]

    def give_up(self, placement: int | str) -> bool:
        """The placement's group is gone (its ranks and spares have left): whether it can
        be released now; if a rank of another group still lives there, it is retired."""
        if self._holds_rank(placement):
            self.retired.add(placement)
            return False
        self.sizes.pop(placement, None)
        return True

    def releasable(self) -> list[int | str]:
        """Retired placements whose last rank has gone: release them."""
        empty = [placement for placement in self.retired if not self._holds_rank(placement)]
        for placement in empty:
            self.retired.discard(placement)
            self.sizes.pop(placement, None)
        return empty

    def _holds_rank(self, placement: int | str) -> bool:
        return any(slot[0] == placement for slot in self.of_rank.values())

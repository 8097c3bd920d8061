"""Keeps ``scaling.spares`` warm spares started ahead, and gives them to groups that replace
ranks (``elastic.core.spares`` decides which spare takes which rank).

The spares' placement is reserved once groups are live, so it never competes with the
run's own start; a spare taken, or lost, is started again in the background, once the run
has committed a step after taking it: its start (importing torch, seconds of CPU) must not
compete with the recovery it made fast, on nodes where ranks share the CPUs. A spare whose
warm-up raised is the hooks' own error, which every new spare would raise again: no more
are started (the build of a rank that needs them shows the error itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from elastic.core.events import EventKind, EventLog
from elastic.core.spares import Spare, choose_spares
from elastic.fleet.api import FleetApi


class SpareKeeper:
    def __init__(self, wanted: int, pack_groups: bool, fleet: FleetApi, events: EventLog, clock: Callable[[], float]):
        self.wanted = wanted
        self.pack_groups = pack_groups  # on GPUs a group's placement packs it on one node
        self.fleet = fleet
        self.events = events
        self.clock = clock
        self.reserved = False
        self.started_at: dict[int, float] = {}
        self.ready: set[int] = set()
        self.stopped_by: str | None = None  # a warm-up's error: no more spares are started
        self.held_until = -1  # no spare starts before the run commits past this step

    def tend(self, groups_live: bool, step: int) -> None:
        """Start the spares missing, once groups are live (and ``step``, the next step to
        commit, is past the one a spare was last taken at)."""
        if not self.wanted or not groups_live:
            return
        if not self.reserved:
            self.fleet.reserve_spares()
            self.reserved = True
        spares = self._poll()
        if self.stopped_by is None and len(spares) < self.wanted and step > self.held_until:
            for spare_id in self.fleet.start_spares(self.wanted - len(spares)):
                self.started_at[spare_id] = self.clock()

    def take(self, ranks: list[int], group_ranks: list[int], node_of: Mapping[int, str], step: int) -> dict[int, int]:
        """``rank -> spare id`` for the ranks of ``ranks`` (of one group) a spare replaces,
        at ``step`` (the next step to commit). On GPUs the group stays on the node the rest
        of it is on, where a spare is there."""
        if not self.reserved:
            return {}
        spares = {spare.id: spare for spare in self._poll()}
        staying = [node_of[rank] for rank in group_ranks if rank not in ranks and rank in node_of]
        near = dict.fromkeys(ranks, staying[0]) if self.pack_groups and staying else {}
        taken = choose_spares(ranks, spares.values(), node_of, near)
        if taken:
            self.held_until = step
        for rank, spare_id in taken.items():
            self.ready.discard(spare_id)
            self.started_at.pop(spare_id, None)
            self.events.emit(EventKind.SPARE_TAKEN, spare=spare_id, rank=rank, was_ready=spares[spare_id].ready,
                             ready_spares=len(self.ready))
        return taken

    def _poll(self) -> list[Spare]:
        """The fleet's live spares; reports those that became ready and those lost."""
        live = []
        for spare in self.fleet.spares():
            if spare.lost is not None:
                self.ready.discard(spare.id)
                self.started_at.pop(spare.id, None)
                if spare.warm_up_raised:
                    self.stopped_by = spare.lost
                self.events.emit(EventKind.SPARE_LOST, spare=spare.id, error=spare.lost,
                                 restarting=self.stopped_by is None, ready_spares=len(self.ready))
                continue
            live.append(spare)
            if spare.ready and spare.id not in self.ready:
                self.ready.add(spare.id)
                self.events.emit(EventKind.SPARE_READY, spare=spare.id, node=spare.node,
                                 seconds=round(self.clock() - self.started_at.get(spare.id, self.clock()), 3),
                                 ready_spares=len(self.ready))
        return live

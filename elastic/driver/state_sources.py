"""Where a group's training state comes from when it joins the quorum, and which step the run
then stands at. In order of preference:

1. a live group (a peer): its ranks copy their state to the joining groups' ranks, rank to
   rank. Where the next thing the run does is step, the joining groups join at once and
   catch up while every group steps (``CatchUp``: the live groups never wait for the copy);
   else, and for a group whose catch-up failed, the copy is made at the boundary;
2. with no group live, the memory tier: the newest step every joining rank's copy is held
   for in host memory (its own or its buddy's);
3. the newest committed checkpoint;
4. before the first checkpoint, the initial state the seed determines (which a group that
   was just built holds already); a run that resumed has no such state, and stops.

After an integrity mismatch no state newer than the last verified step is trusted, until the
next groups join: the memory tier and the checkpoints are read no newer than it, and every
group goes back to the memory tier's verified copy where it holds one for every live rank.

A restore other than from a peer moves the run back to the step it holds (``rewind``): the
steps committed after it rerun.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from checkpointing.catalog import Restorable
from elastic.core.data_plan import DataCursor
from elastic.core.diagnosis import Diagnosis
from elastic.core.events import EventKind
from elastic.core.loss_scale import restored_loss_scale
from elastic.core.memory_tier import Holdings, MemoryRestore, plan_memory_restore
from elastic.core.policies import expected_copy_s
from elastic.core.protocol import CatchUp, HealReceipt
from elastic.driver.checkpoint_coordinator import CheckpointCoordinator
from elastic.driver.run_context import RunContext
from elastic.driver.stopped import TrainingStopped


class StateSources:
    def __init__(self, run: RunContext, checkpoints: CheckpointCoordinator | None):
        self.config = run.config
        self.fleet = run.fleet
        self.topology = run.topology
        self.membership = run.membership
        self.history = run.history
        self.timing = run.timing
        self.events = run.events
        self.clock = run.clock
        self.checkpoints = checkpoints
        # After an integrity mismatch: the newest step a restore may take the state from (a
        # later checkpoint may hold the corruption). None: the newest checkpoint.
        self.trusted_until: int | None = None
        self.pending: CatchUp | None = None  # joined, catching up in the next segment
        self.catching_up: CatchUp | None = None  # handed to the segment in flight, until its end
        self.heal_at_boundary: set[int] = set()  # groups whose catch-up failed: healed at the boundary next
        self.copy_s: float | None = None  # how long the run's last copy from a peer took
        self.parameter_bytes = 0  # the most a rank built holds: its copy's size foreseen before one is timed

    def built(self, parameter_bytes: int) -> None:
        """A rank was built holding ``parameter_bytes`` of parameters."""
        self.parameter_bytes = max(self.parameter_bytes, parameter_bytes)

    def expected_copy_s(self) -> float | None:
        """How long the next copy from a peer is expected to take (``policies.expected_copy_s``)."""
        return expected_copy_s(self.copy_s, self.parameter_bytes)

    def load(self, groups: list[int], live: tuple[int, ...], steps_next: bool = False,
             overlap: bool = False) -> None:
        """Give ``groups``, on their way into the quorum, the run's state (nothing to give
        before the first committed step: every group built holds the initial state).
        ``steps_next``: the run steps next, so they take it over the next segment's replicate
        group; ``overlap``: while it steps (the catch-up), else before its first step."""
        if self.history.has_state:
            if live and steps_next and not self.heal_at_boundary & set(groups):
                self._catch_up(groups, live[0], before_first_step=not overlap)
            elif live:
                self._heal_from_peers(groups, live[0])
            else:
                self._restore(groups)
        self.trusted_until = None

    def _catch_up(self, groups: list[int], source_group: int, before_first_step: bool) -> None:
        sources = self.topology.global_ranks(source_group)
        pairs = {target: source for group in groups
                 for source, target in zip(sources, self.topology.global_ranks(group))}
        pending = self.pending or CatchUp({}, frozenset(), before_first_step)
        # groups joined apart share the segment's catch-up: one that would not wait makes all catch up
        self.pending = CatchUp({**pending.sources, **pairs}, pending.groups | set(groups),
                               pending.before_first_step and before_first_step)

    def take_catch_up(self) -> CatchUp | None:
        """The catch-up the next segment carries (``CatchUp``): the groups joined since the last."""
        self.catching_up, self.pending = self.pending, None
        return self.catching_up

    def heal_pending_now(self) -> None:
        """The run does not step next: the groups joined to catch up are healed now instead
        (until the copy succeeds they stay pending: a recovery rebuilds them)."""
        if self.pending is not None:
            groups = sorted(self.pending.groups)
            self._heal_from_peers(groups, self._source_group(self.pending, groups[0]))
            self.pending = None

    def caught_up(self, first_step: int, healed: dict[int, HealReceipt]) -> frozenset[int]:
        """The segment from ``first_step`` that carried the catch-up ended, with the joining ranks' ``healed``
        receipts: each group all of whose ranks caught up is healed; returns the others (they
        hold no state: their groups build again, and heal at the boundary next)."""
        catch_up, self.catching_up = self.catching_up, None
        if catch_up is None:
            return frozenset()
        failed = set()
        for group in sorted(catch_up.groups):
            receipts = [healed.get(rank) for rank in self.topology.global_ranks(group)]
            if None in receipts:
                failed.add(group)
                continue
            # Said when the segment ends, where the receipts travel: ``caught_up_at`` is the
            # step from which the group took its share, ``seconds`` its slowest copy's.
            caught_up_steps = max(receipt.caught_up_steps for receipt in receipts)
            self.copy_s = max(receipt.seconds for receipt in receipts)
            overlapped = not catch_up.before_first_step
            self.events.emit(EventKind.GROUP_HEALED, group=group, source_group=self._source_group(catch_up, group),
                             seconds=round(self.copy_s, 4),
                             rank_to_rank_bytes=sum(receipt.bytes for receipt in receipts), object_store_bytes=0,
                             overlapped=overlapped, before_first_step=not overlapped, caught_up_steps=caught_up_steps,
                             caught_up_at=first_step + caught_up_steps + 1 if overlapped else first_step)
        self.heal_at_boundary |= failed
        return frozenset(failed)

    def _source_group(self, catch_up: CatchUp, group: int) -> int:
        """The live group ``group``'s ranks take the state from."""
        return self.topology.group_of(catch_up.sources[self.topology.global_ranks(group)[0]])

    def unconfirmed(self) -> frozenset[int]:
        """Groups joined to catch up whose catch-up no segment confirmed (a control call failed
        first): they hold no state."""
        groups = set()
        for catch_up in (self.pending, self.catching_up):
            groups |= catch_up.groups if catch_up is not None else set()
        self.pending = self.catching_up = None
        return frozenset(groups)

    def after_mismatch(self, diagnosis: Diagnosis, verified_step: int, every_group: bool = False) -> Diagnosis:
        """Replicas disagreed: no state after ``verified_step`` (the last check passed) is
        trusted. Since then the odd groups' gradients went into every group's update, so when
        the memory tier holds a verified copy for every live rank, every group goes back to
        it; else only the odd groups rebuild, and heal from the others. ``every_group``: every
        group's state is suspect (a device computed wrong): all go back, to the memory tier's
        copy or a checkpoint at or before ``verified_step``, or the initial state."""
        self.trusted_until = verified_step
        live = self.membership.live_groups()
        if every_group:
            return replace(diagnosis, broken_groups=frozenset(live) | diagnosis.broken_groups)
        if self.config.checkpoint.memory_every and live:
            ranks = self.topology.ranks_of(live)
            if plan_memory_restore(ranks, self.fleet.memory_holdings(ranks), verified_step) is not None:
                return replace(diagnosis, broken_groups=frozenset(live))
        return diagnosis

    def redo_round(self, groups: list[int], round_start: int) -> bool:
        """DiLoCo: a learner was lost inside the round that began at ``round_start``. The learners
        going on (``groups``) go back to the round's start, which each of their ranks holds in
        the memory tier (an older round's where that is the newest they all hold), and the run
        with them; the lost learner's group heals from them there. False when the memory tier
        holds no such step: every group restores then."""
        if not groups:
            return False
        at_most = round_start if self.trusted_until is None else min(round_start, self.trusted_until)
        restored = self._back_to_memory(groups, holders=groups, at_most=at_most)
        if restored is None:
            return False
        plan, _, seconds, rolled_back = restored
        self.events.emit(EventKind.ROUND_REDONE, step=plan.step, groups=groups, rolled_back_steps=rolled_back,
                         seconds=round(seconds, 4))
        return True

    def join_round(self, groups: list[int], round_start: int) -> bool:
        """DiLoCo's drop: ``groups`` join the round in progress, which began at ``round_start``,
        as learners from its start: each of their ranks takes that step's state from the memory
        tier (its own copy, or its buddy's of it), and the run stays where it stands. False when
        the memory tier holds no copy of that step for one of them: they join between rounds.
        In the run's first round they hold its start already, as built."""
        if round_start == 0 and self.history.first_step == 0:
            return True  # the run's first round: a group built holds its start, the initial state
        planned = self._memory_plan(groups, holders=self.membership.groups, at_most=round_start)
        if planned is None or planned[0].step != round_start:
            return False
        plan, _ = planned
        seconds = self._load_from_memory(plan)
        self.events.emit(EventKind.RESTORED_FROM_MEMORY, step=plan.step, groups=groups, rolled_back_steps=0,
                         from_buddies=[owner for _, owner in plan.transfers], seconds=round(seconds, 4),
                         joined_round=True)
        return True

    def rewind(self, checkpoint: Restorable | None) -> int:
        """Continue from a checkpoint's step and cursor (``None``: the initial state's);
        returns the committed steps rolled back."""
        if checkpoint is None:
            return self._rewind_to(0, DataCursor())
        self.history.loss_scale = restored_loss_scale(checkpoint.manifest.loss_scale, self.history.loss_scale)
        return self._rewind_to(checkpoint.step, DataCursor(**checkpoint.manifest.cursor))

    def _heal_from_peers(self, groups: list[int], source_group: int) -> None:
        started = self.clock()
        sources = self.topology.global_ranks(source_group)
        copies = self.fleet.copy_state([
            pair for group in groups for pair in zip(sources, self.topology.global_ranks(group))
        ])
        seconds = self.clock() - started
        self.copy_s = seconds
        self.heal_at_boundary -= set(groups)
        self.timing.add("heal_s", seconds)
        for copy in copies:
            if copy.fallback:
                self.events.emit(EventKind.HEAL_FALLBACK, group=self.topology.group_of(copy.target), source=copy.source,
                                 target=copy.target, reason=copy.fallback, bytes=copy.bytes)
        for group in groups:
            own = [copy for copy in copies if self.topology.group_of(copy.target) == group]
            self.events.emit(EventKind.GROUP_HEALED, group=group, source_group=source_group, seconds=round(seconds, 4),
                             rank_to_rank_bytes=sum(copy.rank_to_rank_bytes for copy in own),
                             object_store_bytes=sum(copy.object_store_bytes for copy in own))

    def _restore(self, groups: list[int]) -> None:
        """No live peer holds the state: the memory tier's, the newest checkpoint's, or the
        initial state's."""
        if self._restore_from_memory(groups):
            return
        checkpoint = self.checkpoints.latest(self.trusted_until) if self.checkpoints else None
        if checkpoint is not None:
            self._restore_checkpoint(groups, checkpoint)
        elif self.history.first_step == 0:
            rolled_back = self.rewind(None)
            self.events.emit(EventKind.RESTORED_INITIAL_STATE, step=0, groups=groups, rolled_back_steps=rolled_back,
                             seed=self.config.seed)
        else:
            positions = [self.topology.position_of(rank) for rank in self.topology.global_ranks(groups[0])]
            raise TrainingStopped(
                f"every copy of the state is lost ((pp, shard, tp) positions {positions}): no live group holds it, "
                f"no committed checkpoint is left, and the run resumed from step {self.history.first_step}, so "
                "the initial state is not its state; run with more replica groups (--groups) or checkpoint more "
                "often (--checkpoint-every N)"
            )

    def _restore_from_memory(self, groups: list[int]) -> bool:
        """Every rank of ``groups`` back at the newest step the memory tier holds for all of
        them (no newer than the last verified one, after a mismatch); False when it holds none."""
        # a rank's copy may be held in any group, one still on its way back included
        restored = self._back_to_memory(groups, holders=self.membership.groups, at_most=self.trusted_until)
        if restored is None:
            return False
        plan, holdings, seconds, rolled_back = restored
        self.events.emit(EventKind.RESTORED_FROM_MEMORY, step=plan.step, groups=groups, rolled_back_steps=rolled_back,
                         from_buddies=[owner for _, owner in plan.transfers], seconds=round(seconds, 4),
                         host_bytes_per_rank=max(held.nbytes for held in holdings.values()))
        return True

    def _back_to_memory(self, groups: list[int], holders: Iterable[int],
                        at_most: int | None) -> tuple[MemoryRestore, dict[int, Holdings], float, int] | None:
        """Every rank of ``groups`` back at the newest step (up to ``at_most``) the memory tier of
        the ``holders``' ranks holds for all of them, and the run with it: the plan, the holdings,
        the seconds and the steps rolled back; None when it holds none."""
        planned = self._memory_plan(groups, holders, at_most)
        if planned is None:
            return None
        plan, holdings = planned
        seconds = self._load_from_memory(plan)
        return plan, holdings, seconds, self._rewind_to(plan.step, plan.cursor)

    def _memory_plan(self, groups: Iterable[int], holders: Iterable[int],
                     at_most: int | None) -> tuple[MemoryRestore, dict[int, Holdings]] | None:
        """The newest step (up to ``at_most``) the memory tier of the ``holders``' ranks holds for
        every rank of ``groups``, and those holdings; None when it holds none (or is off)."""
        if not self.config.checkpoint.memory_every:
            return None
        holdings = self.fleet.memory_holdings(self.topology.ranks_of(holders))
        plan = plan_memory_restore(self.topology.ranks_of(groups), holdings, at_most)
        return None if plan is None else (plan, holdings)

    def _load_from_memory(self, plan: MemoryRestore) -> float:
        """Every rank of ``plan`` back at its step; returns the seconds it took."""
        started = self.clock()
        self.fleet.restore_memory(plan)
        seconds = self.clock() - started
        self.timing.add("heal_s", seconds)
        return seconds

    def _restore_checkpoint(self, groups: list[int], checkpoint: Restorable) -> None:
        checkpoint, seconds = self.checkpoints.restore(checkpoint, self.topology.ranks_of(groups))
        self.timing.add("heal_s", seconds)
        rolled_back = self.rewind(checkpoint)
        self.events.emit(
            EventKind.RESTORED_FROM_CHECKPOINT, step=checkpoint.step, groups=groups, rolled_back_steps=rolled_back,
            seconds=round(seconds, 4),
        )

    def _rewind_to(self, step: int, cursor: DataCursor) -> int:
        rolled_back = self.history.step - step
        self.history.rewind(step, cursor)
        self.history.steps_rolled_back += max(0, rolled_back)
        return rolled_back

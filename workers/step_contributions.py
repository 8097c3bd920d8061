"""What each cross-cutting feature adds to a step (``workers.step_transaction``): a
*contribution* declares the named slots it holds in the two rows the step sends, and acts once
the group has voted and as the step commits or is discarded.

The two rows, each one float64 tensor laid out once from the contributions' slots
(``RowLayout``), so that no reader counts positions:

- the *cross-group sum*: summed with this position's rank in every other group (a failed sum
  reads as zeros), so the replicas of a position all see the same sums;
- the *ballot*: every rank of the group gets every rank's, so all decide the same.

The transaction decides (apply, or discard where replicas disagreed or the loss or the norm is
not finite) and calls every contribution in turn: ``after_vote`` with the group's ballots,
then ``on_commit`` or ``on_discard``, where each fills its own fields of the record or the
discard. A new feature of the step is one more contribution: no offset moves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from elastic.core.compute_replay import ComputeMismatch, replay_due, replayed_group, verdict
from elastic.core.gradient_clipping import global_norm
from elastic.core.integrity import IntegrityMismatch, check_due
from elastic.core.loss_scale import LossScale
from elastic.core.protocol import HealReceipt, NonFinite, RankTimes, SegmentSpec, StepRecord
from elastic.core.topology import Topology
from checkpointing.healing import import_local_state
from workers import rng
from workers.catch_up import CatchingUp, KeptUpdate
from workers.gradient_sum import local_gradient
from workers.control_surface import DriverSignals
from workers.experts import RoutedLayout, balance_experts, expert_layers, expert_load
from workers.integrity import PendingCheck, start_check
from workers.model import ModelArgs
from workers.train_step import squared_gradient_norm

Slots = dict[str, int]  # a contribution's named places in a row, each with its width
Values = dict[str, list[float]]  # a contribution's values in its places, by name


@dataclass(frozen=True)
class Committed:
    """A step every rank of the group applied."""

    record: StepRecord
    pause: bool  # the ranks agreed to stop after it
    records_due: bool  # the groups' first ranks send the segment's records after it
    caught_up: bool = True  # every joining rank of the segment holds the run's state after it


@dataclass(frozen=True)
class Discarded:
    """A step every rank of every group discarded, and why: its loss or norm was not finite
    (the same sums everywhere), or replicas disagreed about the state it began from (every
    group has a rank at the position that found it, and the vote tells the others)."""

    nonfinite: NonFinite | None = None
    integrity: IntegrityMismatch | None = None  # this rank's position's finding, if it has one
    replay: ComputeMismatch | None = None  # this rank's position's spot check's finding, if it has one


class Contribution:
    """One feature's part in a step. Each hook's default does nothing: a contribution writes
    only those it needs."""

    cross_group_slots: Slots = {}  # its places in the row summed over the groups
    ballot_slots: Slots = {}  # its places in the ballot the group's ranks gather

    def summand(self) -> Values:
        """This rank's values for its position's cross-group sum, as the sum begins."""
        return {}

    def ballot(self, sums: Values) -> Values:
        """This rank's ballot, given its position's sums over the groups."""
        return {}

    def after_vote(self, ballots: list[Values]) -> None:
        """Every rank's ballot, in group-rank order: what the group decided, read alike by all."""

    def on_commit(self, record: StepRecord) -> StepRecord:
        """The step is applied: act on it, and fill this contribution's fields of its record."""
        return record

    def on_discard(self, discarded: Discarded) -> Discarded:
        """Every rank of every group discards the step: act on it, and fill what was found."""
        return discarded


class RowLayout:
    """Where each contribution's slots sit in one float64 row: laid out once, in the order of
    the contributions and of their slots, so that a row is written and read by name."""

    def __init__(self, slots: dict[Contribution, Slots]):
        self.places: dict[Contribution, dict[str, slice]] = {}
        at = 0
        for contribution, own in slots.items():
            self.places[contribution] = {}
            for name, width in own.items():
                self.places[contribution][name] = slice(at, at + width)
                at += width
        self.width = at

    def row(self, values: dict[Contribution, Values]) -> torch.Tensor:
        row = [0.0] * self.width
        for contribution, places in self.places.items():
            for name, place in places.items():
                given = values[contribution][name]
                if len(given) != place.stop - place.start:
                    raise ValueError(f"{type(contribution).__name__}'s {name!r} has {len(given)} values, "
                                     f"its slot {place.stop - place.start}")
                row[place] = given
        return torch.tensor(row, dtype=torch.float64)

    def read(self, row: Sequence[float]) -> dict[Contribution, Values]:
        return {contribution: {name: list(row[place]) for name, place in places.items()}
                for contribution, places in self.places.items()}

    def zeros(self) -> dict[Contribution, Values]:
        return self.read([0.0] * self.width)


def nothing(values: Values) -> Values:
    """``values``' places, each zero: the ballot of a rank that does not count them."""
    return {name: [0.0] * len(own) for name, own in values.items()}


class StepLoss(Contribution):
    """The step's loss: each rank's share and the targets it counted, summed over the groups,
    then over the group from the ranks that compute it (the last stage; a TP row's ranks share
    it, counted by the first)."""

    cross_group_slots = {"loss_share": 1, "counted_tokens": 1}
    ballot_slots = {**cross_group_slots, "group_counted": 1}

    def __init__(self, counts_loss: bool):
        self.counts_loss = counts_loss
        self.share, self.counted = 0.0, 0.0  # this rank's, from its compute
        self.loss, self.counted_tokens = 0.0, 0  # the step's (the loss before ``token_rescale``)
        self.group_counted = 0  # the step's targets this group counted: a DiLoCo learner's gradient is their mean

    def summand(self) -> Values:
        return {"loss_share": [self.share], "counted_tokens": [float(self.counted)]}

    def ballot(self, sums: Values) -> Values:
        ballot = {**sums, "group_counted": [float(self.counted)]}
        return ballot if self.counts_loss else nothing(ballot)

    def after_vote(self, ballots: list[Values]) -> None:
        self.loss = sum(ballot["loss_share"][0] for ballot in ballots)
        self.counted_tokens = round(sum(ballot["counted_tokens"][0] for ballot in ballots))
        self.group_counted = round(sum(ballot["group_counted"][0] for ballot in ballots))


class Agreement(Contribution):
    """Whether the group goes on: every rank's cross-group sum succeeded; whether to stop
    after the step (a pause the driver asked of any group, or an abort); and whether the
    groups' first ranks send the segment's records after it (any group's asked)."""

    cross_group_slots = {"pause": 1, "records_due": 1}
    ballot_slots = {"succeeded": 1, "pause": 1}

    def __init__(self, signals: DriverSignals):
        self.signals = signals
        self.begin(-1, records_due=False)

    def begin(self, attempt: int, records_due: bool, may_pause: bool = True) -> None:
        """``may_pause``: the driver's pause may take effect after this step (under DiLoCo, only
        after a round's last: the learners hold the run's state only between rounds; a pause
        asked earlier is held, as the request stays, until then). An abort always does."""
        self.attempt, self.records_due_here, self.may_pause = attempt, records_due, may_pause
        self.succeeded = self.aborted = False  # set by the transaction as the step goes
        self.records_due = self.every_rank_succeeded = self.pause = False  # the sums' and the vote's

    def summand(self) -> Values:
        return {"pause": [float(self.signals.pause_requested(self.attempt))],
                "records_due": [float(self.records_due_here)]}

    def ballot(self, sums: Values) -> Values:
        self.records_due = sums["records_due"][0] > 0
        paused = sums["pause"][0] > 0 and self.may_pause
        return {"succeeded": [float(self.succeeded)], "pause": [float(paused or self.aborted)]}

    def after_vote(self, ballots: list[Values]) -> None:
        self.every_rank_succeeded = all(ballot["succeeded"][0] == 1.0 for ballot in ballots)
        self.pause = any(ballot["pause"][0] > 0 for ballot in ballots)


class IntegrityCheck(Contribution):
    """The replicas' fingerprints of the state a step begins from, compared at the steps the
    spec asks (``workers.integrity``): each position's finding in its ballot, and a step any
    position found replicas disagreeing on discarded by every rank of every group."""

    ballot_slots = {"mismatch": 1}

    def __init__(self, group: int, position: tuple[int, ...], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, device: torch.device):
        self.group, self.position, self.model, self.optimizer, self.device = group, position, model, optimizer, device
        self.check: PendingCheck | None = None
        self.finding: IntegrityMismatch | None = None  # this position's
        self.disagreed = False  # some position's replicas disagreed

    def start(self, step: int, every: int, replicate_group) -> None:
        """Fingerprint the state and start gathering them, where the step begins a check."""
        due = replicate_group is not None and check_due(step, every)
        self.check = (start_check(step, self.group, self.model, self.optimizer, replicate_group, self.device)
                      if due else None)
        self.finding = None

    def compare(self, wait: Callable[[object], None]) -> None:
        """The replicas' fingerprints, once ``wait`` has them, compared: first thing after compute."""
        if self.check is not None:
            wait(self.check.work)
            self.finding = self.check.verdict(self.position)

    def ballot(self, sums: Values) -> Values:
        return {"mismatch": [float(self.finding is not None)]}

    def after_vote(self, ballots: list[Values]) -> None:
        self.disagreed = any(ballot["mismatch"][0] > 0 for ballot in ballots)

    def on_discard(self, discarded: Discarded) -> Discarded:
        return replace(discarded, integrity=self.finding) if self.disagreed else discarded


class ComputeReplay(Contribution):
    """A spot check's fingerprints (``elastic.core.compute_replay``): this rank's of its own
    work and of the next group's as it replayed it, each in its group's slot of the row (every
    other slot zero, so the sum gathers them); each position's verdict in its ballot, and a step
    any position found not reproduced discarded by every rank of every group."""

    def __init__(self, group: int, group_rank: int, position: tuple[int, ...], layout: Topology):
        self.group, self.group_rank, self.position, self.layout = group, group_rank, position, layout
        self.cross_group_slots = {"own": layout.max_groups, "replayed": layout.max_groups}
        self.ballot_slots = {"mismatch": 1}
        self.step, self.groups = 0, ()
        self.replays: int | None = None  # the group whose work this rank replays in this step (a spot check)
        self.own = self.replayed = 0  # the fingerprints
        self.finding: ComputeMismatch | None = None  # this rank's position's
        self.disagreed = False  # some position's replays did not reproduce the work

    def begin(self, step: int, every: int, groups: tuple[int, ...]) -> int | None:
        """Whether ``step`` is a spot check: the group whose work this rank replays, if so."""
        self.step, self.groups = step, groups
        self.replays = replayed_group(self.group, groups) if replay_due(step, every) else None
        self.own = self.replayed = 0
        self.finding, self.disagreed = None, False
        return self.replays

    def summand(self) -> Values:
        own, replayed = [0.0] * self.layout.max_groups, [0.0] * self.layout.max_groups
        if self.replays is not None:
            own[self.group], replayed[self.replays] = float(self.own), float(self.replayed)
        return {"own": own, "replayed": replayed}

    def ballot(self, sums: Values) -> Values:
        if self.replays is not None:
            found = verdict(self.step, self.position, {group: int(sums["own"][group]) for group in self.groups},
                            {group: int(sums["replayed"][group]) for group in self.groups}, self.groups)
            self.finding = found and replace(found, suspect_ranks=tuple(
                self.layout.global_ranks(group)[self.group_rank] for group in found.suspects))
        return {"mismatch": [float(self.finding is not None)]}

    def after_vote(self, ballots: list[Values]) -> None:
        self.disagreed = any(ballot["mismatch"][0] > 0 for ballot in ballots)

    def on_commit(self, record: StepRecord) -> StepRecord:
        return replace(record, replayed=self.replays is not None)

    def on_discard(self, discarded: Discarded) -> Discarded:
        return replace(discarded, replay=self.finding) if self.disagreed else discarded


class GradientNorm(Contribution):
    """The global gradient norm: each rank's part of its square in its ballot. After the
    cross-group sum one group's parts make it; stages hold different parameters, so each
    counts its own.

    Under DiLoCo (``per_learner``) no gradient crosses groups: the norm is the group's own, which
    clips its own step, and each rank's part is also summed across the groups, so that every
    group learns whether any learner's norm is not finite, and all discard that step alike."""

    ballot_slots = {"grad_sq_norm": 1}

    def __init__(self, model: torch.nn.Module, mesh_coordinate: dict[str, int], per_learner: bool = False):
        self.model = model
        self.mesh_coordinate = {name: index for name, index in mesh_coordinate.items() if name != "pp"}
        self.per_learner = per_learner
        if per_learner:
            self.cross_group_slots = {"learners_sq": 1}
            self.ballot_slots = {"grad_sq_norm": 1, "learners_sq": 1}
        self.own_sq, self.norm = 0.0, 0.0
        self.learners_finite = True  # every learner's norm is finite (every-step: the one norm is)

    def measure(self, summed: bool) -> None:
        """This rank's part (``squared_gradient_norm``) once its gradients are the step's (summed
        across groups, or, per learner, its own); nothing where its sum failed."""
        self.own_sq = squared_gradient_norm(self.model, self.mesh_coordinate) if summed else 0.0

    def summand(self) -> Values:
        return {"learners_sq": [self.own_sq]} if self.per_learner else {}

    def ballot(self, sums: Values) -> Values:
        return {"grad_sq_norm": [self.own_sq], **sums}

    def after_vote(self, ballots: list[Values]) -> None:
        self.norm = global_norm({group_rank: ballot["grad_sq_norm"][0] for group_rank, ballot in enumerate(ballots)})
        self.learners_finite = not self.per_learner or math.isfinite(sum(ballot["learners_sq"][0] for ballot in ballots))


class Timing(Contribution):
    """Each rank's seconds in the step (``RankTimes``), gathered so that the group's record
    holds every rank's, for the straggler detector."""

    ballot_slots = {"times": len(RankTimes._fields)}

    def __init__(self):
        self.own = RankTimes(0.0, 0.0, 0.0, 0.0)  # this rank's, set by the transaction before the vote
        self.times: tuple[RankTimes, ...] = ()  # by group rank

    def ballot(self, sums: Values) -> Values:
        return {"times": list(self.own)}

    def after_vote(self, ballots: list[Values]) -> None:
        self.times = tuple(RankTimes(*ballot["times"]) for ballot in ballots)

    def on_commit(self, record: StepRecord) -> StepRecord:
        return replace(record, times=self.times)


class CrossGroupTraffic(Contribution):
    """The bytes each rank hands the cross-group sums in the step, gathered, so that the group's
    record holds its ranks' total (``StepRecord.cross_group_bytes``)."""

    ballot_slots = {"bytes": 1}

    def __init__(self):
        self.own = 0  # this rank's, set by the transaction before the vote
        self.group_bytes = 0

    def ballot(self, sums: Values) -> Values:
        return {"bytes": [float(self.own)]}

    def after_vote(self, ballots: list[Values]) -> None:
        self.group_bytes = round(sum(ballot["bytes"][0] for ballot in ballots))

    def on_commit(self, record: StepRecord) -> StepRecord:
        return replace(record, cross_group_bytes=self.group_bytes)


class LossScaling(Contribution):
    """fp16's loss scale at the step in progress: the segment's spec gives it at its first
    step, and each commit moves it on by the rule the driver follows
    (``elastic.core.loss_scale``). No slots: every rank of every group saw the same sums, so
    each halves its scale alike at an overflow."""

    def __init__(self):
        self.scale: LossScale | None = None

    def begin(self, spec: SegmentSpec, step: int) -> None:
        if step == spec.first_step:
            self.scale = spec.loss_scale

    @property
    def value(self) -> float:
        """What the step's backward multiplied the loss by: fp16's loss scale, else 1."""
        return self.scale.value if self.scale is not None else 1.0

    def on_commit(self, record: StepRecord) -> StepRecord:
        if self.scale is not None:
            self.scale = self.scale.after_commit()
        return record

    def on_discard(self, discarded: Discarded) -> Discarded:
        """A finite loss with a norm that is not: the gradients overflowed at this scale (unless
        halving it would not help any more)."""
        nonfinite = discarded.nonfinite
        if nonfinite is None or self.scale is None or not math.isfinite(nonfinite.loss) or self.scale.exhausted:
            return discarded
        self.scale = self.scale.after_overflow()
        return replace(discarded, nonfinite=replace(nonfinite, overflow=True))


class ExpertBalance(Contribution):
    """The tokens the step routed to each expert (``workers.experts.RoutedLayout``), summed over
    every rank of every group: each expert layer's load in the record, and what DeepSeek-V3's
    bias balances by at a commit, the same on every replica."""

    def __init__(self, model: torch.nn.Module, stages: Sequence[torch.nn.Module], first_of_tp_row: bool):
        # The expert layers whose load the step sums, records and balances by: the rank's own
        # (a pipeline stage's are some of the model's), in the whole model's places.
        self.held = expert_layers(model)
        self.layout = routed_layout(model, stages, self.held)
        self.cross_group_slots = self.ballot_slots = {"routed_tokens": self.layout.width}
        self.first_of_tp_row = first_of_tp_row
        self.routed: tuple[float, ...] = ()  # the step's, over every rank of every group

    def summand(self) -> Values:
        return {"routed_tokens": self.layout.routed_tokens(self.held)}

    def ballot(self, sums: Values) -> Values:
        # A TP row's ranks route the same tokens: its first counts them.
        return sums if self.first_of_tp_row else nothing(sums)

    def after_vote(self, ballots: list[Values]) -> None:
        self.routed = tuple(map(sum, zip(*(ballot["routed_tokens"] for ballot in ballots))))

    def on_commit(self, record: StepRecord) -> StepRecord:
        self.replay(self.routed)
        return replace(record, expert_load=expert_load(self.layout, self.routed))

    def idle(self) -> None:
        """A step this rank routes nothing in (it catches up): its counts are zeros."""
        for layer in self.held:
            layer.step_routed.zero_()

    def replay(self, routed: Sequence[float]) -> None:
        """The bias's move at a commit whose sums were ``routed``: a joining rank catching up
        applies a kept step's as every replica did."""
        balance_experts(self.held, self.layout, routed)


def routed_layout(model: torch.nn.Module, stages: Sequence[torch.nn.Module], held: Sequence) -> RoutedLayout:
    """The places of the whole model's expert layers in a step's routed counts: from the
    reference model's arguments, which every stage keeps whole; a custom model's, from the
    expert layers it holds (it has no stages with experts: each would count its own)."""
    args = getattr(stages[0] if stages else model, "args", None)
    return RoutedLayout.of(args) if isinstance(args, ModelArgs) else RoutedLayout.of_held(held)


class JoiningRank(Contribution):
    """A joining rank's catch-up (``workers.catch_up``) in the steps of its first segment, and
    whether every joining rank holds the run's state after a step. A joining rank counts
    itself in the sums while its state has not landed as the sum begins, and keeps the step's
    update instead of applying it; in the step the state landed by, it loads the state and
    applies what it kept, then the step. The vote adds every position's count, so every rank
    of every group learns at the same step that the joining groups take their shares from the
    next."""

    cross_group_slots = ballot_slots = {"catching_up": 1}

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, expert_balance: ExpertBalance,
                 apply: Callable[[float, float], None]):
        self.model, self.optimizer, self.expert_balance, self.apply = model, optimizer, expert_balance, apply
        self.trained = [param for param in model.parameters() if param.requires_grad]
        self.catching_up: CatchingUp | None = None  # this rank's catch-up, while it lasts
        self.completes = False  # this rank loads the state and applies what it kept in this step
        self.everyone_caught_up = True
        self.holds_state = True  # False from a catch-up's start until it is done
        # Takes no samples: its group joined at the segment's start, and the votes have not yet
        # said that every joining rank holds the state. A rank whose own state landed first
        # idles on with its group, applying each step: its group computes together or not at all.
        self.idle = False
        self.healed: HealReceipt | None = None  # its catch-up, done, until the segment's end reports it

    def begin(self, catching_up: CatchingUp | None) -> None:
        """This rank joins at the segment's first step (None: it does not)."""
        if catching_up is not None:
            self.catching_up, self.holds_state, self.idle = catching_up, False, True

    def summand(self) -> Values:
        self.completes = self.catching_up is not None and self.catching_up.arrived()
        return {"catching_up": [float(self.catching_up is not None and not self.completes)]}

    def ballot(self, sums: Values) -> Values:
        return sums

    def after_vote(self, ballots: list[Values]) -> None:
        self.everyone_caught_up = sum(ballot["catching_up"][0] for ballot in ballots) == 0
        self.idle = self.idle and not self.everyone_caught_up

    def commit(self, lr_scale: float, grad_scale: float, routed: tuple[float, ...]) -> bool:
        """The step's summed update, committed: returns whether this rank applies it now as every
        replica does (else it keeps it, its gradients zeroed, until its state lands)."""
        if self.catching_up is None:
            return True
        update = KeptUpdate([local_gradient(param).clone() for param in self.trained], lr_scale, grad_scale, routed)
        if not self.completes:
            self.catching_up.keep(update)
            self.optimizer.zero_grad(set_to_none=False)
            return False
        self.catch_up()
        self._write_gradients(update.gradients)
        return True

    def take_state_now(self, timeout: float) -> None:
        """Load the state before the segment's first step (``CatchUp.before_first_step``), waiting
        for it at most ``timeout``, and take a share from that step on. Raises what the copy
        raised; the rank then holds no state."""
        self.idle = False
        self.catch_up(timeout)

    def finish(self) -> None:
        """The segment's end: a rank still catching up waits for its state and applies what it
        kept (raises what the copy raised); none idles on."""
        self.idle = False
        self.catch_up()

    def catch_up(self, timeout: float | None = None) -> None:
        """Load the state of the segment's first step and apply the kept updates in order, as
        every replica applied them (at the segment's end, for a rank still catching up: it waits
        for its state). Raises what the copy raised, or ``HealFailed`` after ``timeout``; the
        rank then holds no state."""
        catching_up, self.catching_up = self.catching_up, None
        if catching_up is None:
            return
        state, nbytes, seconds = catching_up.state(timeout)
        import_local_state(self.model, self.optimizer, state)
        rng.restore(state["rng"])
        for kept in catching_up.kept:
            self._write_gradients(kept.gradients)
            self.apply(kept.lr_scale, kept.grad_scale)
            self.expert_balance.replay(kept.routed)
        self.healed, self.holds_state = catching_up.receipt(nbytes, seconds), True

    def take_receipt(self) -> HealReceipt | None:
        receipt, self.healed = self.healed, None
        return receipt

    def _write_gradients(self, gradients: list[torch.Tensor]) -> None:
        for param, gradient in zip(self.trained, gradients):
            local_gradient(param).copy_(gradient)

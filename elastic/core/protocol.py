"""Plain data exchanged between the driver and the rank actors: no Ray, no torch.

A *segment* is how ranks train while the membership is stable. The driver hands every live rank
the same ``SegmentSpec``; each rank plans its own share of every step from it with the pure
core (``data_plan``, ``lr_schedule``, ``gradient_clipping``), steps, and the ranks decide
each step among themselves. About once per ``records_interval_s``, at a step the groups agree
on in their cross-group sum, the groups' first ranks gather their committed ``StepRecord``s
and the segment's first group sends them as one ``SegmentRecords``: one message for the whole segment,
however many groups. A segment of one group, and a group whose segment ends, sends its own
(``GroupRecords``). Every rank ends its segment with a ``SegmentEnd``: paused at a step boundary,
or failed with the ``RankOutcome`` of the step it failed. A rank that ended one then waits,
in the same stream, for the segment it runs next (``NextSegment``), written once to the run's
store for every waiting rank; the driver calls a rank only for what a segment does not do
(a build, a save, an evaluation, a heal or a restore outside a segment), and releases it
first (``ReleaseWaiting``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import chain
from typing import NamedTuple

import numpy as np

from elastic.core.data_plan import DataCursor
from elastic.core.compute_replay import ComputeMismatch
from elastic.core.integrity import IntegrityMismatch
from elastic.core.loss_scale import LossScale
from elastic.core.lr_schedule import LRSchedule

ERROR_CHARS = 2000


def describe_error(error: BaseException | str, limit: int = ERROR_CHARS) -> str:
    """An error's type and message, cut from the front when too long: a remote error's text
    is a traceback followed by the exception line, and that last line names the cause."""
    text = (error if isinstance(error, str) else f"{type(error).__name__}: {error}").strip()
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


@dataclass(frozen=True)
class CatchUp:
    """Groups that joined the quorum at a segment's first step and take the run's state while
    the others go on stepping: each joining rank (a key of ``sources``) receives its source's
    committed state of that step in the background, rank to rank. Until every joining rank
    holds it, the joining groups take no samples: they sum zeros with the others and keep each
    committed step's summed update, then load the state and apply those updates in order
    (``workers.catch_up``). The groups learn in a step's vote that every rank has caught up;
    from the next step on the joining groups take their shares.

    ``before_first_step``: the copy is expected to be shorter than the joining groups' share of
    a step (``policies.catch_up_pays`` says it does not pay): each joining rank loads the state
    before the segment's first step and takes its share from it, and the other groups wait for
    it there, in that step's cross-group sum. The copy still goes over the segment's replicate
    group, so no rank makes a process group of its own for it."""

    sources: dict[int, int]  # joining global rank -> the global rank that sends it the state
    groups: frozenset[int]  # the joining groups
    before_first_step: bool = False

    def targets_of(self, source: int) -> list[int]:
        return sorted(target for target, sent_by in self.sources.items() if sent_by == source)


@dataclass(frozen=True)
class SegmentSpec:
    """Steps ``first_step`` up to (not including) ``stop_step``, unless the ranks agree to
    pause earlier (the driver asked) or a step fails. Everything a rank needs to plan its
    share of each step is here: the data plan's inputs, the schedule and the clipping."""

    attempt: int  # unique per segment and evaluation: aborts and pause requests name it
    first_step: int
    stop_step: int
    cursor: DataCursor
    dataset_len: int
    global_batch: int
    seed: int
    group_weights: dict[int, float]  # the live groups of the segment and their data-plan weights
    micro_batch: int
    seq_len: int
    schedule: LRSchedule
    clip_grad_norm: float | None
    deadline_s: float  # per step: no wait on peers outlasts it
    # The cross-group groups' build: each rebuild the driver decides has its own, and a rank
    # not in this one's groups (over ``groups``) enters them as the segment starts.
    replicas_build: int = 0
    records_interval_s: float = 1.0  # the segment's records are sent about this often
    integrity_every: int = 0  # steps that begin with the replicas' integrity check (0: none)
    # steps whose work each group also replays of the next group's (``elastic.core.compute_replay``; 0: none)
    replay_every: int = 0
    memory_every: int = 0  # the ranks copy their state into host memory at steps that are multiples (0: never)
    loss_scale: LossScale | None = None  # fp16's, at first_step; None: no loss scaling
    catch_up: CatchUp | None = None  # groups taking the state while the others step

    @property
    def groups(self) -> tuple[int, ...]:
        return tuple(sorted(self.group_weights))

    def while_catching_up(self) -> SegmentSpec:
        """The spec the ranks step by while the joining groups catch up: their shares are empty,
        and no step checks the replicas or copies the state to host memory (the joining ranks
        do not hold it yet)."""
        joining = self.catch_up.groups if self.catch_up is not None else frozenset()
        return replace(self, group_weights={group: 0.0 if group in joining else weight
                                            for group, weight in self.group_weights.items()},
                       integrity_every=0, replay_every=0, memory_every=0)


@dataclass(frozen=True)
class EvalRequest:
    """The held-out loss over these samples (no gradients, nothing committed)."""

    step: int
    micro_batches: tuple[tuple[int, ...], ...]
    global_tokens: int
    attempt: int = 0  # unique per dispatch: a rerun is a new attempt
    deadline_s: float = float("inf")


class Failure(StrEnum):
    """What a failed step points at (``workers.failures.classify`` decides)."""

    OWN_IO = "own-io"
    OWN_DATA = "own-data"  # the data itself (or the dataset's code): the same on every read
    OWN_COMPUTE = "own-compute"
    OWN_CODE = "own-code"  # raised by the user's code itself, not as a RuntimeError: the same on any process
    COLLECTIVE = "collective"
    RELEASED = "released"
    # A joining rank the run's state could not reach (its catch-up's copy failed): its group
    # builds again; neither it nor a peer of the step is to blame.
    NO_STATE = "no-state"

    @property
    def blames_peers(self) -> bool:
        return self in (Failure.COLLECTIVE, Failure.RELEASED)


@dataclass(frozen=True)
class RankOutcome:
    global_rank: int
    step: int
    loss_share: float = 0.0
    counted_tokens: int = 0  # an evaluation's targets that count (ignored labels do not)
    data_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    wall_s: float = 0.0
    error: str | None = None
    failure: str | None = None  # a Failure value: what the error points at
    group_broken: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def blames_peers(self) -> bool:
        """Failed inside a collective, or released from one: a victim, not the culprit."""
        return self.failure is not None and Failure(self.failure).blames_peers


class Phase(StrEnum):
    """Where a rank is in its step, in order of progress. ``STAGE_WAIT``: a pipeline stage
    between its chunks of compute, waiting on a neighbouring stage; ahead of a rank stuck
    computing, which it waits for."""

    IDLE = "idle"
    DATA = "data"
    COMPUTE = "compute"
    STAGE_WAIT = "stage-wait"
    REPLICATE = "replicate"
    VOTE = "vote"
    DONE = "done"
    FAILED = "failed"

    @property
    def progress(self) -> int:
        return list(Phase).index(self)

    @property
    def finished(self) -> bool:
        """Through with its step: its report is on the way, whatever a probe says."""
        return self in (Phase.DONE, Phase.FAILED)


@dataclass(frozen=True)
class RankActivity:
    """What a rank is doing, answered on its control thread even while the step is stuck."""

    global_rank: int
    step: int
    phase: Phase
    micro_batch: int
    module_entries: int
    phase_age_s: float

    @property
    def finished(self) -> bool:
        return Phase(self.phase).finished

    def order(self) -> tuple[int, int, int]:
        return (Phase(self.phase).progress, self.micro_batch, self.module_entries)


class RankTimes(NamedTuple):
    """A rank's seconds in a committed step: waiting for its data, computing, from the end
    of its compute to the end of the cross-group sums, and in all until its vote; and the
    gradients' cross-group sum, which starts inside backward: from its first bucket sent to
    its last summed, and the part of that after backward ended (what the step waits for).
    A tuple, so a group's rows flatten into the segment's gather cheaply (``record_row``)."""

    data_s: float
    compute_s: float
    comm_s: float
    wall_s: float
    grad_sum_s: float = 0.0  # 0 without other groups to sum with
    grad_sum_exposed_s: float = 0.0


@dataclass(frozen=True)
class StepRecord:
    """A step one group committed, as every rank of the group decided it in its vote."""

    step: int
    group: int
    loss: float  # the global batch's loss (every group's shares)
    grad_norm: float  # the global gradient norm, before clipping
    clip_scale: float
    lr: float  # the optimizer's first parameter group's rate, as the step applied it
    global_samples: int
    group_samples: dict[int, int]  # each live group's share of the batch
    next_cursor: DataCursor  # where the data order stands after this step
    ranks: tuple[int, ...]  # the group's global ranks, ascending
    times: tuple[RankTimes, ...]  # per rank, in the order of ``ranks``
    step_s: float = 0.0  # the group's first rank's loop period: the step, its update and its report
    # What the loss counted over the whole step: target tokens in the next-token form, the
    # count batch_loss_fn returns otherwise. The run's throughput is this per second.
    counted: int = 0
    # Per expert layer, by its number: its most loaded expert's tokens over the mean (1.0: even),
    # from what every rank of every group routed
    expert_load: dict[int, float] = field(default_factory=dict)
    # The bytes the group's ranks handed the cross-group sums in the step: the gradients' buckets
    # (every step's sum) or, after a DiLoCo round's last step, the pseudo-gradients'; the step's row
    cross_group_bytes: int = 0
    outer_step: bool = False  # a DiLoCo fragment's turn (a round's end, without fragments) followed this step
    # The group's first rank's outer exchanges merged after this step: their seconds, and those
    # the step waited for (all of a synced one's; of a delayed one's, what compute did not hide)
    outer_sum_s: float = 0.0
    outer_sum_exposed_s: float = 0.0
    replayed: bool = False  # a spot check: every group's work was replayed and reproduced


@dataclass(frozen=True)
class GroupRecords:
    """A group's committed steps that no ``SegmentRecords`` carried: a segment of one group, or what a
    group's first rank holds when its segment ends."""

    group: int
    records: tuple[StepRecord, ...]


# A group's first rank's row per committed step, in the gather: group, step, loop period, then
# the ``RankTimes`` of each of its ranks.
ROW_GROUP, ROW_STEP, ROW_LOOP_S = range(3)
ROW_HEAD = 3


def record_row(record: StepRecord) -> list[float]:
    return [float(record.group), float(record.step), record.step_s, *chain.from_iterable(record.times)]


@dataclass(frozen=True)
class SegmentRecords:
    """Every group's committed steps since the segment's last message. The decided values (loss,
    norm, rate, shares, cursor) are every group's, so the sender's own records carry them;
    each group adds its ranks' times and its loop period, kept as the gather's arrays."""

    records: tuple[StepRecord, ...]  # the sender's, one per step
    groups: tuple[int, ...]
    times: np.ndarray  # [step, rank, time]: the RankTimes of each group's ranks in turn
    step_s: np.ndarray  # [step, group]: each group's loop period, in ``groups`` order

    @classmethod
    def from_rows(cls, records: tuple[StepRecord, ...], rows: np.ndarray) -> SegmentRecords:
        """From the gathered rows, ``[group's first rank, step, row]``."""
        rows = rows[np.argsort(rows[:, 0, ROW_GROUP], kind="stable")]
        steps = rows[:, :, ROW_STEP].astype(np.int64)
        if (steps != [record.step for record in records]).any():
            raise ValueError(f"the groups' first ranks gathered different steps: {steps.tolist()}")
        return cls(
            records=records, groups=tuple(rows[:, 0, ROW_GROUP].astype(np.int64).tolist()),
            times=rows[:, :, ROW_HEAD:].transpose(1, 0, 2).reshape(len(records), -1, len(RankTimes._fields)),
            step_s=rows[:, :, ROW_LOOP_S].T,
        )

    @classmethod
    def of_groups(cls, records: dict[int, list[StepRecord]]) -> SegmentRecords:
        """From each group's own records of the same steps (what the gather assembles)."""
        ordered = [records[group] for group in sorted(records)]
        return cls.from_rows(tuple(ordered[0]),
                             np.array([[record_row(record) for record in member] for member in ordered], np.float64))


@dataclass(frozen=True)
class NonFinite:
    """A step every rank discarded because its loss or gradient norm was not finite: with fp16's
    loss scale, a norm that overflowed while the loss was finite is the scale's, not the run's."""

    step: int
    loss: float
    grad_norm: float
    overflow: bool = False  # fp16's gradients overflowed at this loss scale (the loss was finite)


@dataclass(frozen=True)
class HealReceipt:
    """A joining rank's catch-up (``CatchUp``), done: the bytes it received from ``source``, the
    copy's seconds, and the committed steps it applied after loading the state."""

    source: int
    bytes: int
    seconds: float
    caught_up_steps: int


@dataclass(frozen=True)
class SegmentEnd:
    """How a rank's segment ended: ``next_step`` is the first step it has not committed;
    ``failure`` the outcome of the step that failed, ``None`` when the segment paused;
    ``nonfinite`` the step it discarded as not finite, where the segment stopped on one;
    ``integrity`` what its position's replicas disagreed about, where the segment stopped on a
    mismatch (ranks at positions that agreed end on the same step with ``None``); ``healed``, a
    joining rank's catch-up (a joining rank that could not catch up ends failed, its group broken)."""

    global_rank: int
    next_step: int
    failure: RankOutcome | None = None
    nonfinite: NonFinite | None = None
    integrity: IntegrityMismatch | None = None
    replay: ComputeMismatch | None = None  # what its position's spot check found, as ``integrity``
    healed: HealReceipt | None = None  # a joining rank's catch-up in this segment
    waits_for_next: bool = False  # the rank's stream goes on: it waits for a NextSegment or a ReleaseWaiting


@dataclass(frozen=True)
class NextSegment:
    """The segment after an attempt, for the ranks that ended it and wait: a rank of one of
    ``spec``'s groups runs ``own.get(rank, spec)`` (``own``: the few ranks whose spec differs, an
    injected fault's), in the stream it ended the attempt in; a rank of another group returns."""

    spec: SegmentSpec
    own: dict[int, SegmentSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class ReleaseWaiting:
    """The waiting ranks of ``groups`` (None: every group) return: the driver has calls for them.
    The others wait on for the attempt's next word (``workers.segment_handoff``)."""

    groups: frozenset[int] | None


SegmentMessage = GroupRecords | SegmentRecords | SegmentEnd
RECORD_MESSAGES = (GroupRecords, SegmentRecords)  # a segment's stream goes on after these


class HookFailed(RuntimeError):
    """A rank's own hooks (model, parallelize, optimizer) raised while its group was built, in
    no collective: a fresh process runs the same code. Its message is the error's type and
    text and where in the user's code it was raised."""


@dataclass
class BuildOutcome:
    """How a rank's build of its group's world and model went: its seconds, its node, what it built."""

    global_rank: int
    seconds: float
    node_ip: str = ""
    parameter_bytes: int = 0  # its parameters' (its shards'), from which a heal's copy is foreseen

"""Plain data exchanged between the driver and the rank actors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from checkpointing.storage import StorageOptions

ERROR_CHARS = 2000


def describe_error(error: BaseException | str, limit: int = ERROR_CHARS) -> str:
    """An error's type and message, cut from the front when too long: a remote error's text
    is a traceback followed by the exception line, and that last line names the cause."""
    text = (error if isinstance(error, str) else f"{type(error).__name__}: {error}").strip()
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


@dataclass(frozen=True)
class RankSpec:
    global_rank: int
    group: int
    group_rank: int  # its rank in the group's world (see elastic.core.topology)
    shard_index: int
    tp_index: int
    shard: int
    tp: int
    seed: int
    use_gpu: bool
    store_host: str
    store_port: int
    store_prefix: str  # the run's secret key prefix on the rendezvous store
    collective_timeout_s: float
    storage: StorageOptions = StorageOptions()
    upload_in_process: bool = False
    replicate_dtype: str = "fp32"

    @property
    def position(self) -> tuple[int, int]:
        return (self.shard_index, self.tp_index)


@dataclass(frozen=True)
class Commit:
    """How a rank applies its pending step: each parameter group at its base learning rate
    times ``lr_scale`` (the schedule's factor for that step), with the gradients multiplied
    by ``grad_scale`` (the clipping coefficient from the step's global gradient norm)."""

    lr_scale: float = 1.0
    grad_scale: float = 1.0


@dataclass(frozen=True)
class StepRequest:
    generation: int
    step: int
    micro_batches: tuple[tuple[int, ...], ...]
    global_tokens: int
    commit_previous: Commit | None  # None: discard the pending step
    attempt: int = 0  # unique per dispatch: a rerun of a step is a new attempt
    deadline_s: float = float("inf")  # from the step's start: no wait on peers outlasts it
    evaluate: bool = False  # the held-out loss over these samples: no gradients, nothing pending


class Failure(StrEnum):
    """What a failed step points at (``workers.failures.classify`` decides)."""

    OWN_IO = "own-io"
    OWN_COMPUTE = "own-compute"
    COLLECTIVE = "collective"
    RELEASED = "released"

    @property
    def blames_peers(self) -> bool:
        return self in (Failure.COLLECTIVE, Failure.RELEASED)


@dataclass(frozen=True)
class StepReport:
    global_rank: int
    step: int
    loss_share: float = 0.0
    data_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    wall_s: float = 0.0
    # this rank's part of the squared global gradient norm after the cross-group sum (each
    # element of the group's gradients counted on exactly one rank)
    grad_sq_norm: float = 0.0
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


PHASES = ("idle", "data", "compute", "replicate", "done", "failed")
# The rank is through with its step: its report is on the way, whatever a probe says.
FINISHED_PHASES = ("done", "failed")


@dataclass(frozen=True)
class Progress:
    """What a rank is doing, answered on its control thread even while the step is stuck."""

    global_rank: int
    step: int
    phase: str
    micro_batch: int
    module_entries: int
    phase_age_s: float

    @property
    def finished(self) -> bool:
        return self.phase in FINISHED_PHASES

    def order(self) -> tuple[int, int, int]:
        return (PHASES.index(self.phase), self.micro_batch, self.module_entries)


@dataclass
class BuildReport:
    global_rank: int
    seconds: float
    node_ip: str = ""
    details: dict = field(default_factory=dict)

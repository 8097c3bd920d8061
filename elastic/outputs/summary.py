"""``summary.json``'s schema: the one typed record of a run that the trainer writes and every
reader (``RunResult``, the command's last line, ``elastic report``, the next leg of the run)
reads back.

A field a reader may miss has a default: a summary cut short, or written by an earlier
version, still reads. The writer fills every field (a test holds it to that). Ranks, groups
and expert layers are JSON object keys, so strings in the file and integers here.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from elastic.core.events import redact_credentials
from elastic.driver.records import EvalResult, StepResult

SUMMARY_NAME = "summary.json"


class Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepEntry(Schema):
    """A committed step (``StepResult``) as the summary keeps it: one map per time, by rank."""

    t: float  # seconds into its leg when the driver recorded it
    step: int | None = None
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    grad_clip_scale: float | None = None
    step_s: float | None = None  # the slowest group's loop period
    live_groups: int | None = None
    live_ranks: int | None = None
    generation: int | None = None
    tokens_per_s: float | None = None
    rank_step_s: dict[int, float | None] = {}  # RankTimes.wall_s
    rank_data_s: dict[int, float] = {}
    rank_compute_s: dict[int, float] = {}
    rank_comm_s: dict[int, float] = {}
    rank_grad_sum_s: dict[int, float] = {}
    rank_grad_sum_exposed_s: dict[int, float] = {}
    group_samples: dict[int, int] = {}
    rank_straggler_score: dict[int, float] | None = None  # None where straggler mitigation is off
    expert_load: dict[int, float] = {}  # {} for a dense model
    cross_group_bytes: int = 0  # what every group's ranks handed the cross-group sums
    outer_step: bool = False  # a DiLoCo outer step's turn followed it
    outer_sum_s: float = 0.0  # its merged outer exchanges' seconds (the first group's first rank's)
    outer_sum_exposed_s: float = 0.0  # of which the step waited for

    @classmethod
    def of(cls, result: StepResult) -> StepEntry:
        times = result.rank_times
        return cls(
            t=result.t, step=result.step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm,
            grad_clip_scale=result.grad_clip_scale, step_s=result.step_s, live_groups=result.live_groups,
            live_ranks=result.live_ranks, generation=result.generation, tokens_per_s=result.tokens_per_s,
            rank_step_s={rank: time.wall_s for rank, time in times.items()},
            rank_data_s={rank: time.data_s for rank, time in times.items()},
            rank_compute_s={rank: time.compute_s for rank, time in times.items()},
            rank_comm_s={rank: time.comm_s for rank, time in times.items()},
            rank_grad_sum_s={rank: time.grad_sum_s for rank, time in times.items()},
            rank_grad_sum_exposed_s={rank: time.grad_sum_exposed_s for rank, time in times.items()},
            group_samples=result.group_samples, rank_straggler_score=result.straggler_scores,
            expert_load=result.expert_load, cross_group_bytes=result.cross_group_bytes, outer_step=result.outer_step,
            outer_sum_s=result.outer_sum_s, outer_sum_exposed_s=result.outer_sum_exposed_s,
        )


class TopologyEntry(Schema):
    """The layout at the leg's end: live groups of pp x shard x cp x tp ranks, the experts
    split over blocks of ep shard ranks (``elastic.core.topology.Topology.record``)."""

    groups: int = 0
    pp: int = 1
    shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # absent from the summaries written before it: 1
    ranks: int = 0


class RunTotal(Schema):
    """Every leg of the run added up (``run_record.with_history``)."""

    legs: int
    wall_s: float
    goodput: float
    time_breakdown: dict[str, float]
    steps_committed: int
    steps_discarded: int
    steps_rolled_back: int
    exits: list[str | None]
    source_samples: dict[str, int] = {}


class RunSummary(Schema):
    """One leg of a run, and (``earlier_legs``, ``run_total``) the legs before it."""

    run: str | None = None
    config: dict[str, Any] = {}
    init_from: dict[str, str] = {}  # what the weights started from, file by file
    topology: TopologyEntry = TopologyEntry()
    resumed_from_step: int | None = None
    first_step: int = 0
    steps_committed: int = 0
    steps_discarded: int = 0
    steps_rolled_back: int = 0
    losses: list[float] = []
    final_loss: float | None = None
    final_lr: float | None = None
    eval: list[EvalResult] = []
    final_eval_loss: float | None = None
    last_checkpoint: str | None = None
    wall_s: float | None = None
    tokens_per_s: float = 0.0  # counted tokens over the leg's wall time
    goodput: float = 0.0
    time_breakdown: dict[str, float] = {}  # seconds per goodput category, and wall_s
    steps: list[StepEntry] = []
    events: list[dict[str, Any]] = []  # every event, as EventLog recorded it
    exit: str | None = None  # the leg's Exit line
    # A mixture's samples from each source (data.sources' paths) in the leg's committed steps,
    # as the data plan gave them; {} for one source
    source_samples: dict[str, int] = {}
    leg: int = 1
    run_total: RunTotal | None = None
    earlier_legs: list[RunSummary] = []

    def written(self) -> dict[str, Any]:
        """The summary as ``summary.json`` holds it: strict JSON, credentials redacted."""
        text = json.dumps(strict_json(self.model_dump()), default=str, allow_nan=False)
        return json.loads(redact_credentials(text))

    @classmethod
    def read(cls, text: str | bytes) -> RunSummary:
        """Parse a ``summary.json``; a ``ValueError`` of one line names the first field that
        does not fit the schema."""
        try:
            return cls.model_validate_json(text)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(map(str, first["loc"])) or "the file"
            more = f" (and {error.error_count() - 1} more)" if error.error_count() > 1 else ""
            raise ValueError(f"{where}: {first['msg']}{more}") from None


def strict_json(value):
    """``value`` with every float that is not finite written as its name ("nan", "inf"):
    strict JSON parsers reject the bare ``NaN`` that Python writes. The schema reads the
    names back as floats."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value

"""How a leg of a run ends: one typed value from the controller (or the trainer, when the run
never got that far) to the exit code, the ``RunResult`` and the one line ``summary.json``
keeps (``exit``). Readers of an earlier leg's line parse it here, nowhere else."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class Ending(StrEnum):
    COMPLETED = "completed"  # every step ran
    PREEMPTED = "preempted"  # a stop signal: a retry resumes from the checkpoint
    STOPPED = "stopped"  # a condition the run cannot get past (its user's code or data, storage, a lease)
    DIVERGED = "diverged"  # losses or gradient norms not finite, step after step
    FAILED = "failed"  # any other error


# A preempted run exits like a process killed by SIGTERM, so a retry policy (a RayJob's
# backoffLimit, a scheduler) runs it again, and the rerun resumes from its checkpoint.
PREEMPTED_CODE = 143
# After the ending's word, when the final checkpoint was missed, before any detail; and the
# line's parts, as ``Exit.__str__`` writes them.
MISSED = ", final checkpoint missed (step {step}): see the checkpoint-failed events"
_LINE = re.compile(r"(?P<ending>[a-z]+)(?:, final checkpoint missed \(step (?P<step>\d+)\): see the checkpoint-failed "
                   r"events(?:; (?P<after_missed>.*))?|: (?P<detail>.*))?", re.DOTALL)


@dataclass(frozen=True)
class Exit:
    ending: Ending
    detail: str = ""  # what happened, in the words after the ending's
    final_checkpoint_missed_at: int | None = None  # the step whose final checkpoint was missed

    def __str__(self) -> str:
        line = str(self.ending)
        if self.final_checkpoint_missed_at is not None:
            line += MISSED.format(step=self.final_checkpoint_missed_at)
            return f"{line}; {self.detail}" if self.detail else line
        return f"{line}: {self.detail}" if self.detail else line

    @property
    def ok(self) -> bool:
        """Completed, with its final checkpoint committed."""
        return self.ending == Ending.COMPLETED and self.final_checkpoint_missed_at is None

    @property
    def code(self) -> int:
        """The process's exit code: 0 for a run that is done, 143 for a preempted one (run it
        again to resume), 1 for anything else."""
        if self.ending == Ending.PREEMPTED:
            return PREEMPTED_CODE
        return 0 if self.ok else 1

    @classmethod
    def parse(cls, line: str) -> Exit:
        """The exit a summary's line records (``str(exit)``); ValueError for another line."""
        match = _LINE.fullmatch(line)
        if match is None or match["ending"] not in set(Ending):
            raise ValueError(f"not an exit line: {line[:80]!r}")
        missed = int(match["step"]) if match["step"] else None
        return cls(Ending(match["ending"]), match["after_missed"] or match["detail"] or "", missed)

"""The progress bar of ``elastic train``: step, loss, tokens/s and live ranks, and each fault
and recovery as one line above it."""

from __future__ import annotations

import logging

from elastic.core.events import EventKind, console_line, redact_credentials
from elastic.driver.records import StepResult

log = logging.getLogger("elastic")


class ProgressBar:
    """Step, loss, tokens/s and live ranks on a tqdm bar (a no-op when disabled)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.bar = total, enabled, None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="step", dynamic_ncols=True)
        return self

    def skip_to(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def update(self, result: StepResult) -> None:
        if self.bar is None:
            return
        # The step's number, not a count of commits: after a rollback the steps since the state
        # it went back to are committed again, and the bar goes back with them.
        self.bar.update(result.step + 1 - self.bar.n)
        self.bar.set_postfix(
            loss=f"{result.loss:.3f}", tok_s=f"{result.tokens_per_s:.0f}", ranks=result.live_ranks, refresh=False
        )

    def on_event(self, event: dict) -> None:
        """Faults and recoveries as one line each: above the bar, or logged without one."""
        line = console_line(event)
        if line is None:
            return
        if self.bar is not None:
            self.bar.write(redact_credentials(line))
        else:  # a quorum that grows, and a start said as it goes, are no warning
            news = event["kind"] in (EventKind.GROUP_JOINED, EventKind.GROUP_STARTING, EventKind.GROUP_BUILT)
            log.log(logging.INFO if news else logging.WARNING, "%s", redact_credentials(line))

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

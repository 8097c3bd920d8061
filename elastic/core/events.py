"""Structured run events: every detection, eviction, rebuild, heal, join, straggler decision
and checkpoint is one ``{t, kind, ...}`` record, logged as it happens, kept for the summary,
and handed to listeners (the Prometheus metrics are one)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from enum import StrEnum
from typing import Any

log = logging.getLogger("elastic.events")

# ``scheme://user:password@host``: the credentials part of a URL. Up to the authority's last
# ``@``, so a password holding an unescaped ``@`` is hidden whole.
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/?#\s\"']*@")
# Query parameters that carry a secret or the key it was signed with: presigned S3 URLs
# (SigV4: X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token; V2), GCS signed URLs (V4
# and V2), Azure SAS tokens (sig), and any parameter named for a signature, token, key,
# secret, password or credential, alone or as the last word of its name (api_key,
# access_token, client-secret). A value runs to the next parameter or the URL's end: better a
# trailing comma hidden than part of a secret shown.
_SECRET_WORDS = r"signature|sig|token|key|secret|password|passwd|credentials?"
_SECRET_NAME = rf"(?:[\w.-]*[_.-])?(?:{_SECRET_WORDS})|AWSAccessKeyId|GoogleAccessId|apikey"
_SECRET_QUERY = re.compile(rf"(?<=[?&])({_SECRET_NAME})=[^&#\s\"']*", re.IGNORECASE)


def redact_credentials(text: str) -> str:
    """``text`` with the credentials of every URL in it, and the values of its secret query
    parameters, replaced by ``***``."""
    return _SECRET_QUERY.sub(r"\1=***", _URL_CREDENTIALS.sub("***@", text))


class RedactingFormatter(logging.Formatter):
    """Log lines with credentials redacted: message, arguments and traceback alike."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_credentials(super().format(record))


class EventKind(StrEnum):
    """Every kind of event; the value is what the summary, the logs and the report carry."""

    RUN_STARTED = "run-started"
    RUN_FINISHED = "run-finished"
    RESUMED = "resumed"
    DATA_CHANGED = "data-changed"
    STOP_REQUESTED = "stop-requested"
    LEASE_LOST = "lease-lost"
    DRIVER_LOST = "driver-lost"
    SILENT_CORRUPTION_FOUND = "silent-corruption-found"  # a spot check's replay did not reproduce a rank's work
    STEP_REPLAYED = "step-replayed"  # a spot check: every group's work replayed by another, and reproduced  # the previous driver died holding the run: its lease taken without waiting it out
    METRICS_SERVING = "metrics-serving"
    # membership
    GROUP_RESERVED = "group-reserved"
    GROUP_START_FAILED = "group-start-failed"
    GROUP_BUILT = "group-built"
    GROUP_STARTING = "group-starting"  # a start's progress: how many of a group's new rank processes are up
    GROUP_HEALED = "group-healed"
    HEAL_FALLBACK = "heal-fallback"  # a rank's heal went through the object store: its rank-to-rank copy failed
    GROUP_JOINED = "group-joined"
    GROUP_EVICTED = "group-evicted"
    GROUPS_REBUILT = "groups-rebuilt"
    SPARE_READY = "spare-ready"
    SPARE_TAKEN = "spare-taken"
    SPARE_LOST = "spare-lost"
    # failures and recovery
    FAULT_INJECTED = "fault-injected"
    STEP_DEADLINE = "step-deadline"
    FAILURE_DIAGNOSED = "failure-diagnosed"  # every failure, with the cause named, before any recovery or stop
    RANK_FAILED = "rank-failed"
    RANK_EVICTED = "rank-evicted"
    STEP_DISCARDED = "step-discarded"
    NONFINITE_STEP = "nonfinite-step"
    INTEGRITY_MISMATCH = "integrity-mismatch"
    RESTORED_FROM_CHECKPOINT = "restored-from-checkpoint"
    RESTORED_INITIAL_STATE = "restored-initial-state"
    RESTORED_FROM_MEMORY = "restored-from-memory"
    ROUND_REDONE = "round-redone"  # DiLoCo: a learner lost inside a round, the learners going on back at its start
    LEARNER_DROPPED = "learner-dropped"  # DiLoCo's drop: a learner lost inside a round left it, its samples returned
    RECOVERED = "recovered"
    EVAL_DISCARDED = "eval-discarded"
    # evaluation
    EVALUATED = "evaluated"
    # stragglers
    STRAGGLER_DETECTED = "straggler-detected"
    STRAGGLER_RECOVERED = "straggler-recovered"
    STRAGGLER_DECIDED = "straggler-decided"
    STRAGGLER_MITIGATED = "straggler-mitigated"
    # checkpoints
    CHECKPOINT_STARTED = "checkpoint-started"
    CHECKPOINT_DEFERRED = "checkpoint-deferred"
    CHECKPOINT_COMMITTED = "checkpoint-committed"
    CHECKPOINT_FAILED = "checkpoint-failed"
    CHECKPOINT_SKIPPED = "checkpoint-skipped"
    RNG_RESEEDED = "rng-reseeded"
    CHECKPOINTS_DELETED = "checkpoints-deleted"
    FINAL_CHECKPOINT_MISSED = "final-checkpoint-missed"


Event = dict[str, Any]


class EventLog:
    def __init__(self, clock: Callable[[], float], started_at: float | None = None):
        self.clock = clock
        self.started_at = clock() if started_at is None else started_at
        self.events: list[Event] = []
        self.listeners: list[Callable[[Event], None]] = []

    def elapsed(self) -> float:
        """Seconds into the run, as events and step results are stamped."""
        return round(self.clock() - self.started_at, 4)

    def emit(self, kind: EventKind, **fields: Any) -> Event:
        event = {"t": self.elapsed(), "kind": EventKind(kind).value, **fields}
        self.events.append(event)
        log.info("%s", redact_credentials(json.dumps(event, default=str)))
        for listener in self.listeners:
            listener(event)
        return event

    def of_kind(self, kind: EventKind) -> list[Event]:
        kind = EventKind(kind).value
        return [event for event in self.events if event["kind"] == kind]


def console_line(event: Event) -> str | None:
    """A fault, a recovery or a change of the quorum as one line for a person watching the
    console; None for events that are not one (every event stays in the log and the summary)."""
    kind, step = event.get("kind"), event.get("step")
    if kind == EventKind.STEP_DISCARDED:
        errors = event.get("errors") or {}
        # the culprits' own errors: a dead rank has none, and its peers' only say it went away
        own = [errors[rank] for rank in sorted(event["culprits"]) if rank in errors]
        first = f": {own[0]}" if own else ""
        return f"step {step} failed ({event['cause']}, ranks {sorted(event['culprits'])}){first}"
    if kind == EventKind.RANK_EVICTED:
        if event["cause"] == "stuck-in-collective":  # a victim: its thread cannot leave a collective a peer left
            return (f"rank {event['rank']} of group {event['group']} replaced (stuck-in-collective: it waited for a "
                    "peer that failed, and a process blocked in a collective cannot be freed; not at fault)")
        return f"rank {event['rank']} of group {event['group']} replaced ({event['cause']})"
    if kind == EventKind.RECOVERED:
        return f"recovered from {event['cause']} at step {step} in {event['total_s']:.1f}s"
    if kind == EventKind.HEAL_FALLBACK:
        return (f"rank {event['target']} of group {event['group']} healed through the object store: its copy "
                f"from rank {event['source']} failed ({event['reason']})")
    if kind == EventKind.GROUP_JOINED:
        return f"group {event['group']} joined (generation {event['generation']})"
    if kind == EventKind.GROUP_STARTING:
        return (f"group {event['group']}: {event['started']} of {event['ranks']} rank processes started "
                f"({event['seconds']:.0f}s)")
    if kind == EventKind.GROUP_BUILT:
        return (f"group {event['group']} built in {event['seconds']:.0f}s (rank processes started in "
                f"{event['start_s']:.0f}s, world and model built in {event['build_s']:.0f}s)")
    if kind == EventKind.NONFINITE_STEP:
        if event.get("overflow"):  # fp16's scale was too large for this step: expected now and then
            return f"step {step} discarded: fp16 gradients overflowed; loss scale lowered to {event['loss_scale']:g}"
        return f"step {step} discarded: loss {event['loss']}, grad norm {event['grad_norm']} (not finite); run again"
    if kind == EventKind.CHECKPOINT_FAILED:
        return f"checkpoint of step {step} failed: {event['error']}"
    if kind == EventKind.RUN_STARTED and event.get("resume_from") is not None:
        resume_from, steps = event["resume_from"], event.get("steps")
        if steps is not None and resume_from >= steps:
            return (f"the run is complete: its checkpoint of step {resume_from} ends its {steps} steps, nothing is "
                    f"left to train; raise steps (--steps) above {resume_from} to train it further, or give "
                    "another run_name (--run-name) for a new run")
        return f"resuming from the checkpoint of step {resume_from}"
    if kind == EventKind.DRIVER_LOST:
        return (f"the previous driver ({event['holder']}) is gone: its lease taken {event['lease_left_s']:.0f}s "
                "before it would have ended")
    if kind == EventKind.CHECKPOINT_SKIPPED:
        return f"checkpoint of step {step} skipped: {event['reason']}"
    if kind == EventKind.SPARE_LOST:
        return f"spare {event['spare']} lost: {event['error']}" + ("" if event["restarting"] else "; no more spares start")
    return None

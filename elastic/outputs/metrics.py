"""Prometheus metrics exported by the driver. Names are prefixed ``elastic_`` and carry their
unit; labels are bounded (rank ids, a fixed set of causes and phases).

The metrics follow the run from outside it: ``on_event`` listens to the event log, and
``on_step`` to the committed steps' results, so no decision code updates a metric itself.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from elastic.core.diagnosis import Cause
from elastic.core.events import Event, EventKind
from elastic.core.goodput import CATEGORIES, TimeLedger, goodput_of
from elastic.core.straggler_policy import ACTIONS
from elastic.driver.records import StepResult

# The bounded label values, created at zero before anything happens: Prometheus only sees a
# counter's first increment if it scraped the series before it, so increase() over a fresh
# series misses the first failure, and panels would show "no data" instead of 0.
RANK_FAILURES = (Cause.DEATH, Cause.HANG, Cause.OWN_ERROR, Cause.COLLECTIVE_ERROR, Cause.CONTROL_ERROR,
                 Cause.SILENT_CORRUPTION)
RECOVERY_CAUSES = (*RANK_FAILURES, Cause.INTEGRITY_MISMATCH)  # a mismatch evicts no rank
# Every cause a failure can be diagnosed with: those the run recovers from, and those that stop it
FAILURE_CAUSES = (*RECOVERY_CAUSES, Cause.OWN_DATA, Cause.OWN_CODE)
EVICTION_CAUSES = (*RANK_FAILURES, Cause.STUCK_IN_COLLECTIVE, Cause.STRAGGLER)

# How a heal's state reached a rank: its peer's own stream, or the object store when that failed.
RANK_TO_RANK, OBJECT_STORE = HEAL_ROADS = ("rank-to-rank", "object-store")

RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, run: str, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        labels = {"registry": self.registry}
        self.rank_step_seconds = Gauge(
            "elastic_rank_step_seconds", "Wall time of the rank's last step", ["rank"], **labels
        )
        self.rank_compute_seconds = Gauge(
            "elastic_rank_compute_seconds", "Own compute time of the rank's last step", ["rank"], **labels
        )
        self.rank_communication_seconds = Gauge(
            "elastic_rank_communication_seconds", "Cross-group reduction time of the rank's last step", ["rank"], **labels
        )
        self.rank_gradient_sum_exposed_seconds = Gauge(
            "elastic_rank_gradient_sum_exposed_seconds",
            "Part of the rank's last cross-group gradient sum left after its backward ended", ["rank"], **labels
        )
        self.rank_straggler_score = Gauge(
            "elastic_rank_straggler_score", "Rank compute time over the median rank's (1.0 = typical)", ["rank"], **labels
        )
        # one series per expert layer of the model: bounded by its depth
        self.expert_load = Gauge(
            "elastic_expert_load", "An expert layer's most loaded expert's tokens over the mean in the last step "
            "(1.0 = even)", ["layer"], **labels
        )
        self.live_groups = Gauge("elastic_live_groups", "Replica groups in the quorum", **labels)
        self.live_ranks = Gauge("elastic_live_ranks", "Ranks in the quorum", **labels)
        self.generation = Gauge("elastic_generation", "Membership generation", **labels)
        # A count, like elastic_steps_committed_total (steps are numbered from 0): after steps
        # 0..2 both read 3, and after a resume this one counts the resumed steps too.
        self.step = Gauge("elastic_step", "Steps the run has committed, resumed ones included (the next step)",
                          **labels)
        self.steps_committed = Counter("elastic_steps_committed", "Steps committed", **labels)
        self.steps_discarded = Counter("elastic_steps_discarded", "Steps discarded and rerun", **labels)
        self.cross_group_bytes = Counter(
            "elastic_cross_group_bytes", "Bytes the ranks handed the cross-group sums in committed steps: gradients "
            "every step, or a DiLoCo round's pseudo-gradients", **labels)
        self.outer_rounds = Counter("elastic_outer_rounds", "DiLoCo outer steps begun in committed steps: a round's "
                                    "end, or with sync.fragments each fragment's turn", **labels)
        self.outer_sum_seconds = Counter("elastic_outer_sum_seconds", "Seconds of the DiLoCo outer steps' exchanges "
                                         "across groups (the first group's first rank's)", **labels)
        self.outer_sum_exposed_seconds = Counter(
            "elastic_outer_sum_exposed_seconds", "Of elastic_outer_sum_seconds, those the steps waited for: the "
            "rest crossed behind the inner steps' compute (sync.sync_delay)", **labels)
        self.rounds_redone = Counter("elastic_rounds_redone", "DiLoCo rounds trained again from their start after a "
                                     "learner was lost inside them (sync.lost_learner = redo)", **labels)
        self.learners_dropped = Counter("elastic_learners_dropped", "DiLoCo learners dropped from a round they were "
                                        "lost in, their samples returned (sync.lost_learner = drop)", **labels)
        self.nonfinite_steps = Counter(
            "elastic_nonfinite_steps", "Steps discarded for a loss or gradient norm that is not finite", **labels
        )
        self.loss_scale_overflows = Counter(
            "elastic_loss_scale_overflows", "fp16 steps discarded because their gradients overflowed at the loss "
            "scale (each halves it; not counted as non-finite steps)", **labels
        )
        self.integrity_mismatches = Counter(
            "elastic_integrity_mismatches", "Positions whose replicas disagreed about their committed state",
            **labels,
        )
        self.replays = Counter("elastic_replays", "Spot checks committed: every group's work of a step replayed "
                               "by another group and reproduced bit for bit (integrity.replay_every)", **labels)
        self.silent_corruptions = Counter(
            "elastic_silent_corruptions", "Positions where a spot check's replay did not reproduce a group's work: "
            "a device computed wrong (each a silent-corruption-found event)", **labels)
        self.steps_rolled_back = Counter(
            "elastic_steps_rolled_back", "Committed steps rerun after a restore (no live peer): from memory, a checkpoint or the initial state", **labels
        )
        self.failures = Counter(
            "elastic_failures", "Failures (of a step, an evaluation, a control call or a group's start) by the cause "
            "diagnosed, those that stop the run included", ["cause"], **labels,
        )
        self.recoveries = Counter("elastic_recoveries", "Recoveries by cause", ["cause"], **labels)
        self.recovery_seconds = Histogram(
            "elastic_recovery_seconds", "Failure detection to next committed step", ["cause"],
            buckets=RECOVERY_BUCKETS, **labels,
        )
        self.evictions = Counter("elastic_evictions", "Ranks evicted by cause", ["cause"], **labels)
        self.heal_seconds = Histogram(
            "elastic_heal_seconds", "State copy from a live peer into a healing group", buckets=RECOVERY_BUCKETS, **labels
        )
        self.heal_bytes = Counter("elastic_heal_bytes", "Bytes of state healing groups received, by road", ["road"],
                                  **labels)
        self.checkpoint_blocking_seconds = Histogram(
            "elastic_checkpoint_blocking_seconds", "Training stall per checkpoint", buckets=CHECKPOINT_BUCKETS, **labels
        )
        self.checkpoint_upload_seconds = Histogram(
            "elastic_checkpoint_upload_seconds", "Background upload time per checkpoint", buckets=CHECKPOINT_BUCKETS, **labels
        )
        self.checkpoint_commit_seconds = Histogram(
            "elastic_checkpoint_commit_seconds", "Manifest write time per checkpoint", buckets=CHECKPOINT_BUCKETS, **labels
        )
        self.checkpoints_committed = Counter("elastic_checkpoints_committed", "Checkpoints committed", **labels)
        self.checkpoint_failures = Counter("elastic_checkpoint_failures", "Checkpoint uploads that failed", **labels)
        self.checkpoints_deferred = Counter(
            "elastic_checkpoints_deferred", "Due checkpoints deferred while one was in flight", **labels
        )
        self.tokens_per_second = Gauge("elastic_tokens_per_second", "Training throughput", **labels)
        self.loss = Gauge("elastic_loss", "Loss of the last committed step", **labels)
        self.eval_loss = Gauge("elastic_eval_loss", "Held-out loss at the last evaluation", **labels)
        self.learning_rate = Gauge("elastic_learning_rate", "Learning rate of the last committed step", **labels)
        self.grad_norm = Gauge(
            "elastic_grad_norm", "Global gradient norm of the last committed step, before clipping", **labels
        )
        self.goodput_ratio = Gauge("elastic_goodput_ratio", "Committed step time over wall time", **labels)
        self.time_seconds = Gauge(
            "elastic_time_seconds", "Wall time attributed by category", ["category"], **labels
        )
        self.straggler_mitigations = Counter(
            "elastic_straggler_mitigations", "Straggler mitigations by action", ["action"], **labels
        )
        self.spares_ready = Gauge("elastic_spares_ready", "Warm spares started and warmed up, ready to take a rank's place",
                                  **labels)
        self.spares_taken = Counter("elastic_spares_taken", "Ranks replaced by a warm spare", **labels)
        self.spares_lost = Counter("elastic_spares_lost", "Warm spares whose process died or whose warm-up raised",
                                   **labels)
        self.info = Gauge("elastic_run_info", "Run identity", ["run"], **labels)
        self.info.labels(run=run).set(1)
        for cause in FAILURE_CAUSES:
            self.failures.labels(cause=cause)
        for cause in RECOVERY_CAUSES:
            self.recoveries.labels(cause=cause)
            self.recovery_seconds.labels(cause=cause)
        for cause in EVICTION_CAUSES:
            self.evictions.labels(cause=cause)
        for action in ACTIONS:
            self.straggler_mitigations.labels(action=action)
        for category in CATEGORIES:
            self.time_seconds.labels(category=category)
        for road in HEAL_ROADS:
            self.heal_bytes.labels(road=road)

        self._scored_ranks: set[int] = set()

    def on_event(self, event: Event) -> None:
        kind = event["kind"]
        if kind == EventKind.FAILURE_DIAGNOSED:
            self.failures.labels(cause=event["cause"]).inc()
        elif kind == EventKind.RANK_EVICTED:
            self.evictions.labels(cause=event["cause"]).inc()
        elif kind == EventKind.STEP_DISCARDED:
            self.steps_discarded.inc()
        elif kind == EventKind.NONFINITE_STEP:
            self.steps_discarded.inc()
            (self.loss_scale_overflows if event.get("overflow") else self.nonfinite_steps).inc()
        elif kind == EventKind.ROUND_REDONE:
            self.rounds_redone.inc()
        elif kind == EventKind.LEARNER_DROPPED:
            self.learners_dropped.inc(len(event["groups"]))
        elif kind == EventKind.INTEGRITY_MISMATCH:
            self.integrity_mismatches.inc()
        elif kind == EventKind.SILENT_CORRUPTION_FOUND:
            self.silent_corruptions.inc()
        elif kind == EventKind.STEP_REPLAYED:
            self.replays.inc()
        elif kind == EventKind.EVALUATED:
            self.eval_loss.set(event["loss"])
        elif kind == EventKind.GROUP_HEALED:
            self.heal_seconds.observe(event["seconds"])
            self.heal_bytes.labels(road=RANK_TO_RANK).inc(event["rank_to_rank_bytes"])
            self.heal_bytes.labels(road=OBJECT_STORE).inc(event["object_store_bytes"])
        elif kind in (EventKind.RESTORED_FROM_CHECKPOINT, EventKind.RESTORED_INITIAL_STATE,
                      EventKind.RESTORED_FROM_MEMORY):
            self.steps_rolled_back.inc(event["rolled_back_steps"])
        elif kind == EventKind.GROUPS_REBUILT:
            self.generation.set(event["generation"])
            self.live_groups.set(len(event["groups"]))
            self.live_ranks.set(event["ranks"])
        elif kind == EventKind.RECOVERED:
            self.recoveries.labels(cause=event["cause"]).inc()
            self.recovery_seconds.labels(cause=event["cause"]).observe(event["total_s"])
        elif kind == EventKind.STRAGGLER_DECIDED:
            self.straggler_mitigations.labels(action=event["action"]).inc()
        elif kind in (EventKind.SPARE_READY, EventKind.SPARE_TAKEN, EventKind.SPARE_LOST):
            self.spares_ready.set(event["ready_spares"])
            if kind == EventKind.SPARE_TAKEN:
                self.spares_taken.inc()
            elif kind == EventKind.SPARE_LOST:
                self.spares_lost.inc()
        elif kind == EventKind.CHECKPOINT_STARTED:
            self.checkpoint_blocking_seconds.observe(event["stall_s"])
        elif kind == EventKind.CHECKPOINT_DEFERRED:
            self.checkpoints_deferred.inc()
        elif kind == EventKind.CHECKPOINT_FAILED:
            self.checkpoint_failures.inc()
        elif kind == EventKind.CHECKPOINT_COMMITTED:
            self.checkpoint_upload_seconds.observe(event["upload_s"])
            self.checkpoint_commit_seconds.observe(event["commit_s"])
            self.checkpoints_committed.inc()

    def on_step(self, result: StepResult, ledger: TimeLedger) -> None:
        """A committed step's result and the time ledger after it."""
        for rank, times in result.rank_times.items():
            label = str(rank)
            self.rank_step_seconds.labels(rank=label).set(times.wall_s)
            self.rank_compute_seconds.labels(rank=label).set(times.compute_s)
            self.rank_communication_seconds.labels(rank=label).set(times.comm_s)
            self.rank_gradient_sum_exposed_seconds.labels(rank=label).set(times.grad_sum_exposed_s)
        self.straggler_scores(result.straggler_scores or {})
        for layer, load in result.expert_load.items():
            self.expert_load.labels(layer=str(layer)).set(load)
        self.steps_committed.inc()
        self.cross_group_bytes.inc(result.cross_group_bytes)
        if result.outer_step:
            self.outer_rounds.inc()
        self.outer_sum_seconds.inc(result.outer_sum_s)
        self.outer_sum_exposed_seconds.inc(result.outer_sum_exposed_s)
        self.step.set(result.step + 1)
        self.loss.set(result.loss)
        self.learning_rate.set(result.lr)
        self.grad_norm.set(result.grad_norm)
        self.tokens_per_second.set(result.tokens_per_s)
        breakdown = ledger.breakdown()  # one instant: the goodput is of the same wall
        self.time_spent(goodput_of(breakdown), breakdown)

    def time_spent(self, goodput: float, breakdown: dict[str, float]) -> None:
        """Goodput and the wall time by category: the ledger's after each step, and once the run
        has ended the summary's own (served as they are while the endpoint lingers)."""
        self.goodput_ratio.set(goodput)
        for category, seconds in breakdown.items():
            if category != "wall_s":
                self.time_seconds.labels(category=category).set(seconds)

    def straggler_scores(self, scores: dict[int, float]) -> None:
        """The scored ranks' latest straggler scores; ranks no longer scored lose their series."""
        for rank in self._scored_ranks - scores.keys():  # replaced or evicted since
            self.rank_straggler_score.remove(str(rank))
        for rank, score in scores.items():
            self.rank_straggler_score.labels(rank=str(rank)).set(score)
        self._scored_ranks = set(scores)

    def serve(self, host: str, port: int) -> int:
        """Serve ``/metrics``; port 0 picks a free port. Returns the bound port."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server.server_address[1]

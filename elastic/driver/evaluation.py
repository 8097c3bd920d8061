"""Held-out evaluation at a boundary: the loss of the committed state over the validation
set's first ``eval.samples`` samples, split across the live groups by the step's rules (so
the loss is the same whatever the number of groups), forward only, one call per rank."""

from __future__ import annotations

from collections.abc import Callable

from elastic.setup.config import TrainConfig
from elastic.core.data_plan import group_weights, plan_eval, token_rescale
from elastic.core.events import EventKind, EventLog
from elastic.core.goodput import TimeLedger
from elastic.core.protocol import EvalRequest
from elastic.driver.records import EvalResult
from elastic.driver.outcome_collector import FailureSeen, OutcomeCollector


class Evaluation:
    def __init__(self, config: TrainConfig, collector: OutcomeCollector, eval_len: int, events: EventLog,
                 ledger: TimeLedger, clock: Callable[[], float]):
        self.config = config
        self.collector = collector
        self.fleet = collector.fleet
        self.topology = collector.topology
        self.eval_len = eval_len
        self.events = events
        self.ledger = ledger
        self.clock = clock

    def run(self, step: int, live_groups: tuple[int, ...], attempt: int) -> EvalResult | FailureSeen:
        """The evaluation's result (also emitted as an event), or its failure."""
        plan = plan_eval(step, dataset_len=self.eval_len, samples=self.config.eval.samples,
                         group_weights=group_weights(live_groups, {}))
        # Forward only, over a batch that may be larger than a training step's.
        deadline_s = self.collector.deadline.seconds() * max(1.0, plan.global_samples / self.config.global_batch)
        global_tokens = plan.global_samples * self.config.data.seq_len
        started = self.clock()
        try:
            pending = self.fleet.evaluate({
                rank: EvalRequest(step, group_plan.micro_batches(self.topology.shard_index(rank), self.topology.shard,
                                                                 self.config.micro_batch),
                                  global_tokens, attempt, deadline_s)
                for group, group_plan in plan.groups.items() for rank in self.topology.global_ranks(group)
            })
            outcomes, failure = self.collector.collect(pending, step, attempt, started, deadline_s)
        finally:  # the ranks' watches of the evaluation end with it
            self.fleet.end_attempt(attempt)
        elapsed = self.clock() - started
        self.ledger.charge("evaluation" if failure is None else "discarded", elapsed)
        if failure is not None:
            return failure
        # Each shard position's share once: the last stage's loss, whose TP ranks compute the
        # same replicated logits.
        leading = [outcome for rank, outcome in outcomes.items() if self.topology.counts_loss(rank)]
        loss = sum(outcome.loss_share for outcome in leading) * token_rescale(
            global_tokens, sum(outcome.counted_tokens for outcome in leading))
        result = EvalResult(step, loss, plan.global_samples, round(elapsed, 4))
        self.events.emit(EventKind.EVALUATED, **result.to_json())
        return result

"""The Python API: ``ElasticTrainer(config, hooks...).fit()`` runs a job and returns its result."""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from datetime import datetime
from typing import Any

import ray

from checkpointing.catalog import CheckpointCatalog, NoUsableCheckpoint, Restorable
from checkpointing.lease import LeaseLost, RunLease
from checkpointing.pretrained import source_identity
from checkpointing.signing import signing_key_from_environment
from checkpointing.storage import join_url
from elastic.driver.checkpoint_coordinator import CheckpointCoordinator, CheckpointsFailing, latest_checkpoint
from elastic.setup.capacity import check_capacity, groups_beyond_capacity, on_cluster, spares_beyond_capacity
from elastic.setup.config import ConfigError, TrainConfig, replay_off, unbalanced_experts
from elastic.setup.preflight import check_pretrained_weights, preflight, pretrained_refused
from elastic.setup.resume_checks import (
    check_resumable, check_same_source, config_hash, config_record, resume_over_data,
)
from elastic.driver.controller import Controller, TrainingStopped
from elastic.driver.history import RunHistory
from elastic.driver.records import StepResult
from elastic.fleet.ray_messages import worker_deaths_to_log_file
from elastic.core.exits import Ending, Exit
from elastic.stop_signals import StopOnSignals, StoppedBeforeStart, second_signal_behind
from elastic.core.events import EventKind, EventLog, redact_credentials
from elastic.core.faults import FaultSchedule, parse_faults, resolve_random_targets
from elastic.core.goodput import TimeLedger, goodput_of
from elastic.core.data_plan import DataCursor
from elastic.data.mixture import Mixture
from elastic.data.ray_dataset import is_ray_dataset
from elastic.setup.dataset import data_identity, ray_dataset_source
from elastic.fleet.ray_connection import connect_ray
from elastic.fleet.ray_fleet import Fleet
from elastic.fleet.rendezvous import Rendezvous
from elastic.setup.hooks import check_hooks, resolve_hooks
from elastic.outputs.metrics import Metrics
from elastic.outputs.progress import ProgressBar
from elastic.outputs.run_record import earlier_legs, with_history, write_summary
from elastic.outputs.summary import SUMMARY_NAME, RunSummary, StepEntry, TopologyEntry
from elastic.core.protocol import describe_error

log = logging.getLogger("elastic")


def default_run_name() -> str:
    return f"run-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


@dataclass
class RunResult:
    run: str
    run_dir: str
    summary_path: str | None  # None: the summary could not be written (see its exit)
    record: RunSummary  # the summary, typed
    final_state: dict | None = field(default=None, repr=False)

    @cached_property
    def summary(self) -> dict[str, Any]:
        """The summary as ``summary.json`` holds it."""
        return self.record.written()

    @property
    def losses(self) -> list[float]:
        return self.record.losses

    @property
    def exit(self) -> str:
        """How the run ended, as its summary's line says it."""
        return self.record.exit

    @property
    def ended(self) -> Exit:
        return Exit.parse(self.exit)

    @property
    def ok(self) -> bool:
        """Completed, with its final checkpoint committed."""
        return self.ended.ok

    @property
    def last_checkpoint(self) -> str | None:
        return self.record.last_checkpoint


class ElasticTrainer:
    """Train a run. ``on_step`` callables get each committed step's ``StepResult`` (step,
    loss, lr, grad_norm, tokens_per_s, each rank's times, ...; ``summary.json`` keeps it as a
    ``StepEntry`` under ``steps``) as it is committed; ``on_event`` callables get every event
    (evaluations are ``evaluated`` events, with their loss), on the driver. An exception a
    callable raises stops the run."""

    def __init__(self, config: TrainConfig | None = None, *, model_fn=None, parallelize_fn=None, tp_plan=None,
                 split_fn=None, loss_fn=None, batch_loss_fn=None, collate_fn=None, dataset=None, eval_dataset=None,
                 optimizer_fn=None, progress: bool = False,
                 keep_final_state: bool = False, on_step: Iterable[Callable[[StepResult], None]] = (),
                 on_event: Iterable[Callable[[dict], None]] = ()):
        # A config from build_config or load_config passed this already; one built otherwise has not.
        self.config = preflight(config or TrainConfig())
        self.on_step, self.on_event = list(on_step), list(on_event)
        if tp_plan is not None and parallelize_fn is not None:
            raise ConfigError("tp_plan: give it or parallelize_fn, not both (tp_plan is the default "
                              "parallelize's tensor-parallel step)")
        self.run_name = self.config.run_name or default_run_name()
        self.run_dir = join_url(self.config.storage, self.run_name)
        vocab_size = self.config.model.vocab_size if model_fn is None else None
        if is_ray_dataset(dataset):
            dataset = ray_dataset_source(self.config, dataset, join_url(self.run_dir, "data", "train"), vocab_size)
        if is_ray_dataset(eval_dataset):
            eval_dataset = ray_dataset_source(self.config, eval_dataset, join_url(self.run_dir, "data", "validation"),
                                              vocab_size)
        self.hooks = resolve_hooks(self.config, model_fn=model_fn, parallelize_fn=parallelize_fn, loss_fn=loss_fn,
                                   dataset=dataset, eval_dataset=eval_dataset, optimizer_fn=optimizer_fn,
                                   tp_plan=tp_plan, split_fn=split_fn, batch_loss_fn=batch_loss_fn,
                                   collate_fn=collate_fn)
        self.progress = progress
        self.keep_final_state = keep_final_state
        scaling = self.config.scaling
        self.faults = resolve_random_targets(
            parse_faults(self.config.fault_tolerance.inject), self.config.seed, scaling.max_groups,
            scaling.topology.ranks_per_group,
        )
        try:
            self.dataset_len = len(self.hooks.dataset)
        except Exception as error:
            raise ConfigError(f"dataset: cannot be read: {error}; check data.path or the dataset hook") from None
        if self.dataset_len < self.config.global_batch:
            raise ConfigError(
                f"global_batch={self.config.global_batch} exceeds the dataset's {self.dataset_len} samples; "
                "lower global_batch or give more data"
            )
        check_hooks(self.config, self.hooks)
        self.eval_len = self._eval_len()
        self.data_identity = data_identity(self.hooks.dataset)
        self.source_identity = self._source_identity()
        # A run with no checkpoint of its own starts from the weights: their own error is refused
        # here, in one line, before Ray and its ranks start (a resume never reads them).
        self.weights_checked = bool(self.config.model.init_from) and not self._catalog().committed_steps()
        if self.weights_checked:
            check_pretrained_weights(self.config)

    def _source_identity(self) -> dict[str, str]:
        init_from = self.config.model.init_from
        if not init_from:
            return {}
        try:
            return source_identity(init_from, self.config.checkpoint.storage_options())
        except (OSError, ValueError) as error:
            raise pretrained_refused(init_from, error) from None

    def _eval_len(self) -> int:
        """The validation set's size; fails fast when evaluation is on without one."""
        if not self.config.eval.every:
            return 0
        if self.hooks.eval_dataset is None:
            raise ConfigError(
                f"eval.every={self.config.eval.every} needs a validation set: set data.validation_path or "
                "data.validation_fraction (or pass eval_dataset with a custom dataset), or set eval.every = 0"
            )
        try:
            return len(self.hooks.eval_dataset)
        except Exception as error:
            raise ConfigError(f"validation set: cannot be read: {error}; check data.validation_path") from None

    def fit(self, signalled_before: Callable[[], str | None] = lambda: None) -> RunResult:
        """Train the run to its end. Raises ``LeaseHeld`` at once, before Ray or any actor
        starts, when another driver holds the run. ``signalled_before``: the stop signal the
        caller caught before the run could (the CLI's, while it read the config and imported
        torch and Ray), if any; the run then ends preempted before Ray starts."""
        settings = self.config.checkpoint
        lease = RunLease(self.run_dir, settings.storage_options(), settings.lease_ttl_s)
        lease.acquire()
        # Read before anything of this leg is written: the run's record of its earlier legs.
        earlier = earlier_legs(*settings.storage_options().filesystem(self.run_dir), self.run_name)
        started_ray = False
        clock = time.monotonic
        events = EventLog(clock)
        ledger = TimeLedger(clock)
        metrics = Metrics(self.run_name)
        stop = threading.Event()
        renewing = threading.Event()
        fleet = None
        controller = None
        exit_reason = Exit(Ending.COMPLETED)
        final_state = None
        summary_path = None
        signals = StopOnSignals(stop, events)
        if lease.taken_from is not None:
            events.emit(EventKind.DRIVER_LOST, holder=lease.taken_from.holder,
                        lease_left_s=round(lease.taken_from.expires_at - time.time(), 1))
        restore_ray_messages = lambda: None  # noqa: E731
        try:
            signals.catch(caught_before=signalled_before)
            if stop.is_set():
                raise StoppedBeforeStart()
            # Renewed from here: starting Ray took up to a minute on a busy machine, longer than
            # a short lease_ttl_s, which then expired before the first renewal.
            lease.keep_renewed(renewing, on_lost=lambda why: self._lease_lost(why, events, stop))
            resume = self._resume(lease.generation, events)
            started_ray = connect_ray()
            signals.catch()  # again: ray.init puts a SIGTERM handler of its own in place
            restore_ray_messages = worker_deaths_to_log_file()
            cluster = ray.cluster_resources()
            self.config = on_cluster(self.config, cluster)
            check_capacity(self.config, cluster)
            for warning in (groups_beyond_capacity(self.config, cluster), spares_beyond_capacity(self.config, cluster),
                            unbalanced_experts(self.config), replay_off(self.config)):
                if warning is not None:
                    log.warning("%s", warning)
            if self.config.metrics.port or self.config.metrics.host != "127.0.0.1":
                port = metrics.serve(self.config.metrics.host, self.config.metrics.port)
                events.emit(EventKind.METRICS_SERVING, address=f"{self.config.metrics.host}:{port}")
            events.listeners += [metrics.on_event, *self.on_event]
            scaling = self.config.scaling
            topology = scaling.topology
            injects = bool(self.faults) or self.config.stragglers.noise > 0
            # A Ray this driver started is this machine's alone: its ranks reach the store on
            # loopback (Ray's own node address is the routable one even then).
            rendezvous = Rendezvous.start("127.0.0.1" if started_ray else None)
            fleet = Fleet(self.config, self.hooks, topology, rendezvous)
            checkpoints = self._checkpoints(fleet, events, ledger, topology, clock, lease)
            if resume is not None:
                fleet.resume_from_checkpoint()
            checkpoints.prune()
            schedule = FaultSchedule(self.faults, topology, events, clock, self.config.stragglers.noise)
            with ProgressBar(self.config.steps, enabled=self.progress) as bar:
                events.listeners.append(bar.on_event)
                controller = Controller(
                    self.config, fleet, self.dataset_len, events, ledger, clock=clock,
                    on_step=[bar.update, lambda result: metrics.on_step(result, ledger), *self.on_step],
                    checkpoints=checkpoints, resume=resume, stop_requested=stop,
                    faults=schedule if injects else None, eval_len=self.eval_len,
                )
                events.emit(EventKind.RUN_STARTED, run=self.run_name, steps=self.config.steps,
                            resume_from=resume.step if resume else None)
                if resume is not None:
                    bar.skip_to(resume.step)
                exit_reason = controller.run()
            if self.keep_final_state:
                final_state = controller.groups.final_state()
        except (TrainingStopped, CheckpointsFailing, NoUsableCheckpoint, LeaseLost) as error:
            exit_reason = Exit(Ending.STOPPED, str(error))
            log.error("%s", redact_credentials(str(error)))
        except StoppedBeforeStart:
            exit_reason = Exit(Ending.PREEMPTED, "a stop signal before Ray started, before any step")
        except SystemExit as error:
            if error.code != signal.SIGTERM:
                exit_reason = Exit(Ending.FAILED, describe_error(error, 1000))
                raise
            # ray.init's own SIGTERM handler, in place while Ray starts, exits with the signal's number.
            exit_reason = Exit(Ending.PREEMPTED, "SIGTERM while Ray was starting, before any step")
        except BaseException as error:  # refused settings, a bug: never "completed"
            second = second_signal_behind(error)
            if second is None:
                exit_reason = Exit(Ending.FAILED, describe_error(error, 1000))
                raise
            committed = controller.checkpoints.last_committed_step if controller and controller.checkpoints else None
            exit_reason = Exit(Ending.PREEMPTED,
                               f"a second {second} stopped the run at once, before the step boundary; "
                               + ("run it again to resume from its newest committed checkpoint, if it has one"
                                  if committed is None else f"it resumes from its checkpoint of step {committed}"))
        finally:
            signals.finishing = True
            renewing.set()
            try:
                events.emit(EventKind.RUN_FINISHED, exit=str(exit_reason))
                summary = with_history(self._summary(controller, events, ledger, exit_reason), earlier)
                metrics.time_spent(summary.goodput, summary.time_breakdown)
                if lease.lost:  # the summary is the new holder's to write now
                    log.error("the run's summary is not written: %s", lease.lost)
                else:
                    summary_path, summary = self._save_summary(summary)
            finally:
                if fleet is not None:
                    fleet.shutdown()
                if started_ray:
                    ray.shutdown()
                restore_ray_messages()
                self._release(lease)
                signals.release()
        return RunResult(self.run_name, self.run_dir, summary_path, summary, final_state)

    def _resume(self, generation: int, events: EventLog) -> Restorable | None:
        """The checkpoint the run resumes from, if any, checked against this leg's settings, data
        and weights: read from the run's storage before Ray starts, so that a refusal comes at once."""
        resume = latest_checkpoint(self._catalog(generation), events, self.config.checkpoint.start_fresh)
        if resume is None:
            if self.config.model.init_from and not self.weights_checked:  # its checkpoints were all set aside
                check_pretrained_weights(self.config)
            return None
        check_resumable(self.config, self.run_name, resume)
        resume = resume_over_data(self.config, self.run_name, resume, self.data_identity, events)
        self.source_identity = check_same_source(self.run_name, resume, self.source_identity)
        return resume

    def _checkpoints(self, fleet, events, ledger, topology, clock, lease: RunLease) -> CheckpointCoordinator:
        settings = self.config.checkpoint
        return CheckpointCoordinator(self._catalog(lease.generation), fleet, events, ledger, topology,
                                     config_hash(self.config), settings.max_consecutive_failures,
                                     settings.upload_timeout_s, clock, config_record=config_record(self.config),
                                     start_fresh=settings.start_fresh, lease=lease, data_identity=self.data_identity,
                                     source_identity=self.source_identity)

    def _catalog(self, generation: int = 0) -> CheckpointCatalog:
        settings = self.config.checkpoint
        return CheckpointCatalog(self.run_dir, settings.storage_options(), settings.every, settings.keep,
                                 generation=generation, signing_key=signing_key_from_environment())

    @staticmethod
    def _lease_lost(why: str, events: EventLog, stop: threading.Event) -> None:
        """Another driver took the run: stop at the next boundary; nothing more is committed."""
        events.emit(EventKind.LEASE_LOST, error=why)
        stop.set()

    @staticmethod
    def _release(lease: RunLease) -> None:
        try:
            lease.release()
        except Exception as error:  # the lease then ends at its expiry instead
            log.warning("the run lease could not be released (it expires in %.0f s): %s",
                        lease.ttl_s, describe_error(error))

    def _summary(self, controller: Controller | None, events: EventLog, ledger: TimeLedger,
                 exit_reason: Exit) -> RunSummary:
        scaling = self.config.scaling
        breakdown = ledger.breakdown()  # one instant: the wall, its parts and the goodput agree
        wall = breakdown["wall_s"]
        history = controller.history if controller else RunHistory()
        groups = len(controller.membership.live_groups()) if controller else 0
        losses, evals, steps = history.losses, history.eval_results, history.step_results
        summary = RunSummary(
            run=self.run_name,
            config={**self.config.model_dump(mode="json"), "run_name": self.run_name},  # a generated name too
            init_from=self.source_identity,
            topology=TopologyEntry(groups=groups, ranks=groups * scaling.topology.ranks_per_group,
                                   **scaling.topology.degrees()),
            resumed_from_step=controller.resume.step if controller and controller.resume else None,
            first_step=history.first_step,
            steps_committed=len(losses),
            steps_discarded=history.steps_discarded,
            steps_rolled_back=history.steps_rolled_back,
            losses=losses,
            final_loss=losses[-1] if losses else None,
            final_lr=steps[-1].lr if steps else None,
            eval=evals,
            final_eval_loss=evals[-1].loss if evals else None,
            last_checkpoint=controller.checkpoints.last_committed_url if controller and controller.checkpoints else None,
            wall_s=wall,
            tokens_per_s=history.tokens_committed / wall if wall > 0 else 0.0,
            goodput=goodput_of(breakdown),
            time_breakdown=breakdown,
            steps=[StepEntry.of(result) for result in steps],
            events=events.events,
            exit=str(exit_reason),
            source_samples=self._source_samples(controller),
        )
        return RunSummary.model_validate(summary.written())  # what the file will hold: redacted

    def _source_samples(self, controller: Controller | None) -> dict[str, int]:
        """The samples each source of a mixture gave this leg's committed steps, from the data plan
        alone: the cursor the leg started from and the one it stands at."""
        mixture = self.hooks.dataset
        if controller is None or not isinstance(mixture, Mixture):
            return {}
        started = DataCursor(**controller.resume.manifest.cursor) if controller.resume else DataCursor()
        trained = mixture.trained_before(controller.history.cursor) - mixture.trained_before(started)
        return dict(zip(mixture.names, trained.tolist()))

    def _save_summary(self, summary: RunSummary) -> tuple[str | None, RunSummary]:
        """Write the summary, and return where with what it says; a failed write fails the
        run, and never hides why it ended."""
        try:
            return self._write_summary(summary), summary
        except Exception as error:
            log.error("the run summary could not be written to %s: %s", self.run_dir, describe_error(error))
            failed = Exit(Ending.FAILED, f"summary not written ({describe_error(error, 300)}); the run "
                                         f"ended: {summary.exit}")
            return None, summary.model_copy(update={"exit": str(failed)})

    def _write_summary(self, summary: RunSummary) -> str:
        fs, path = self.config.checkpoint.storage_options().filesystem(self.run_dir)
        write_summary(fs, path, summary)
        return join_url(self.run_dir, SUMMARY_NAME)

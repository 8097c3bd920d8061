"""The Python API: ``ElasticTrainer(config, hooks...).fit()`` runs a job and returns its result."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

import ray

from checkpointing.catalog import CheckpointCatalog, NoUsableCheckpoint, Restorable
from checkpointing.lease import LeaseLost, RunLease
from checkpointing.manifest import signing_key_from_environment
from checkpointing.pretrained import changed_files, source_identity
from checkpointing.storage import join_url
from elastic.driver.checkpoint_coordinator import CheckpointCoordinator, CheckpointsFailing
from elastic.setup.config import (
    ConfigError, TrainConfig, check_capacity, groups_beyond_capacity, on_cluster, spares_beyond_capacity,
)
from elastic.setup.preflight import check_pretrained_weights, preflight, pretrained_refused
from elastic.driver.controller import Controller, TrainingStopped
from elastic.driver.records import StepResult
from elastic.fleet.ray_messages import worker_deaths_to_log_file
from elastic.core.exits import Ending, Exit
from elastic.core.events import EventKind, EventLog, console_line, redact_credentials
from elastic.core.faults import FaultSchedule, parse_faults, resolve_random_targets
from elastic.core.goodput import TimeLedger
from elastic.core.topology import Topology
from elastic.setup.dataset import data_identity
from elastic.fleet.ray_fleet import Fleet
from elastic.fleet.rendezvous import Rendezvous
from elastic.setup.hooks import check_hooks, resolve_hooks
from elastic.outputs.metrics import Metrics
from elastic.outputs.run_record import SUMMARY_NAME, earlier_legs, with_history, write_summary
from elastic.core.protocol import describe_error

log = logging.getLogger("elastic")


def default_run_name() -> str:
    return f"run-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


# The settings a checkpoint's state and data cursor depend on. Layout, steps, checkpoint,
# compute and metrics settings may change across a resume.
STATE_FIELDS = {"model", "data", "optimizer", "seed", "global_batch"}
# Recorded with the state (elastic export reads them back) but no part of its math: a resume
# may differ in them (a run started before the field existed recorded none).
NOT_IN_THE_MATH = {"model.max_position_embeddings"}


def config_record(config: TrainConfig) -> dict:
    record = config.model_dump(mode="json", include=STATE_FIELDS)
    # A decaying schedule's horizon as resolved: a run extended with more steps and no
    # explicit decay_steps would change its learning rates under the resume.
    schedule = config.lr_schedule
    record["optimizer"]["decay_steps"] = schedule.decay_steps if schedule.decay != "constant" else None
    return record


def config_hash(config: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(config_record(config), sort_keys=True).encode()).hexdigest()[:16]


def flatten(record: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_resumable(config: TrainConfig, run: str, checkpoint: Restorable) -> None:
    """Refuse a resume whose settings would change the math the checkpoint was trained with."""
    manifest = checkpoint.manifest
    if manifest.config:
        now = flatten(config_record(config))
        # A setting added since the checkpoint was written trained it at its default value.
        saved = {**flatten(config_record(TrainConfig())), **flatten(manifest.config)}
        keys = (saved.keys() | now.keys()) - NOT_IN_THE_MATH
        changed = sorted(key for key in keys if saved.get(key) != now.get(key))
        described = ", ".join(f"{key}: {saved.get(key)!r} -> {now.get(key)!r}" for key in changed)
    else:  # written before manifests recorded the settings: only the hash can tell
        changed = [] if manifest.config_hash == config_hash(config) else ["(settings not recorded)"]
        described = "model, data, optimizer, seed or global_batch"
    if changed:
        raise ConfigError(
            f"run {run!r} resumes from step {checkpoint.step} ({checkpoint.url}), which was trained "
            f"with other settings: {described}; these change the model or the data order. Use the run's settings, "
            "or a new run name (--run-name) to start another run"
        )


def described_changes(saved: dict[str, str], now: dict[str, str], files: list[str], shown: int = 5) -> str:
    """Each changed file, what it was and what it is (``absent`` for none), the first
    ``shown`` of them."""
    return "; ".join(f"{file}: {saved.get(file, 'absent')} -> {now.get(file, 'absent')}" for file in files[:shown]) + (
        f"; and {len(files) - shown} more" if len(files) > shown else "")


def resume_over_data(config: TrainConfig, run: str, checkpoint: Restorable, identity: dict[str, str],
                     events: EventLog) -> Restorable:
    """The checkpoint to resume from, given the data as it is now. Data changed under the same
    path is refused, naming the files: the saved cursor indexes an order over other data, and
    would skip some samples and train others twice. With ``checkpoint.accept_changed_data``
    the model resumes and the data starts a new epoch."""
    saved = checkpoint.manifest.data  # empty: the data was generated, or the user's own
    changed = sorted(file for file in saved.keys() | identity.keys() if saved.get(file) != identity.get(file))
    if not saved or not changed:
        return checkpoint
    described = described_changes(saved, identity, changed)
    if not config.checkpoint.accept_changed_data:
        raise ConfigError(
            f"run {run!r} resumes from step {checkpoint.step}, but its data changed since: {described}; its data "
            "cursor would skip some samples and train others twice. Restore the data, or pass --accept-changed-data "
            "(checkpoint.accept_changed_data = true) to resume the model with a new epoch over the data"
        )
    cursor = {"epoch": checkpoint.manifest.cursor.get("epoch", 0) + 1, "position": 0}
    events.emit(EventKind.DATA_CHANGED, step=checkpoint.step, files=changed, cursor=cursor)
    return replace(checkpoint, manifest=checkpoint.manifest.model_copy(update={"cursor": cursor}))


def check_same_source(run: str, checkpoint: Restorable, identity: dict[str, str]) -> dict[str, str]:
    """The source identity a resumed run records: the one it started from. A resume never reads
    ``model.init_from`` again (it may be gone), but a source changed under the same name is
    refused: the run's record would name weights it did not start from."""
    saved = checkpoint.manifest.source
    changed = changed_files(saved, identity) if saved else []
    if changed:
        raise ConfigError(
            f"run {run!r} resumes from step {checkpoint.step}, but model.init_from changed since the run started "
            f"from it: {described_changes(saved, identity, changed)}; restore the source, or start a new run (--run-name) from it"
        )
    return saved or identity


@dataclass
class RunResult:
    run: str
    run_dir: str
    summary_path: str | None  # None: the summary could not be written (see its exit)
    summary: dict[str, Any]
    final_state: dict | None = field(default=None, repr=False)

    @property
    def losses(self) -> list[float]:
        return self.summary["losses"]

    @property
    def exit(self) -> str:
        """How the run ended, as its summary's line says it."""
        return self.summary["exit"]

    @property
    def ended(self) -> Exit:
        return Exit.parse(self.exit)

    @property
    def ok(self) -> bool:
        """Completed, with its final checkpoint committed."""
        return self.ended.ok

    @property
    def last_checkpoint(self) -> str | None:
        return self.summary["last_checkpoint"]


def strict_json(value):
    """``value`` with every float that is not finite written as its name ("nan", "inf"):
    strict JSON parsers reject the bare ``NaN`` that Python writes."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def connect_ray() -> bool:
    """Join the surrounding cluster (RAY_ADDRESS, ray job submit) or start a local one.

    Returns whether this process started Ray and so should stop it.
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS") or os.environ.get("RAY_JOB_ID"):
        # Ray retries an address that does not answer for minutes without a word.
        log.info("joining the Ray cluster at %s (RAY_ADDRESS)", os.environ.get("RAY_ADDRESS", "of this job"))
        ray.init(log_to_driver=True)
        return False
    start_local_ray()
    return True


def start_local_ray(**options) -> None:
    """A local Ray instance on loopback only; gloo follows the same interface. Ray 2.60 turns
    token authentication on for it and says so on every run: that notice is dropped
    (docs/operations.md says it). Ray's usage statistics are off."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    ray.init(
        address="local",  # a new instance, even when another one runs on this machine
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}},
        **{"log_to_driver": True, **options},
    )


class ElasticTrainer:
    """Train a run. ``on_step`` callables get each committed step's ``StepResult`` (step,
    loss, lr, grad_norm, tokens_per_s, each rank's times, ...; ``summary.json`` keeps its
    ``to_json()`` under ``steps``) as it is committed; ``on_event`` callables get every event
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
        self.hooks = resolve_hooks(self.config, model_fn=model_fn, parallelize_fn=parallelize_fn, loss_fn=loss_fn,
                                   dataset=dataset, eval_dataset=eval_dataset, optimizer_fn=optimizer_fn,
                                   tp_plan=tp_plan, split_fn=split_fn, batch_loss_fn=batch_loss_fn,
                                   collate_fn=collate_fn)
        self.progress = progress
        self.keep_final_state = keep_final_state
        scaling = self.config.scaling
        self.faults = resolve_random_targets(
            parse_faults(self.config.fault_tolerance.inject), self.config.seed, scaling.max_groups, scaling.ranks_per_group
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
        self.run_name = self.config.run_name or default_run_name()
        self.run_dir = join_url(self.config.storage, self.run_name)
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
        restore_ray_messages = lambda: None  # noqa: E731
        try:
            signals.catch(caught_before=signalled_before)
            if stop.is_set():
                raise StoppedBeforeStart()
            # Renewed from here: starting Ray took up to a minute on a busy machine, longer than
            # a short lease_ttl_s, which then expired before the first renewal.
            lease.keep_renewed(renewing, on_lost=lambda why: self._lease_lost(why, events, stop))
            started_ray = connect_ray()
            signals.catch()  # again: ray.init puts a SIGTERM handler of its own in place
            restore_ray_messages = worker_deaths_to_log_file()
            cluster = ray.cluster_resources()
            self.config = on_cluster(self.config, cluster)
            check_capacity(self.config, cluster)
            for warning in (groups_beyond_capacity(self.config, cluster), spares_beyond_capacity(self.config, cluster)):
                if warning is not None:
                    log.warning("%s", warning)
            if self.config.metrics.port or self.config.metrics.host != "127.0.0.1":
                port = metrics.serve(self.config.metrics.host, self.config.metrics.port)
                events.emit(EventKind.METRICS_SERVING, address=f"{self.config.metrics.host}:{port}")
            events.listeners += [metrics.on_event, *self.on_event]
            scaling = self.config.scaling
            topology = Topology(scaling.shard, scaling.tp, scaling.max_groups, scaling.pp, scaling.ep)
            injects = bool(self.faults) or self.config.stragglers.noise > 0
            # A Ray this driver started is this machine's alone: its ranks reach the store on
            # loopback (Ray's own node address is the routable one even then).
            rendezvous = Rendezvous.start("127.0.0.1" if started_ray else None)
            fleet = Fleet(self.config, self.hooks, topology, rendezvous)
            checkpoints = self._checkpoints(fleet, events, ledger, topology, clock, lease)
            resume = checkpoints.latest()
            if resume is not None:
                check_resumable(self.config, self.run_name, resume)
                resume = resume_over_data(self.config, self.run_name, resume, self.data_identity, events)
                self.source_identity = check_same_source(self.run_name, resume, self.source_identity)
                checkpoints.source_identity = self.source_identity
                fleet.resume_from_checkpoint()
            elif self.config.model.init_from and not self.weights_checked:  # its checkpoints were all set aside
                check_pretrained_weights(self.config)
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
                final_state = controller.final_state()
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
            exit_reason = Exit(Ending.PREEMPTED, f"a second {second} stopped the run at once, before the step boundary; "
                               + ("run it again to resume from its newest committed checkpoint, if it has one"
                                  if committed is None else f"it resumes from its checkpoint of step {committed}"))
        finally:
            signals.finishing = True
            renewing.set()
            try:
                events.emit(EventKind.RUN_FINISHED, exit=str(exit_reason))
                summary = with_history(self._summary(controller, events, ledger, exit_reason), earlier)
                metrics.time_spent(summary["goodput"], summary["time_breakdown"])
                if lease.lost:  # the summary is the new holder's to write now
                    log.error("the run's summary is not written: %s", lease.lost)
                else:
                    summary_path = self._save_summary(summary)
            finally:
                if fleet is not None:
                    fleet.shutdown()
                if started_ray:
                    ray.shutdown()
                restore_ray_messages()
                self._release(lease)
                signals.release()
        return RunResult(self.run_name, self.run_dir, summary_path, summary, final_state)

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

    def _summary(self, controller: Controller | None, events: EventLog, ledger: TimeLedger, exit_reason: Exit) -> dict:
        scaling = self.config.scaling
        wall = ledger.wall()
        tokens = controller.history.tokens_committed if controller else 0
        losses = controller.history.losses if controller else []
        evals = controller.history.eval_results if controller else []
        steps = controller.history.step_results if controller else []
        groups = len(controller.membership.live_groups()) if controller else 0
        resumed = controller.resume.step if controller and controller.resume else None
        last_checkpoint = controller.checkpoints.last_committed_url if controller and controller.checkpoints else None
        summary = {
            "run": self.run_name,
            "config": {**self.config.model_dump(mode="json"), "run_name": self.run_name},  # a generated name too
            "init_from": self.source_identity,  # what the weights started from, file by file
            "topology": {"groups": groups, "pp": scaling.pp, "shard": scaling.shard, "tp": scaling.tp,
                         "ranks": groups * scaling.ranks_per_group},
            "resumed_from_step": resumed,
            "first_step": controller.history.first_step if controller else 0,
            "steps_committed": len(losses),
            "steps_discarded": controller.history.steps_discarded if controller else 0,
            "steps_rolled_back": controller.history.steps_rolled_back if controller else 0,
            "losses": losses,
            "final_loss": losses[-1] if losses else None,
            "final_lr": steps[-1].lr if steps else None,
            "eval": [result.to_json() for result in evals],
            "final_eval_loss": evals[-1].loss if evals else None,
            "last_checkpoint": last_checkpoint,
            "wall_s": wall,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0,
            "goodput": ledger.goodput(),
            "time_breakdown": ledger.breakdown(),
            "steps": [result.to_json() for result in steps],
            "events": events.events,
            "exit": str(exit_reason),
        }
        return json.loads(redact_credentials(json.dumps(strict_json(summary), default=str, allow_nan=False)))

    def _save_summary(self, summary: dict) -> str | None:
        """Write the summary; a failed write fails the run, and never hides why it ended."""
        try:
            return self._write_summary(summary)
        except Exception as error:
            log.error("the run summary could not be written to %s: %s", self.run_dir, describe_error(error))
            summary["exit"] = str(Exit(Ending.FAILED, f"summary not written ({describe_error(error, 300)}); the run "
                                                      f"ended: {summary['exit']}"))
            return None

    def _write_summary(self, summary: dict) -> str:
        fs, path = self.config.checkpoint.storage_options().filesystem(self.run_dir)
        write_summary(fs, path, summary)
        return join_url(self.run_dir, SUMMARY_NAME)


class StoppedBeforeStart(Exception):
    """A stop signal came before Ray started: the run ends preempted, with nothing to save."""


class SecondSignal(BaseException):
    """A second SIGTERM or Ctrl-C while the run stops: it stops at once, not at the step
    boundary. A BaseException, so that no handler of errors between here and ``fit`` takes it
    for a fault of the run's own."""


def second_signal_behind(error: BaseException) -> SecondSignal | None:
    """The second signal ``error`` is, or came from: raised in a call into Ray's C++ core (a
    wait), it comes out as that call's SystemError, caused by it."""
    while error is not None and not isinstance(error, SecondSignal):
        error = error.__cause__ or error.__context__
    return error


class StopOnSignals:
    """SIGTERM (preemption, ``ray job stop``, pod eviction) and Ctrl-C ask the controller to
    stop at the next step boundary with a checkpoint, instead of killing the driver mid-step;
    a second one stops the run at once (``SecondSignal``). Once the run is ``finishing`` (its
    summary written, its actors stopped) a signal changes nothing: the run has its ending."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, stop: threading.Event, events: EventLog):
        self.stop, self.events, self.previous = stop, events, {}
        self.finishing = False

    def _handle(self, signum, _frame) -> None:
        if self.finishing:
            return
        if self.stop.is_set():
            raise SecondSignal(signal.Signals(signum).name)  # the user insists
        self.stop.set()
        self.events.emit(EventKind.STOP_REQUESTED, signal=signal.Signals(signum).name)

    def catch(self, caught_before: Callable[[], str | None] = lambda: None) -> None:
        """Take the signals over. ``caught_before``: the signal a caller caught until now, if
        any, read once these handlers are in place (so none falls between), as if it came now."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                previous = signal.signal(sig, self._handle)
                self.previous.setdefault(sig, previous)
        name = caught_before()
        if name is not None and not self.stop.is_set():
            self.stop.set()
            self.events.emit(EventKind.STOP_REQUESTED, signal=name)

    def release(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


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
        else:  # a quorum that grows is no warning
            log.log(logging.INFO if event["kind"] == EventKind.GROUP_JOINED else logging.WARNING, "%s",
                    redact_credentials(line))

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

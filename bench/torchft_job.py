"""The reference job trained by torchft 0.2.0 (``pip install torchft==0.2.0``, the ``bench``
extra), for the benches' system (D): a supervisor that starts torchft's lighthouse and the
replica groups, kills ranks as a kill plan says and restarts a killed rank's whole group, as
torchrun ``--max-restarts`` or torchx would; and the worker those processes run (``python
bench/torchft_job.py --worker SPEC``).

The layout is the config's: ``scaling.max_groups`` replica groups of ``scaling.shard``
processes (``goodput.py``: two groups of two; ``recovery.py``: one group of one process per
rank, FSDP2 over a one-rank mesh, so both take the same code). The kill plans:
``KillEvery`` (``goodput.py``: a seeded random rank every so many seconds from the first step,
SIGKILLed by the supervisor) and ``KillAtStep`` (``recovery.py``: a given rank exits by itself
at the start of a given step or some seconds into it, once, as elastic's and Ray Train's
injected kills do).

The job is the other systems' job: the reference model paced by ``elastic/testing/paced.py`` (unpaced at
a step time of 0), seeded alike, the data plan of ``bench/ray_train_job.train_step`` with the
replica groups as the plan's groups and each group's share split over its shard ranks, the
same loss, AdamW and global batch. The parallelism is torchft 0.2.0's HSDP pattern (its
``fsdp_test.py``, TorchTitan's ``docs/torchft.md``): FSDP2 inside a replica group
(``workers.parallelize.fully_shard_model``, elastic's own sharding, on the group's own gloo
process group and TCPStore), and each parameter's gradient shard averaged across the groups
by ``Manager.allreduce`` after backward, then ``torchft.Optimizer``, which steps only when
``Manager.should_commit()``. torchft's own ``DistributedDataParallel`` is not used: on CPU
its comm hook fails the survivor with an ``AssertionError`` (``torchft/ddp.py`` line 76) when
the peer dies inside the all-reduce.

torchft's semantics, not elastic's: each group trains its own share of the global batch, and
the gradients are averaged over the groups in the quorum, so a step that some groups commit
without the others is trained on their shares only (the others' are not trained). Each rank's
loss is its samples' mean token loss over its group's tokens, summed in the group (gradient
divide factor 1, as elastic), averaged over the quorum by torchft: the global mean when every
group is in.

Settings, torchft's defaults unless said, so a torchft user would set it up alike:

- lighthouse: ``--min_replicas 1`` (any group may train on alone; a dead group still
  counts as healthy until its heartbeat times out, and a quorum needs more than half of the
  healthy groups, so the survivor waits that long), ``--heartbeat_timeout_ms`` 5000 (the
  default; ``goodput.py --torchft-heartbeat-ms`` tries others), ``--quorum_tick_ms`` 100 and
  ``--join_timeout_ms`` (60000) left at their defaults.
- Manager: ``min_replica_size=1`` (commit with one group), ``timeout`` 30 s and
  ``ProcessGroupGloo(timeout=5 s)`` as torchft's ``train_ddp.py`` example sets them on CPU,
  ``quorum_timeout`` and ``connect_timeout`` at their 60 s defaults, async quorum (synchronous
  under DiLoCo, which torchft's ``DiLoCo`` requires) and the HTTP checkpoint transport for
  healing as by default. ``init_sync=False``, as torchft's
  docstring advises when every replica seeds its model alike (they do): with the default,
  step 0 heals one rank position of each group but one from another, and those groups'
  shares of step 0's batch are lost.
- Healing sends each rank's shards as plain tensors (``ShardState``), not the modules'
  ``state_dict()``: FSDP2's state-dict hooks swap the root's parameters, and torchft reads
  the state on its quorum thread while the forward runs.
- A start barrier (outside torchft) so every group joins the first quorum, as the other
  systems start with every rank; a restarted group does not wait for it.
- ``OMP_NUM_THREADS=1`` and ``GLOO_SOCKET_IFNAME=lo``, as elastic's and Ray Train's ranks run.
- The supervisor restarts a group at once when any of its processes dies, with a fresh
  TCPStore port; the job ends when a group has committed every step (a group still
  restarting then is stopped: it would have nothing to heal from).

Everything runs on 127.0.0.1: the lighthouse binds it, the groups' TCPStores and gloo use the
loopback. torchft hard-codes two servers to bind every interface (the Manager's RPC server on
``[::]`` and the HTTP checkpoint server); the checkpoint address it advertises is the
machine's hostname, which resolves to 127.0.0.1 here, so the traffic stays on the loopback.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.setup.config import TrainConfig  # noqa: E402
from elastic.testing.loopback import free_port  # noqa: E402

HOST = "127.0.0.1"
POLL_S = 0.02
# A run whose logs stop growing this long is stuck, not slow: fail it rather than hang.
STALL_S = 180.0
# After a group finished, how long the others get to finish the same last step by themselves.
FINISH_GRACE_S = 10.0
# A KillAtStep's note of when its rank died, written by that rank.
KILL_NOTE = "kill.json"


@dataclass(frozen=True)
class TorchftSettings:
    heartbeat_ms: int = 5000
    pg_timeout_s: float = 5.0
    manager_timeout_s: float = 30.0


@dataclass(frozen=True)
class Layout:
    """``groups`` replica groups of ``shard`` processes each; a rank is ``group * shard + position``."""

    groups: int
    shard: int

    @classmethod
    def of(cls, config: TrainConfig) -> Layout:
        return cls(config.scaling.max_groups, config.scaling.shard)

    @property
    def world(self) -> int:
        return self.groups * self.shard

    def group_of(self, rank: int) -> int:
        return rank // self.shard

    def rank(self, group: int, position: int) -> int:
        return group * self.shard + position


@dataclass(frozen=True)
class KillEvery:
    """``count`` kills of a random rank (drawn with ``seed``), one every ``interval`` s from the
    first step; the supervisor SIGKILLs the rank."""

    interval: float
    count: int
    seed: int


@dataclass(frozen=True)
class KillAtStep:
    """Rank ``rank`` exits (``os._exit(1)``) ``after_s`` s into step ``step`` (0: at its start,
    before it joins the step's quorum), once in the run; the rank acts on it itself."""

    rank: int
    step: int
    after_s: float = 0.0

    @property
    def count(self) -> int:
        return 1


KillPlan = KillEvery | KillAtStep
NO_KILLS = KillEvery(interval=math.inf, count=0, seed=0)


@dataclass(frozen=True)
class WorkerSpec:
    """What one process of a replica group needs; travels as JSON on its command line."""

    config_path: str
    run_dir: str
    layout: Layout
    group: int
    rank: int  # in its group
    store_port: int
    lighthouse: str
    step_s: float
    wait_for_world: bool
    settings: TorchftSettings
    kill: KillAtStep | None  # the plan's kill of this process, if it has one

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        fields = json.loads(text)
        return cls(**fields | {"layout": Layout(**fields["layout"]), "settings": TorchftSettings(**fields["settings"]),
                               "kill": fields["kill"] and KillAtStep(**fields["kill"])})


@dataclass(frozen=True)
class Attempt:
    """A step a replica group ran, as its rank 0 logs it: committed, or not (a peer failed in
    it, so it runs again); ``participants``: the groups whose shares of the batch it trained."""

    group: int
    step: int
    t: float
    step_s: float
    loss: float
    participants: int
    committed: bool


@dataclass(frozen=True)
class Kill:
    """A kill that fired: when, the rank, and the rank's group."""

    t: float
    rank: int
    group: int


@dataclass
class TorchftRun:
    """A finished run: its first step's start, every group's step attempts, the kills."""

    started: float
    attempts: list[Attempt]
    kills: list[Kill]
    restarts: int
    groups: int

    @property
    def commits(self) -> list[Attempt]:
        return [attempt for attempt in self.attempts if attempt.committed]

    def step_commits(self) -> dict[int, Attempt]:
        """One commit per step (every group that committed it logs the same step)."""
        by_step: dict[int, Attempt] = {}
        for commit in sorted(self.commits, key=lambda c: c.t):
            by_step.setdefault(commit.step, commit)
        return by_step

    def losses(self) -> list[float]:
        return [commit.loss for _, commit in sorted(self.step_commits().items())]

    def full_batch_steps(self) -> float:
        """Committed samples over the global batch: a step one group of two trained is half."""
        return sum(commit.participants for commit in self.step_commits().values()) / self.groups

    def healthy_s(self) -> float:
        return statistics.median(c.step_s for c in self.step_commits().values() if c.participants == self.groups)

    def wall_s(self) -> float:
        return max(c.t for c in self.commits) - self.started

    def goodput(self) -> float:
        return self.full_batch_steps() * self.healthy_s() / self.wall_s()

    def next_commit_s(self, kill: Kill) -> float:
        """The kill to the next step any group commits first: not a slower group's log of a
        step another group had committed before the kill (a rank killed at a step's start dies
        just after its own group committed the step before)."""
        return min(c.t for c in self.step_commits().values() if c.t > kill.t) - kill.t

    def group_whole_s(self, kill: Kill) -> float:
        """The kill to the killed group's first commit of a step that trained its share again;
        inf if the others finished the job first."""
        return min((c.t for c in self.commits if c.t > kill.t and c.group == kill.group
                    and c.participants == self.groups), default=math.inf) - kill.t

    def discarded_runs(self) -> int:
        """The most step runs one group threw away uncommitted (a peer failed in them) and ran again."""
        return max(Counter(a.group for a in self.attempts if not a.committed).values(), default=0)

    def rolled_back_steps(self) -> int:
        """Committed steps committed again after a later one: what a rollback lost (healing
        takes the peers' state at their step, so none is expected)."""
        latest, again = -1, set()
        for commit in sorted(self.commits, key=lambda c: c.t):
            if commit.step < latest:
                again.add(commit.step)
            latest = max(latest, commit.step)
        return len(again)


# The worker: one process of a replica group.

class DataCursors:
    """The data cursor at each step, as consecutive global batches leave it."""

    def __init__(self, dataset_len: int, global_batch: int, seed: int):
        from elastic.core.data_plan import DataCursor

        self.dataset_len, self.global_batch, self.seed = dataset_len, global_batch, seed
        self.cursors = [DataCursor()]

    def at(self, step: int):
        from elastic.core.data_plan import take_global_batch

        while len(self.cursors) <= step:
            _, after = take_global_batch(self.cursors[-1], self.dataset_len, self.global_batch, self.seed)
            self.cursors.append(after)
        return self.cursors[step]


def world_barrier(spec: WorkerSpec) -> None:
    """Every first-incarnation process built its Manager: every group joins the first quorum."""
    run_dir = Path(spec.run_dir)
    (run_dir / f"ready-{spec.group}-{spec.rank}").touch()
    while len(list(run_dir.glob("ready-*"))) < spec.layout.world:
        time.sleep(POLL_S)


def create_once(path: Path, text: str) -> bool:
    """Write ``path`` unless a process already has; whether this one did."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    return True


def mark_first_step(run_dir: Path) -> None:
    """The kill schedule's clock starts at the first step any process begins."""
    create_once(run_dir / "first_step", repr(time.time()))


def die_as_planned(kill: KillAtStep, group: int, run_dir: Path) -> None:
    """Exit as ``kill`` says, once in the run: the note, which only the first caller writes,
    keeps a retried step or a restarted rank alive, and tells the supervisor when."""
    note = Kill(time.time() + kill.after_s, kill.rank, group)
    if not create_once(run_dir / KILL_NOTE, json.dumps(asdict(note))):
        return
    if kill.after_s:
        threading.Timer(kill.after_s, os._exit, (1,)).start()
    else:
        os._exit(1)


def group_gradients(model, hooks, config: TrainConfig, spec: WorkerSpec, step: int, cursor):
    """Forward and backward of this rank's part of its group's share of the batch; the group's
    gradient is the sum over its ranks (FSDP2 reduce-scatter), its loss returned as the sum too."""
    import torch
    import torch.distributed as dist

    from elastic.core.data_plan import plan_step
    from workers.train_step import accumulate_gradients, collate

    plan = plan_step(step, cursor, dataset_len=len(hooks.dataset), global_batch=config.global_batch,
                     seed=config.seed, group_weights={g: 1.0 for g in range(spec.layout.groups)})
    share = plan.groups[spec.group]
    batches = [collate(hooks.dataset, micro, torch.device("cpu"))
               for micro in share.micro_batches(spec.rank, spec.layout.shard, config.micro_batch)]
    loss = torch.tensor([accumulate_gradients(model, hooks.loss_fn, batches, share.samples * config.data.seq_len)])
    dist.all_reduce(loss)
    return loss


def average_across_groups(manager, model, loss) -> None:
    """torchft's average over the groups in the quorum, of each gradient shard and the loss;
    a failed peer leaves the manager errored, and the step uncommitted."""
    from workers.gradient_sum import local_gradient

    works = [manager.allreduce(local_gradient(param)) for param in model.parameters()]
    works.append(manager.allreduce(loss))
    for work in works:
        work.wait()


def local(tensor):
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class ShardState:
    """This rank's shards of the model and of its optimizer's state, as plain tensors, for
    torchft's healing. Not the modules' own state_dict(): FSDP2's state-dict hooks swap the
    root module's parameters, and torchft takes the state dict on its quorum thread while the
    forward runs (the forward then fails with "mixed torch.Tensor and DTensor")."""

    def __init__(self, model, optimizer):
        self.named = dict(model.named_parameters())  # FSDP2's sharded parameters, stepped in place
        self.optimizer = optimizer
        self.params = [param for group in optimizer.param_groups for param in group["params"]]

    def state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict()
        optimizer["state"] = {index: {key: local(value) for key, value in state.items()}
                              for index, state in optimizer["state"].items()}
        return {"model": {name: local(param) for name, param in self.named.items()}, "optimizer": optimizer}

    def load_state_dict(self, state: dict) -> None:
        import torch

        with torch.no_grad():
            for name, param in self.named.items():
                local(param).copy_(state["model"][name])
        optimizer = state["optimizer"]
        optimizer["state"] = {index: {key: self.shaped_like(self.params[index], value) for key, value in saved.items()}
                              for index, saved in optimizer["state"].items()}
        self.optimizer.load_state_dict(optimizer)

    @staticmethod
    def shaped_like(param, value):
        """A saved local shard of a per-element state (Adam's moments) as its parameter's DTensor."""
        from torch.distributed.tensor import DTensor

        if not isinstance(param, DTensor) or value.dim() == 0:
            return value
        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


def build_manager(spec: WorkerSpec, state: ShardState, rounds: bool):
    """``rounds``: for torchft's DiLoCo, which needs the quorum synchronous."""
    from torchft import Manager, ProcessGroupGloo

    settings = spec.settings
    return Manager(
        use_async_quorum=not rounds,
        pg=ProcessGroupGloo(timeout=timedelta(seconds=settings.pg_timeout_s)),
        load_state_dict=state.load_state_dict, state_dict=state.state_dict, min_replica_size=1,
        replica_id=f"group_{spec.group}", lighthouse_addr=spec.lighthouse, hostname=HOST,
        store_addr=HOST, store_port=spec.store_port, rank=spec.rank, world_size=spec.layout.shard,
        timeout=timedelta(seconds=settings.manager_timeout_s),
        # Every group builds the same seeded model: torchft's docs say to skip the step-0 sync
        # then (with it, the groups but one heal at step 0, their shares unused).
        init_sync=False,
    )


def attempt_log(run_dir: Path, attempt: Attempt) -> Path:
    """Commits and discarded runs go apart: the stall check watches the commits alone, so a
    group that only fails still counts as stuck."""
    return run_dir / f"{'group' if attempt.committed else 'discarded'}{attempt.group}.jsonl"


def train(spec: WorkerSpec) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchft import Optimizer

    from elastic.setup.hooks import resolve_hooks
    from elastic.testing.paced import paced_model
    from workers.parallelize import fully_shard_model

    config = TrainConfig.model_validate_json(Path(spec.config_path).read_text())
    hooks = resolve_hooks(config)
    # The group's own TCPStore (hosted by its rank 0) serves its gloo group and its Manager.
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{spec.store_port}", rank=spec.rank,
                            world_size=spec.layout.shard, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (spec.layout.shard,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(config.seed)
    model = paced_model(config, spec.step_s)()
    fully_shard_model(model, mesh, list(model.layers.values()))
    inner = hooks.optimizer_fn(model.parameters())
    manager = build_manager(spec, ShardState(model, inner), rounds=config.sync.outer_rounds is not None)
    if spec.wait_for_world:
        world_barrier(spec)
    cursors = DataCursors(len(hooks.dataset), config.global_batch, config.seed)
    if config.sync.outer_rounds is not None:
        train_rounds(spec, config, hooks, model, inner, manager, cursors)
    else:
        train_steps(spec, config, hooks, model, Optimizer(manager, inner), manager, cursors)
    manager.shutdown(wait=False)
    dist.destroy_process_group()


def train_steps(spec: WorkerSpec, config: TrainConfig, hooks, model, optimizer, manager, cursors: DataCursors) -> None:
    """Every step's gradients averaged across the groups (``sync.mode = "every-step"``)."""
    run_dir = Path(spec.run_dir)
    while manager.current_step() < config.steps:
        mark_first_step(run_dir)
        began = time.time()
        if spec.kill and manager.current_step() == spec.kill.step:
            die_as_planned(spec.kill, spec.group, run_dir)
        optimizer.zero_grad()  # starts the quorum, which runs during the forward
        planned = manager.current_step()
        loss = group_gradients(model, hooks, config, spec, planned, cursors.at(planned))
        average_across_groups(manager, model, loss)
        # Read after the quorum: a healing group jumps to its peers' step here (its own
        # gradients were zeroed by torchft, so the batch it planned from the old step is moot).
        step, participants = manager.current_step(), manager.num_participants()
        optimizer.step()
        if spec.rank == 0:
            attempt = Attempt(spec.group, step, time.time(), time.time() - began, loss.item(), participants,
                              committed=manager.current_step() == step + 1)
            log_attempt(run_dir, attempt)


def train_rounds(spec: WorkerSpec, config: TrainConfig, hooks, model, inner, manager, cursors: DataCursors) -> None:
    """torchft's DiLoCo (``torchft.local_sgd.DiLoCo``, one fragment: the whole model) with the
    config's outer optimizer: each group steps alone for ``sync.outer_every`` inner steps, each
    on its share of that step's global batch, then the quorum, the pseudo-gradients averaged
    over it, and the outer step, which commits the round (torchft's step counts rounds). A
    round that fails to commit puts the weights back to its start, and the group trains it
    again; a restarted group heals at its first round's end and that round's work is not
    counted. An attempt is a round: its loss is the group's mean over its inner steps."""
    import torch
    from torchft.local_sgd import DiLoCo

    run_dir = Path(spec.run_dir)
    rounds = config.sync.outer_rounds
    outer = torch.optim.SGD(model.parameters(), lr=rounds.lr, momentum=rounds.momentum, nesterov=True)
    with DiLoCo(manager, [model], inner, outer, sync_every=rounds.every, pin_memory=False):
        while manager.current_step() < config.steps // rounds.every:
            mark_first_step(run_dir)
            began, planned, losses = time.time(), manager.current_step(), []
            for inner_step in range(rounds.every):
                step = planned * rounds.every + inner_step
                if spec.kill and step == spec.kill.step:
                    die_as_planned(spec.kill, spec.group, run_dir)
                inner.zero_grad()
                losses.append(group_gradients(model, hooks, config, spec, step, cursors.at(step)).item())
                inner.step()  # the round's last runs the outer step
            if spec.rank == 0:
                log_attempt(run_dir, Attempt(spec.group, planned, time.time(), time.time() - began,
                                             statistics.fmean(losses), manager.num_participants(),
                                             committed=manager.current_step() == planned + 1))


def log_attempt(run_dir: Path, attempt: Attempt) -> None:
    with attempt_log(run_dir, attempt).open("a") as handle:
        handle.write(json.dumps(asdict(attempt)) + "\n")


# The supervisor.

def die_with_parent() -> None:
    """Linux's parent-death signal: a supervisor killed outright leaves no process behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def read_attempts(run_dir: Path) -> list[Attempt]:
    return [Attempt(**json.loads(line)) for path in sorted(run_dir.glob("*.jsonl"))
            for line in path.read_text().splitlines()]


def log_tail(path: Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass
class Supervisor:
    """The lighthouse and the groups' processes; ``restart`` replaces a group whole."""

    config_path: Path
    run_dir: Path
    step_s: float
    settings: TorchftSettings
    layout: Layout
    plan: KillPlan
    lighthouse: subprocess.Popen | None = None
    lighthouse_port: int = 0
    groups: dict[int, list[subprocess.Popen]] = field(default_factory=dict)
    logs: dict[int, list[Path]] = field(default_factory=dict)
    restarted_at: dict[int, float] = field(default_factory=dict)
    incarnations: int = 0

    def start(self) -> None:
        self.lighthouse_port = free_port()
        command = [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1",
                   "--bind", f"{HOST}:{self.lighthouse_port}",
                   "--heartbeat_timeout_ms", str(self.settings.heartbeat_ms)]
        with (self.run_dir / "lighthouse.log").open("w") as out:
            self.lighthouse = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                               preexec_fn=die_with_parent)
        for group in range(self.layout.groups):
            self.start_group(group, wait_for_world=True)

    def start_group(self, group: int, wait_for_world: bool) -> None:
        store_port = free_port()
        self.incarnations += 1
        self.groups[group], self.logs[group] = [], []
        for rank in range(self.layout.shard):
            spec = WorkerSpec(str(self.config_path), str(self.run_dir), self.layout, group, rank, store_port,
                              f"http://{HOST}:{self.lighthouse_port}", self.step_s, wait_for_world,
                              self.settings, self.kill_of(self.layout.rank(group, rank)))
            log = self.run_dir / f"group{group}-rank{rank}-{self.incarnations}.log"
            env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
            with log.open("w") as out:
                self.groups[group].append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", spec.to_json()], env=env,
                    stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent))
            self.logs[group].append(log)

    def kill_of(self, rank: int) -> KillAtStep | None:
        """The plan's kill that ``rank`` carries out itself, if any."""
        return self.plan if isinstance(self.plan, KillAtStep) and self.plan.rank == rank else None

    def stop_group(self, group: int) -> None:
        for process in self.groups[group]:
            stop(process)

    def restart(self, group: int) -> None:
        self.stop_group(group)
        self.restarted_at[group] = time.time()
        self.start_group(group, wait_for_world=False)

    def restarting_groups(self) -> list[int]:
        """The restarted groups that have committed nothing since (still starting or healing)."""
        committed = {a.group for a in read_attempts(self.run_dir)
                     if a.committed and a.t > self.restarted_at.get(a.group, math.inf)}
        return [group for group in self.restarted_at if group not in committed]

    def kill_rank(self, rank: int) -> None:
        self.groups[self.layout.group_of(rank)][rank % self.layout.shard].send_signal(signal.SIGKILL)

    def failed_groups(self) -> list[int]:
        return [group for group, processes in self.groups.items()
                if any(process.poll() not in (None, 0) for process in processes)]

    def finished(self) -> bool:
        return any(all(process.poll() == 0 for process in processes) for processes in self.groups.values())

    def close(self) -> None:
        for processes in self.groups.values():
            for process in processes:
                stop(process)
        if self.lighthouse:
            stop(self.lighthouse)


class Schedule:
    """The supervisor's side of a kill plan: it fires a ``KillEvery``'s kills itself, and reads
    the note a ``KillAtStep``'s rank leaves."""

    def __init__(self, plan: KillPlan, layout: Layout, run_dir: Path):
        self.plan, self.layout, self.run_dir = plan, layout, run_dir
        self.random = random.Random(plan.seed) if isinstance(plan, KillEvery) else None
        self.fired: list[Kill] = []

    def due(self, started: float | None) -> int | None:
        """The rank to kill now, if a timed kill is due."""
        plan = self.plan
        if not isinstance(plan, KillEvery) or started is None or len(self.fired) == plan.count:
            return None
        if time.time() - started < plan.interval * (len(self.fired) + 1):
            return None
        rank = self.random.randrange(self.layout.world)
        self.fired.append(Kill(time.time(), rank, self.layout.group_of(rank)))
        return rank

    def kills(self) -> list[Kill]:
        note = self.run_dir / KILL_NOTE
        return self.fired + ([Kill(**json.loads(note.read_text()))] if note.exists() else [])


def first_step_time(run_dir: Path) -> float | None:
    path = run_dir / "first_step"
    text = path.read_text() if path.exists() else ""
    return float(text) if text else None


class Progress:
    """Fails a run whose commit logs stopped growing for ``STALL_S``."""

    def __init__(self, run_dir: Path):
        self.run_dir, self.size, self.changed = run_dir, -1, time.time()

    def check(self, supervisor: Supervisor) -> None:
        size = sum(path.stat().st_size for path in self.run_dir.glob("group*.jsonl"))
        if size != self.size:
            self.size, self.changed = size, time.time()
        elif time.time() - self.changed > STALL_S:
            tails = "\n".join(log_tail(log) for logs in supervisor.logs.values() for log in logs)
            raise RuntimeError(f"torchft run made no progress for {STALL_S:g} s; the workers' logs end:\n{tails}")


def supervise(supervisor: Supervisor, schedule: Schedule, max_restarts: int) -> int:
    """Kill on the schedule and restart failed groups until a group finished; the restarts."""
    restarts, progress = 0, Progress(supervisor.run_dir)
    while not supervisor.finished():
        rank = schedule.due(first_step_time(supervisor.run_dir))
        if rank is not None:
            supervisor.kill_rank(rank)
        for group in supervisor.failed_groups():
            restarts += 1
            if restarts > max_restarts:
                raise RuntimeError(f"group {group} failed beyond the schedule's kills:\n"
                                   + "\n".join(log_tail(log) for log in supervisor.logs[group]))
            supervisor.restart(group)
        progress.check(supervisor)
        time.sleep(POLL_S)
    return restarts


def wait_for_others(supervisor: Supervisor) -> None:
    """The other groups, if in the same last step, commit it too. A restarted group that has
    not committed yet is stopped at once: with no peer left to heal from, it would train the
    job again from step 0 alone."""
    for group in supervisor.restarting_groups():
        supervisor.stop_group(group)
    deadline = time.time() + FINISH_GRACE_S
    processes = [process for group in supervisor.groups.values() for process in group]
    while time.time() < deadline and any(process.poll() is None for process in processes):
        time.sleep(POLL_S)


@contextmanager
def supervisor_for(config_path: Path, run_dir: Path, step_s: float, settings: TorchftSettings, layout: Layout,
                   plan: KillPlan) -> Iterator[Supervisor]:
    supervisor = Supervisor(config_path, run_dir, step_s, settings, layout, plan)
    try:
        supervisor.start()
        yield supervisor
    finally:
        supervisor.close()


def train_under(config: TrainConfig, run_dir: Path, step_s: float, plan: KillPlan,
                settings: TorchftSettings = TorchftSettings()) -> TorchftRun:
    """Train ``config`` with torchft in its layout, at steps of about ``step_s`` (0: unpaced),
    killed as ``plan`` says."""
    layout = Layout.of(config)
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.json"
    config_path.write_text(config.model_dump_json())
    schedule = Schedule(plan, layout, run_dir)
    with supervisor_for(config_path, run_dir, step_s, settings, layout, plan) as supervisor:
        restarts = supervise(supervisor, schedule, max_restarts=plan.count)
        wait_for_others(supervisor)
    finished = TorchftRun(first_step_time(run_dir), read_attempts(run_dir), schedule.kills(), restarts, layout.groups)
    steps = {commit.step for commit in finished.commits}
    # under DiLoCo an attempt is a round
    units = config.steps if config.sync.outer_rounds is None else config.steps // config.sync.outer_rounds.every
    assert steps == set(range(units)), f"steps missing: {sorted(set(range(units)) - steps)}"
    assert len(finished.kills) == plan.count, f"{len(finished.kills)} of {plan.count} kills fired"
    return finished


@dataclass(frozen=True)
class TorchftResult:
    """A run under a kill plan, and the first step whose loss differs from a clean torchft
    run's (None: none differs)."""

    run: TorchftRun
    first_loss_difference: int | None
    rounds: bool  # DiLoCo's: an attempt, a commit and a loss are a round's

    def losses_against_clean(self) -> str:
        return ("equal the clean torchft run's" if self.first_loss_difference is None
                else f"differ from the clean torchft run's from step {self.first_loss_difference}")


def first_difference(losses: list[float], clean: list[float]) -> int | None:
    return next((step for step, (loss, reference) in enumerate(zip(losses, clean)) if loss != reference), None)


def against_clean(config: TrainConfig, run_dir: Path, step_s: float, plan: KillPlan,
                  settings: TorchftSettings = TorchftSettings()) -> TorchftResult:
    """``train_under`` as ``plan`` says, then without kills and unpaced (the pacing only
    sleeps, so the math is the same, sooner) in ``run_dir``-clean, and where their losses part."""
    killed = train_under(config, run_dir, step_s, plan, settings)
    clean = train_under(config, Path(f"{run_dir}-clean"), 0.0, NO_KILLS, settings)
    return TorchftResult(killed, first_difference(killed.losses(), clean.losses()),
                         rounds=config.sync.outer_rounds is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description="one process of a torchft replica group (started by train_under())")
    parser.add_argument("--worker", required=True, help="the WorkerSpec, as JSON")
    train(WorkerSpec.from_json(parser.parse_args().worker))


if __name__ == "__main__":
    main()

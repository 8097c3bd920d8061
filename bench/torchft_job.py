"""The reference job trained by torchft 0.2.0 (``pip install torchft==0.2.0``, the ``bench``
extra), for ``goodput.py``'s system (D): a supervisor that starts torchft's lighthouse and two
replica groups of two processes each, kills a random rank on the benchmark's schedule and
restarts the killed rank's whole group, as torchrun ``--max-restarts`` or torchx would; and
the worker those processes run (``python bench/torchft_job.py --worker SPEC``).

The job is the other systems' job: the reference model paced by ``tests/paced.py``, seeded
alike, the data plan of ``bench/ray_train_job.train_step`` with the two replica groups as the
plan's groups and each group's share split over its two shard ranks, the same loss, AdamW and
global batch. The layout is torchft 0.2.0's HSDP pattern (its ``fsdp_test.py``, TorchTitan's
``docs/torchft.md``): FSDP2 inside a replica group (``workers.parallelize.fully_shard_model``,
elastic's own sharding, on the group's own gloo process group and TCPStore), and each
parameter's gradient shard averaged across the groups by ``Manager.allreduce`` after backward,
then ``torchft.Optimizer``, which steps only when ``Manager.should_commit()``. torchft's own
``DistributedDataParallel`` is not used: on CPU its comm hook fails the survivor with an
``AssertionError`` (``torchft/ddp.py`` line 76) when the peer dies inside the all-reduce.

torchft's semantics, not elastic's: each group trains its own half of the global batch, and the
gradients are averaged over the groups in the quorum, so a step that one group commits alone
is trained on that group's half only (the other half is not trained). Each rank's loss is its
samples' mean token loss over its group's tokens, summed in the group (gradient divide factor
1, as elastic), averaged over the quorum by torchft: the global mean when both groups are in.

Settings, torchft's defaults unless said, so a torchft user would set it up alike:

- lighthouse: ``--min_replicas 1`` (either group may train on alone; a dead group still
  counts as healthy until its heartbeat times out, and a quorum needs more than half of the
  healthy groups, so the survivor waits that long), ``--heartbeat_timeout_ms`` 5000 (the
  default; ``goodput.py --torchft-heartbeat-ms`` tries others), ``--quorum_tick_ms`` 100 and
  ``--join_timeout_ms`` (60000) left at their defaults.
- Manager: ``min_replica_size=1`` (commit with one group), ``timeout`` 30 s and
  ``ProcessGroupGloo(timeout=5 s)`` as torchft's ``train_ddp.py`` example sets them on CPU,
  ``quorum_timeout`` and ``connect_timeout`` at their 60 s defaults, async quorum and the
  HTTP checkpoint transport for healing as by default. ``init_sync=False``, as torchft's
  docstring advises when every replica seeds its model alike (they do): with the default,
  step 0 heals one rank position of each group from the other, and that half of step 0's
  batch is lost.
- Healing sends each rank's shards as plain tensors (``ShardState``), not the modules'
  ``state_dict()``: FSDP2's state-dict hooks swap the root's parameters, and torchft reads
  the state on its quorum thread while the forward runs.
- A start barrier (outside torchft) so both groups join the first quorum, as the other
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
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elastic.setup.config import TrainConfig  # noqa: E402

GROUPS, SHARD = 2, 2
HOST = "127.0.0.1"
POLL_S = 0.02
# A run whose logs stop growing this long is stuck, not slow: fail it rather than hang.
STALL_S = 180.0
# After a group finished, how long the others get to finish the same last step by themselves.
FINISH_GRACE_S = 10.0


@dataclass(frozen=True)
class TorchftSettings:
    heartbeat_ms: int = 5000
    pg_timeout_s: float = 5.0
    manager_timeout_s: float = 30.0


@dataclass(frozen=True)
class WorkerSpec:
    """What one process of a replica group needs; travels as JSON on its command line."""

    config_path: str
    run_dir: str
    group: int
    rank: int
    store_port: int
    lighthouse: str
    step_s: float
    wait_for_world: bool
    settings: dict


@dataclass(frozen=True)
class Commit:
    """A step a replica group committed, as its rank 0 logs it; ``participants``: the groups
    whose halves of the batch the step trained."""

    group: int
    step: int
    t: float
    step_s: float
    loss: float
    participants: int


@dataclass(frozen=True)
class Kill:
    t: float
    rank: int

    @property
    def group(self) -> int:
        return self.rank // SHARD


@dataclass
class TorchftRun:
    """A finished run: its first step's start, every group's commits, the kills."""

    started: float
    commits: list[Commit]
    kills: list[Kill]
    restarts: int

    def step_commits(self) -> dict[int, Commit]:
        """One commit per step (every group that committed it logs the same step)."""
        by_step: dict[int, Commit] = {}
        for commit in sorted(self.commits, key=lambda c: c.t):
            by_step.setdefault(commit.step, commit)
        return by_step

    def losses(self) -> list[float]:
        return [commit.loss for _, commit in sorted(self.step_commits().items())]

    def full_batch_steps(self) -> float:
        """Committed samples over the global batch: a step one group of two trained is half."""
        return sum(commit.participants for commit in self.step_commits().values()) / GROUPS

    def healthy_s(self) -> float:
        return statistics.median(c.step_s for c in self.step_commits().values() if c.participants == GROUPS)

    def wall_s(self) -> float:
        return max(c.t for c in self.commits) - self.started

    def goodput(self) -> float:
        return self.full_batch_steps() * self.healthy_s() / self.wall_s()

    def next_commit_s(self, kill: Kill) -> float:
        """The kill to the next step any group commits."""
        return min(c.t for c in self.commits if c.t > kill.t) - kill.t

    def group_whole_s(self, kill: Kill) -> float:
        """The kill to the killed group's first commit of a step that trained its half again."""
        return min(c.t for c in self.commits if c.t > kill.t and c.group == kill.group
                   and c.participants == GROUPS) - kill.t


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


def world_barrier(run_dir: Path, group: int, rank: int) -> None:
    """Every first-incarnation process built its Manager: both groups join the first quorum."""
    (run_dir / f"ready-{group}-{rank}").touch()
    while len(list(run_dir.glob("ready-*"))) < GROUPS * SHARD:
        time.sleep(POLL_S)


def mark_first_step(run_dir: Path) -> None:
    """The kill schedule's clock starts at the first step any process begins."""
    try:
        descriptor = os.open(run_dir / "first_step", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    with os.fdopen(descriptor, "w") as handle:
        handle.write(repr(time.time()))


def group_gradients(model, hooks, config: TrainConfig, group: int, rank: int, step: int, cursor):
    """Forward and backward of this rank's part of its group's half of the batch; the group's
    gradient is the sum over its ranks (FSDP2 reduce-scatter), its loss returned as the sum too."""
    import torch
    import torch.distributed as dist

    from elastic.core.data_plan import plan_step
    from workers.train_step import accumulate_gradients, collate

    plan = plan_step(step, cursor, dataset_len=len(hooks.dataset), global_batch=config.global_batch,
                     seed=config.seed, group_weights={g: 1.0 for g in range(GROUPS)})
    share = plan.groups[group]
    batches = [collate(hooks.dataset, micro, torch.device("cpu"))
               for micro in share.micro_batches(rank, SHARD, config.micro_batch)]
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


def build_manager(spec: WorkerSpec, state: ShardState):
    from torchft import Manager, ProcessGroupGloo

    settings = TorchftSettings(**spec.settings)
    return Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=settings.pg_timeout_s)),
        load_state_dict=state.load_state_dict, state_dict=state.state_dict, min_replica_size=1,
        replica_id=f"group_{spec.group}", lighthouse_addr=spec.lighthouse, hostname=HOST,
        store_addr=HOST, store_port=spec.store_port, rank=spec.rank, world_size=SHARD,
        timeout=timedelta(seconds=settings.manager_timeout_s),
        # Every group builds the same seeded model: torchft's docs say to skip the step-0 sync
        # then (with it, each rank position of one group heals at step 0, its half unused).
        init_sync=False,
    )


def train(spec: WorkerSpec) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchft import Optimizer

    from elastic.setup.hooks import resolve_hooks
    from tests.paced import paced_model
    from workers.parallelize import fully_shard_model

    config = TrainConfig.model_validate_json(Path(spec.config_path).read_text())
    run_dir = Path(spec.run_dir)
    hooks = resolve_hooks(config)
    # The group's own TCPStore (hosted by its rank 0) serves its gloo group and its Manager.
    dist.init_process_group("gloo", init_method=f"tcp://{HOST}:{spec.store_port}", rank=spec.rank,
                            world_size=SHARD, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (SHARD,), mesh_dim_names=("dp_shard",))
    torch.manual_seed(config.seed)
    model = paced_model(config, spec.step_s)()
    fully_shard_model(model, mesh, list(model.layers.values()))
    inner = hooks.optimizer_fn(model.parameters())
    manager = build_manager(spec, ShardState(model, inner))
    optimizer = Optimizer(manager, inner)
    if spec.wait_for_world:
        world_barrier(run_dir, spec.group, spec.rank)
    cursors = DataCursors(len(hooks.dataset), config.global_batch, config.seed)
    log = run_dir / f"group{spec.group}.jsonl"
    while manager.current_step() < config.steps:
        mark_first_step(run_dir)
        began = time.time()
        optimizer.zero_grad()  # starts the quorum, which runs during the forward
        planned = manager.current_step()
        loss = group_gradients(model, hooks, config, spec.group, spec.rank, planned, cursors.at(planned))
        average_across_groups(manager, model, loss)
        # Read after the quorum: a healing group jumps to its peers' step here (its own
        # gradients were zeroed by torchft, so the batch it planned from the old step is moot).
        step, participants = manager.current_step(), manager.num_participants()
        optimizer.step()
        if spec.rank == 0 and manager.current_step() == step + 1:
            commit = Commit(spec.group, step, time.time(), time.time() - began, loss.item(), participants)
            with log.open("a") as handle:
                handle.write(json.dumps(asdict(commit)) + "\n")
    manager.shutdown(wait=False)
    dist.destroy_process_group()


# The supervisor.

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def die_with_parent() -> None:
    """Linux's parent-death signal: a supervisor killed outright leaves no process behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait()


def read_commits(run_dir: Path) -> list[Commit]:
    return [Commit(**json.loads(line)) for path in sorted(run_dir.glob("group*.jsonl"))
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
    lighthouse: subprocess.Popen | None = None
    lighthouse_port: int = 0
    groups: dict[int, list[subprocess.Popen]] = field(default_factory=dict)
    logs: dict[int, list[Path]] = field(default_factory=dict)
    incarnations: int = 0

    def start(self) -> None:
        self.lighthouse_port = free_port()
        command = [str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1",
                   "--bind", f"{HOST}:{self.lighthouse_port}",
                   "--heartbeat_timeout_ms", str(self.settings.heartbeat_ms)]
        with (self.run_dir / "lighthouse.log").open("w") as out:
            self.lighthouse = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                               preexec_fn=die_with_parent)
        for group in range(GROUPS):
            self.start_group(group, wait_for_world=True)

    def start_group(self, group: int, wait_for_world: bool) -> None:
        store_port = free_port()
        self.incarnations += 1
        self.groups[group], self.logs[group] = [], []
        for rank in range(SHARD):
            spec = WorkerSpec(str(self.config_path), str(self.run_dir), group, rank, store_port,
                              f"http://{HOST}:{self.lighthouse_port}", self.step_s, wait_for_world,
                              asdict(self.settings))
            log = self.run_dir / f"group{group}-rank{rank}-{self.incarnations}.log"
            env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
            with log.open("w") as out:
                self.groups[group].append(subprocess.Popen(
                    [sys.executable, __file__, "--worker", json.dumps(asdict(spec))], env=env,
                    stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent))
            self.logs[group].append(log)

    def restart(self, group: int) -> None:
        for process in self.groups[group]:
            stop(process)
        self.start_group(group, wait_for_world=False)

    def kill_rank(self, rank: int) -> None:
        self.groups[rank // SHARD][rank % SHARD].send_signal(signal.SIGKILL)

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
    """``kills`` kills of a seeded random rank, one every ``interval`` s from the first step."""

    def __init__(self, interval: float, kills: int, seed: int):
        self.interval, self.kills, self.random = interval, kills, random.Random(seed)
        self.fired: list[Kill] = []

    def due(self, started: float | None) -> int | None:
        """The rank to kill now, if a kill is due."""
        if started is None or len(self.fired) == self.kills:
            return None
        if time.time() - started < self.interval * (len(self.fired) + 1):
            return None
        rank = self.random.randrange(GROUPS * SHARD)
        self.fired.append(Kill(time.time(), rank))
        return rank


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
    """The other group, if in the same last step, commits it too; one still healing is stopped."""
    deadline = time.time() + FINISH_GRACE_S
    processes = [process for group in supervisor.groups.values() for process in group]
    while time.time() < deadline and any(process.poll() is None for process in processes):
        time.sleep(POLL_S)


@contextmanager
def supervisor_for(config_path: Path, run_dir: Path, step_s: float, settings: TorchftSettings) -> Iterator[Supervisor]:
    supervisor = Supervisor(config_path, run_dir, step_s, settings)
    try:
        supervisor.start()
        yield supervisor
    finally:
        supervisor.close()


def run(config: TrainConfig, run_dir: Path, step_s: float, interval: float, kills: int,
        settings: TorchftSettings = TorchftSettings()) -> TorchftRun:
    """Train ``config`` with torchft under ``kills`` kills every ``interval`` s (0: none)."""
    assert (config.scaling.max_groups, config.scaling.shard) == (GROUPS, SHARD), "the layout is 2 groups x shard 2"
    run_dir.mkdir(parents=True)
    config_path = run_dir / "config.json"
    config_path.write_text(config.model_dump_json())
    schedule = Schedule(interval, kills, config.seed)
    with supervisor_for(config_path, run_dir, step_s, settings) as supervisor:
        restarts = supervise(supervisor, schedule, max_restarts=kills)
        wait_for_others(supervisor)
    commits = read_commits(run_dir)
    steps = {commit.step for commit in commits}
    assert steps == set(range(config.steps)), f"steps missing: {sorted(set(range(config.steps)) - steps)}"
    assert len(schedule.fired) == kills, f"{len(schedule.fired)} of {kills} kills fired"
    return TorchftRun(first_step_time(run_dir), commits, schedule.fired, restarts)


def main() -> None:
    parser = argparse.ArgumentParser(description="one process of a torchft replica group (started by run())")
    parser.add_argument("--worker", required=True, help="the WorkerSpec, as JSON")
    spec = WorkerSpec(**json.loads(parser.parse_args().worker))
    train(spec)


if __name__ == "__main__":
    main()

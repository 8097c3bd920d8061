"""A rank's process groups: its replica group's world, and the replicate group across groups.

Each replica group is its own torch.distributed world (the default process group, with the
group's ``(pp, expert_shard, ep, cp, tp)`` mesh on it: ``group_mesh``), rendezvousing on the driver's store under the
prefix of its build number (one per build of any group's world), with two CPU groups beside it: one for the checkpoint upload thread, one
for the step's control traffic (the abort agreement and the vote), so neither interleaves
with the other. Across groups, ranks at the same position sum gradients over a *replicate*
process group built directly on the store, outside the default world, so it can be torn
down and rebuilt when membership changes without touching the group's own world; its prefix
is the build number the driver gives each rebuild (``SegmentSpec.replicas_build``), and every
rank of a segment enters that build's groups as the segment starts, over the segment's groups. A
heal's source and target ranks build a pair group the same way, for the one copy
(``heal_pair``, ``workers.state_transfer``); a catch-up's copy goes over the segment's
replicate group instead, which holds both already (``copy_pair``).

A group whose step failed is rebuilt, and its ranks that still wait on a peer that left the
step (a pipeline stage's receive, a TP or FSDP collective, the vote) are freed by closing the
connections of the group's own process groups from the rank's control thread
(``close_connections``): the wait raises, and so do the peers' waits on this rank.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from elastic.core.topology import Topology
from workers.keyed_store import KeyedStore
from workers.rank_spec import RankSpec


def abort_process_groups_on_gpu(group=None) -> None:
    """Abort NCCL communicators instead of destroying them: a destroy waits for the work in
    flight, which never ends when a peer is gone, and keeps its GPU buffers meanwhile."""
    dist.distributed_c10d._abort_process_group(group)


# A tag no send of the run uses: a receive posted under it is never matched.
UNMATCHED_TAG = 0x7E1EA5E


def close_connections(groups: Iterable) -> None:
    """Close this process's connections in each of ``groups``' gloo backends, from any thread:
    every wait on them, this process's and its peers', raises. Gloo aborts nothing (its
    ``abort`` does nothing, and ``destroy_process_group`` waits for the collectives in
    flight), but a receive whose wait times out closes every pair of its group
    (``UnboundBuffer::waitRecv`` signals the timeout to the whole context). So a receive is
    posted from each peer in turn and waited for 1 ms: one from a peer already gone fails at
    once and closes only its own pair. A group with no gloo backend on the CPU (NCCL alone)
    is left as it is: its waits do not block this thread."""
    for group in groups:
        for peer in range(group.size()):
            if peer != group.rank():
                close_pair(group, peer)


def close_pair(group, peer: int) -> None:
    """Close this process's connection to ``peer`` (a rank of ``group``) as ``close_connections`` does."""
    try:
        group.recv([torch.empty(1)], peer, UNMATCHED_TAG).wait(datetime.timedelta(milliseconds=1))
    except (RuntimeError, ValueError):  # timed out (the pairs are closed), closed already, or no gloo
        pass


class World:
    def __init__(self, rank: RankSpec, store: dist.Store):
        self.rank = rank
        self.store = store
        self.timeout = datetime.timedelta(seconds=rank.collective_timeout_s)
        self.mesh: DeviceMesh | None = None
        self.checkpoint_group = None
        self.control_group = None  # None in a group of one rank: it has no one to agree with
        self.replicate_group = None  # None while the rank's position has no replica in another group
        # The delayed outer steps' channel to the same replicas (``sync.sync_delay``): their
        # exchange crosses while later steps' collectives go over the replicate group
        self.outer_replicate_group = None
        self.slow_link: SlowLink | None = None  # the cross-group link's throttle, where a fault set one
        self.outer_slow_link: SlowLink | None = None  # the outer channel's, alike
        self.replica_rank = 0
        self.replicas_build: int | None = None  # the cross-group groups' build the rank is in
        self._replicas_store = None  # the replicate group's own connection to the store
        # The connection of the last rendezvous that ended, free for the next: opening one
        # costs the store's server an accept and c10d a reverse lookup of the address it
        # logs, and every rank opens it at once, at every regroup. Gloo only: an NCCL group
        # reads its store at its first collective, which a failure can leave blocked.
        self._spare_store = None
        # Gloo process groups given up with work in flight: gloo cannot abort a collective
        # and destroying one would block until it times out, so they are kept until the
        # process ends. NCCL groups are aborted instead. (Gloo also carries CUDA tensors, where
        # several ranks share one GPU: scaling.gpu_collectives.)
        self._abandoned: list = []

    @property
    def joined(self) -> bool:
        return dist.is_initialized()

    def join_group(self, world_build: int) -> DeviceMesh:
        """(Re)join the group's world as its build number ``world_build``, leaving the previous one and the
        replicate group; returns the group's mesh."""
        rank = self.rank
        self.leave_replicas()
        if dist.is_initialized():
            if rank.nccl:
                abort_process_groups_on_gpu()
            else:
                dist.destroy_process_group()
        backend = f"cpu:gloo,cuda:{rank.gpu_collectives}" if rank.use_gpu else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"world{world_build}/group{rank.group}/", self.store),
            rank=rank.group_rank,
            world_size=rank.ranks_per_group,
            timeout=self.timeout,
        )
        device_type = "cuda" if rank.use_gpu else "cpu"
        self.mesh = group_mesh(device_type, rank.layout)
        self.checkpoint_group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.control_group = dist.new_group(backend="gloo", timeout=self.timeout) if rank.ranks_per_group > 1 else None
        return self.mesh

    @property
    def mesh_coordinate(self) -> dict[str, int]:
        """This rank's index on each dimension of the group's mesh, by name (not on those
        flattened from them, ``shard`` and ``shard_cp``: ``workers.train_step.squared_gradient_norm``
        reads a tensor sharded along one as sharded along the dimensions it spans)."""
        return dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate()))

    def close_connections(self) -> None:
        """Close the connections of every process group of the group's world but the
        checkpoint upload's (a save a broken group started is abandoned by the driver, not
        here) and the replicate group (not the world's: the rank's failed step closed it,
        ``fail_replicas``): the ranks waiting in them raise. The world is unusable afterwards;
        the next build replaces it."""
        close_connections(group for group in list(dist.distributed_c10d._world.pg_map)
                          if group is not self.checkpoint_group)

    def fail_replicas(self) -> None:
        """Leave the replicate group as a rank whose step failed: its connections closed first
        (gloo's), so a replica waiting on this rank, or about to send to it, raises at once
        rather than at the driver's abort or the step's deadline (a rank still computing learns
        it from the abort, between micro-batches). NCCL's communicators are aborted instead,
        which tells no peer."""
        if self.replicate_group is not None and not self.rank.nccl:
            close_connections(self._replica_channels)
        self.leave_replicas()

    def leave_replicas(self) -> None:
        self.replicas_build = None
        if self.replicate_group is not None:
            groups = self._replica_channels
            if self.rank.nccl:
                for group in groups:
                    group.abort()
            else:
                self._abandoned.extend((*groups, self._replicas_store))
                self._spare_store = self._replicas_store
        self.replicate_group = self.outer_replicate_group = self._replicas_store = None

    @property
    def cross_group(self):
        """The replicate group as the steps' collectives go over it: through the ``slow_link``
        where a fault throttles it."""
        group = self.replicate_group
        return group if group is None or self.slow_link is None else _OverSlowLink(group, self.slow_link)

    @property
    def _replica_channels(self) -> list:
        """The process groups to this position's replicas: the replicate group, and the delayed
        outer steps' where there is one."""
        return [group for group in (self.replicate_group, self.outer_replicate_group) if group is not None]

    @property
    def outer_cross_group(self):
        """The delayed outer steps' channel, as ``cross_group`` is the replicate group."""
        group = self.outer_replicate_group
        return group if group is None or self.outer_slow_link is None else _OverSlowLink(group, self.outer_slow_link)

    def throttle(self, bytes_per_s: float) -> None:
        """The ``slow-link`` fault: every channel to the other groups at ``bytes_per_s`` (each its own)."""
        self.slow_link, self.outer_slow_link = SlowLink(bytes_per_s), SlowLink(bytes_per_s)

    def joining_replicas(self, build: int, replica_rank: int, replica_size: int) -> Future:
        """Start (re)building the replicate group of this rank's position: ``replica_rank`` of
        the ``replica_size`` groups of the cross-group groups' build number ``build`` (none
        when it is the only one). The rendezvous waits for every replica, so it runs on a
        thread of its own and the rank stays free to give it up (``give_up_replicas``); the
        future holds the group, for ``take_replicas``."""
        self.leave_replicas()
        self.replica_rank = replica_rank
        self.replicas_build = build
        joining: Future = Future()
        if replica_size == 1:
            joining.set_result(None)
            return joining
        position = ".".join(map(str, self.rank.position))
        spare, self._spare_store = self._spare_store, None
        delayed_outer_steps = self.rank.outer_rounds is not None and self.rank.outer_rounds.delay > 0

        def rendezvous() -> None:
            try:
                # A connection of its own: a rendezvous given up still blocks its connection
                # in a wait until the timeout, which would hold up every other use of a shared
                # one (and it is not passed on: only a group it formed gives it back).
                connection = spare or connect_store(self.rank)
                channels = ["replicate", "outer"] if delayed_outer_steps else ["replicate"]
                groups = [self._process_group(dist.PrefixStore(f"replicas{build}/{channel}{position}/", connection),
                                              replica_rank, replica_size) for channel in channels]
                # torch holds only the store's C++ half: keep it
                joining.set_result((groups[0], connection, groups[1] if delayed_outer_steps else None))
            except BaseException as error:  # noqa: BLE001 - the waiting rank raises it
                joining.set_exception(error)

        threading.Thread(target=rendezvous, name=f"replicas{build}", daemon=True).start()
        return joining

    def _process_group(self, store: dist.Store, replica_rank: int, replica_size: int):
        if self.rank.nccl:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout  # the default is 10 minutes
            return dist.ProcessGroupNCCL(store, replica_rank, replica_size, options)
        return dist.ProcessGroupGloo(store, replica_rank, replica_size, self.timeout)

    def take_replicas(self, joined: tuple | None) -> None:
        """The replicate group a rendezvous formed (None: the position has no replica), with its
        store and the delayed outer steps' channel."""
        self.replicate_group, self._replicas_store, self.outer_replicate_group = joined or (None, None, None)

    def give_up_replicas(self, joining: Future) -> None:
        """The rank stopped waiting for ``joining``: a group it still forms is given up as one
        with work in flight is."""
        self.replicas_build = None

        def abandon(done: Future) -> None:
            if done.exception() is None and done.result() is not None:
                self._abandoned.extend(held for held in done.result() if held is not None)

        joining.add_done_callback(abandon)

    def heal_pair(self, copy: str, source: int, target: int) -> dist.ProcessGroupGloo:
        return heal_pair(self.store, copy, source, target, self.rank.global_rank == target, self.timeout)

    def copy_pair(self, copy: str, source: int, target: int, groups: tuple[int, ...]):
        """The pair the copy named ``copy`` goes over, from global rank ``source`` into ``target``
        (both at this rank's position): the replicate group of the segment's ``groups`` (its
        replica order), which holds both, so the copy costs no process group of its own; a
        pair group of its own where that group is NCCL's, as the copy's tensors are host ones.

        The copy's buckets then share the pair's connection with the ring's: a step's sum
        between the two waits behind at most the buckets in flight."""
        if self.replicate_group is None or self.rank.nccl:
            return self.heal_pair(copy, source, target)
        replica = [groups.index(self.rank.layout.group_of(rank)) for rank in (source, target)]
        return PairInGroup(self.replicate_group, *replica)


class SlowLink:
    """A rank's link to the other groups at ``bytes_per_s`` (the ``slow-link`` fault, with which
    ``bench/semi_sync.py`` throttles the cross-group transport). Each collective's payload (what
    the rank hands it) crosses after the payloads handed before it, from when it is handed, so a
    sum that overlaps compute still overlaps it; the collective ends once both it and the
    crossing have."""

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self.free_at = 0.0

    def carry(self, tensors: list[torch.Tensor], work) -> _Carried:
        now = time.perf_counter()
        self.free_at = max(self.free_at, now) + sum(t.numel() * t.element_size() for t in tensors) / self.bytes_per_s
        return _Carried(work, self.free_at)


class _Carried:
    """A collective's work that ends no earlier than its payload crossed a ``SlowLink``."""

    def __init__(self, work, crossed_at: float):
        self.work, self.crossed_at = work, crossed_at

    def is_completed(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.crossed_at

    def wait(self) -> None:
        self.work.wait()
        time.sleep(max(0.0, self.crossed_at - time.perf_counter()))


class _OverSlowLink:
    """The replicate group with its collectives over a ``SlowLink``."""

    def __init__(self, group, link: SlowLink):
        self.group, self.link = group, link

    def size(self) -> int:
        return self.group.size()

    def allreduce(self, tensors: list[torch.Tensor]):
        return self.link.carry(tensors, self.group.allreduce(tensors))

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor]):
        return self.link.carry(inputs, self.group.allgather(outputs, inputs))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                      input_splits: list[int], options):
        return self.link.carry([input], self.group.alltoall_base(output, input, output_splits, input_splits, options))


class PairInGroup:
    """Two ranks of a gloo group addressed as a pair group's (the source 0, the target 1), as
    ``workers.state_transfer`` sends and receives."""

    def __init__(self, group: dist.ProcessGroupGloo, source: int, target: int):
        self.group = group
        self.ranks = (source, target)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int):
        return self.group.send(tensors, self.ranks[dst], tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int):
        return self.group.recv(tensors, self.ranks[src], tag)


def connect_store(rank: RankSpec) -> KeyedStore:
    """A connection to the run's rendezvous store, its keys bound to the run's secret."""
    return KeyedStore(dist.TCPStore(rank.store_host, rank.store_port, is_master=False,
                                    timeout=datetime.timedelta(seconds=rank.collective_timeout_s),
                                    wait_for_workers=False), rank.store_secret)


def heal_pair(store: dist.Store, copy: str, source: int, target: int, is_target: bool,
              timeout: datetime.timedelta) -> dist.ProcessGroupGloo:
    """The process group of the copy named ``copy`` (a heal's, a catch-up's) from global rank
    ``source`` (its rank 0) into ``target`` (1), on the run's store under a prefix of its own.
    Gloo even between GPUs: its groups cost no device memory, and this one lives for one copy."""
    return dist.ProcessGroupGloo(dist.PrefixStore(f"{copy}/{source}-{target}/", store), int(is_target), 2, timeout)


def group_mesh(device_type: str, layout: Topology) -> DeviceMesh:
    """The group's mesh as its layout lays it out (``Topology.mesh_shape``: every dimension
    named, ``(pp, expert_shard, ep, cp, tp)`` at every degree, and ``shard`` and ``shard_cp``
    flattened from them), from which a ``parallelize_fn`` reads each degree."""
    shape = layout.mesh_shape()
    mesh = init_device_mesh(device_type, shape.sizes, mesh_dim_names=shape.names)
    for name, spanned in shape.flattened.items():
        mesh[spanned]._flatten(name)
    return mesh

"""The heal's copy of a rank's committed state into its replacement, rank to rank.

The source (rank 0) and the target (rank 1) share a process group of their own
(``World.heal_pair``: gloo), and nothing passes through the driver or Ray's object store. A
source healing several targets at once (groups rejoining together) sends each bucket to each
of them in turn, so every target's transfer moves at once and none waits on another's. The source sends
a header first: the state's structure with each tensor as a meta tensor (its shape and dtype,
no data) and its plain values (the rng states, the optimizer's hyperparameters), which the
target reads with ``torch.load(weights_only=True)``, so a peer's bytes run no code. Then
every tensor's bytes, in the order both sides flatten that one structure to, in buckets of
at most ``BUCKET_BYTES``, each followed by its checksum; the target checks every bucket as
it lands and returns the state only once all are checked, so a transfer that fails leaves
the target's model untouched.

A tensor larger than the room left in a bucket starts a new one, so a large tensor's buckets
begin at multiples of ``BUCKET_BYTES`` of its own bytes, and each side can mostly send or
receive a bucket in place, as a view of one tensor; it stages a bucket through a host buffer
only where it spans several small tensors, or where the tensor sits on a GPU: gloo sends and
receives host memory only, so device shards cross to the host bucket by bucket (never the
whole state at once), and the target's tensors arrive in host memory, as the object store's
copy did. Each side decides that on its own: the bytes on the wire are the same.

Two buckets are in flight on each side: the source fills the next while gloo sends the last,
and the target has the next one posted while it checks the last.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from workers.world import close_pair

BUCKET_BYTES = 64 << 20
# A bucket's byte offset must suit its checksum's int64 words to be sent in place.
WORD = 8
IN_FLIGHT = 2
SOURCE, TARGET = 0, 1  # the ranks of a heal's pair group
CPU = torch.device("cpu")


class ChecksumMismatch(RuntimeError):
    """A bucket arrived with other bytes than the source sent."""


@dataclass(frozen=True)
class Piece:
    """Bytes ``start:end`` of the stream's tensor ``tensor``, in one bucket."""

    tensor: int
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[list[Piece]]:
    """The buckets of a stream of tensors of ``sizes`` bytes: small tensors packed together,
    a large one cut at multiples of ``bucket_bytes`` of its own bytes."""
    buckets: list[list[Piece]] = []
    current: list[Piece] = []
    filled = 0
    for index, size in enumerate(sizes):
        if current and filled + size > bucket_bytes:
            buckets.append(current)
            current, filled = [], 0
        for start in range(0, size, bucket_bytes):
            piece = Piece(index, start, min(size, start + bucket_bytes))
            current.append(piece)
            filled += piece.nbytes
            if filled == bucket_bytes:
                buckets.append(current)
                current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def checksum(data: torch.Tensor) -> torch.Tensor:
    """A bucket's bytes read as int64 words (the last few, short of a word, as bytes) and
    summed: exact modulo 2**64 in any order, changed by any one flipped bit, and a single read
    of the bucket. (The integrity check's fingerprints sum 32-bit words widened to int64, about
    25x slower on a CPU: seconds per GB, where this is milliseconds.)"""
    words = data.numel() // WORD * WORD
    total = data[:words].view(torch.int64).sum() + data[words:].sum(dtype=torch.int64)
    return total.reshape(1)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


def _in_place(views: list[torch.Tensor], pieces: list[Piece]) -> torch.Tensor | None:
    """The bucket as a view of its one host tensor, word-aligned for its checksum; None when
    it must be staged."""
    if len(pieces) != 1:
        return None
    piece = pieces[0]
    view = views[piece.tensor][piece.start:piece.end]
    return view if view.device == CPU and view.storage_offset() % WORD == 0 else None


class _Staging:
    """Host buffers the buckets that cannot be sent or received in place pass through, one per
    bucket in flight; page-locked where the state is on a GPU, so its copies run at full speed."""

    def __init__(self, bucket_bytes: int, pinned: bool):
        self.bucket_bytes = bucket_bytes
        self.pinned = pinned
        self.buffers: dict[int, torch.Tensor] = {}

    def buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        if slot not in self.buffers:
            self.buffers[slot] = torch.empty(self.bucket_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        return self.buffers[slot][:nbytes]


def send_state(groups: list, state: dict, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Send ``state`` (tensors anywhere, plain values) to the target of each pair group in
    ``groups``, which takes it with ``receive_state``; returns the tensors' bytes sent to each.
    On any error every pair is closed, so the targets' waits raise at once."""
    try:
        return _send(groups, state, bucket_bytes)
    except BaseException:
        for group in groups:
            close_pair(group, TARGET)
        raise


def receive_state(group) -> dict:
    """The state the source of the pair group ``group`` sends (``send_state``), every tensor in
    host memory and every bucket checked. On any error the pair is closed, so the source's
    waits raise at once."""
    try:
        return _receive(group)
    except BaseException:
        close_pair(group, SOURCE)
        raise


def _send(groups: list, state: dict, bucket_bytes: int) -> int:
    leaves, _ = tree_flatten(state)
    tensors = [leaf.detach() for leaf in leaves if torch.is_tensor(leaf)]
    skeleton = tree_map(lambda value: torch.empty_like(value, device="meta") if torch.is_tensor(value) else value,
                        state)
    saved = io.BytesIO()
    torch.save({"state": skeleton, "bucket_bytes": bucket_bytes}, saved)
    header = torch.frombuffer(bytearray(saved.getvalue()), dtype=torch.uint8)
    _wait(_to_every(groups, torch.tensor([header.numel()])) + _to_every(groups, header))
    views = [_bytes(tensor.contiguous()) for tensor in tensors]
    staging = _Staging(bucket_bytes, pinned=any(tensor.is_cuda for tensor in tensors))
    in_flight: dict[int, list] = {}
    for index, pieces in enumerate(bucket_plan([view.numel() for view in views], bucket_bytes)):
        slot = index % IN_FLIGHT
        _wait(in_flight.pop(slot, []))  # the slot's buffer is free again
        data = _in_place(views, pieces)
        if data is None:
            data = staging.buffer(slot, sum(piece.nbytes for piece in pieces))
            for own, staged in _spans(views, pieces, data):
                staged.copy_(own)
        in_flight[slot] = _to_every(groups, data) + _to_every(groups, checksum(data))
    _wait([work for works in in_flight.values() for work in works])
    return sum(view.numel() for view in views)


def _receive(group) -> dict:
    length = torch.empty(1, dtype=torch.int64)
    _wait([group.recv([length], SOURCE, 0)])
    header = torch.empty(int(length), dtype=torch.uint8)
    _wait([group.recv([header], SOURCE, 0)])
    layout = torch.load(io.BytesIO(header.numpy().tobytes()), weights_only=True)
    leaves, structure = tree_flatten(layout["state"])
    tensors = [torch.empty(leaf.shape, dtype=leaf.dtype) for leaf in leaves if torch.is_tensor(leaf)]
    views = [_bytes(tensor) for tensor in tensors]
    plan = bucket_plan([view.numel() for view in views], layout["bucket_bytes"])
    staging = _Staging(layout["bucket_bytes"], pinned=False)
    posted: dict[int, tuple] = {}

    def post(index: int) -> None:
        pieces = plan[index]
        data = _in_place(views, pieces)
        staged = data is None
        if staged:
            data = staging.buffer(index % IN_FLIGHT, sum(piece.nbytes for piece in pieces))
        sent_sum = torch.empty(1, dtype=torch.int64)
        posted[index] = (data, staged, sent_sum, [group.recv([data], SOURCE, 0), group.recv([sent_sum], SOURCE, 0)])

    for index in range(min(IN_FLIGHT, len(plan))):
        post(index)
    for index, pieces in enumerate(plan):
        data, staged, sent_sum, works = posted.pop(index)
        _wait(works)
        arrived_sum = checksum(data)
        if not torch.equal(arrived_sum, sent_sum):
            raise ChecksumMismatch(f"bucket {index + 1} of {len(plan)} ({data.numel()} bytes) arrived with checksum "
                                   f"{int(arrived_sum)}, sent with {int(sent_sum)}")
        if staged:
            for own, arrived in _spans(views, pieces, data):
                own.copy_(arrived)
        if index + IN_FLIGHT < len(plan):
            post(index + IN_FLIGHT)
    received = iter(tensors)
    return tree_unflatten([next(received) if torch.is_tensor(leaf) else leaf for leaf in leaves], structure)


def _spans(views: list[torch.Tensor], pieces: list[Piece], bucket: torch.Tensor):
    """Each piece's bytes in its tensor, with its place in the staged ``bucket``."""
    offset = 0
    for piece in pieces:
        yield views[piece.tensor][piece.start:piece.end], bucket[offset:offset + piece.nbytes]
        offset += piece.nbytes


def _to_every(groups: list, tensor: torch.Tensor) -> list:
    return [group.send([tensor], TARGET, 0) for group in groups]


def _wait(works: list) -> None:
    """Each send or receive done, or raised: the group's timeout bounds each one."""
    for work in works:
        work.wait()

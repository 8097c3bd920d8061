"""The heal's rank-to-rank copy (``workers.state_transfer``) between two real gloo processes,
without Ray: the target ends with the source's state bit for bit, and a bucket changed on
the way is caught by its checksum on the target and ends the source's send too. And the
fleet's side on Ray: a pair whose copy failed goes through the object store, saying why."""

import time

import pytest
import ray
import torch
import torch.distributed as dist
from torch import nn

from checkpointing.healing import import_local_state, local_state
from elastic.core.topology import Topology
from elastic.fleet.api import HealCopy
from elastic.fleet.ray_fleet import Fleet
from elastic.testing.gloo_ranks import gloo_ranks
from workers import rng
from workers.rank_spec import RankSpec
from workers.state_transfer import ChecksumMismatch, Piece, bucket_plan, checksum, receive_state, send_state
from workers.world import World
from tests.tiny import tiny_config

SOURCE, TARGET = 3, 7  # global ranks
HEAL = "heal1"
# Small buckets, so the state's few kilobytes make many: a tensor cut across several, small
# tensors packed into one, sizes that are not whole int64 words.
BUCKET_BYTES = 512
TIMEOUT_S = 60.0


class Model(nn.Module):
    """Parameters of several dtypes and sizes: one larger than a bucket, some odd-sized."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(37, 12)  # 1776 bytes: four buckets
        self.hidden = nn.Linear(12, 5)
        self.output = nn.Linear(5, 3).to(torch.bfloat16)  # 30 bytes of weight, 6 of bias
        self.scale = nn.Parameter(torch.ones(7))  # 28 bytes

    def forward(self, tokens):
        hidden = self.hidden(self.embedding(tokens)) * self.scale[:5]
        return self.output(hidden.to(torch.bfloat16)).float()


def trained(seed: int, steps: int) -> tuple[Model, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        step(model, optimizer)
    return model, optimizer


def step(model: Model, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step on fixed tokens: the same on every process, whatever its generators."""
    tokens = torch.arange(20).reshape(4, 5) % 37
    model(tokens).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def bits(model: Model, optimizer: torch.optim.Optimizer) -> list:
    """Every tensor of the state as bytes, and its plain values."""
    state = local_state(model, optimizer)
    tensors = [value for value in torch.utils._pytree.tree_leaves(state) if torch.is_tensor(value)]
    return [tensor.reshape(-1).view(torch.uint8).numpy().tobytes() for tensor in tensors] + [
        state["optimizer"]["param_groups"]]


def heal_world(rank: int, store_path: str) -> World:
    global_rank = SOURCE if rank == 0 else TARGET
    spec = RankSpec(global_rank=global_rank, group=rank, group_rank=0, shard_index=0, tp_index=0, layout=Topology(1, 1),
                    seed=0, use_gpu=False, store_host="", store_port=0, store_secret="00",
                    collective_timeout_s=TIMEOUT_S)
    return World(spec, dist.FileStore(store_path, 2))


def healing_rank(rank: int, store_path: str) -> dict:
    """The source sends its state after 3 steps; the target, freshly built from another seed
    with no optimizer state yet, takes it as ``RankWorker.receive_state`` does. Then both step
    once more and draw from their generators."""
    world = heal_world(rank, store_path)
    if rank == 0:
        model, optimizer = trained(seed=0, steps=3)
        torch.manual_seed(1234)
        sent = send_state([world.heal_pair(HEAL, SOURCE, TARGET)],
                          {**local_state(model, optimizer), "rng": rng.capture(False)}, BUCKET_BYTES)
        moved = sent
    else:
        model, optimizer = trained(seed=5, steps=0)
        state = receive_state(world.heal_pair(HEAL, SOURCE, TARGET))
        import_local_state(model, optimizer, state)
        rng.restore(state["rng"])
        moved = sum(value.numel() * value.element_size()
                    for value in torch.utils._pytree.tree_leaves(state) if torch.is_tensor(value))
    healed = bits(model, optimizer)
    step(model, optimizer)
    return {"healed": healed, "stepped": bits(model, optimizer), "draw": torch.rand(4).tolist(), "bytes": moved}


def test_the_target_holds_the_source_state_bit_for_bit(tmp_path):
    source, target = gloo_ranks(healing_rank, 2, str(tmp_path / "init"), str(tmp_path / "store"))
    assert len(source["healed"]) == 6 * 4 + 1  # six parameters, each with two moments and a step; the param groups
    assert target["healed"] == source["healed"]
    assert target["stepped"] == source["stepped"]  # the moments and step counts carry on alike
    assert target["draw"] == source["draw"]  # the generators were copied too
    assert target["bytes"] == source["bytes"] > 3 * BUCKET_BYTES


class CorruptingGroup:
    """A pair group whose ``corrupt``-th send carries one flipped bit, after the source took
    its checksum: a bucket changed on the way."""

    def __init__(self, group, corrupt: int):
        self.group = group
        self.sends = 0
        self.corrupt = corrupt

    def send(self, tensors, peer, tag):
        self.sends += 1
        if self.sends == self.corrupt:
            changed = tensors[0].clone()
            changed[-1] ^= 4
            tensors = [changed]
        return self.group.send(tensors, peer, tag)

    def __getattr__(self, name):
        return getattr(self.group, name)


# The header's length and bytes are sends 1 and 2, then each bucket's data and checksum.
SECOND_BUCKET = 2 + 2 + 1


def corrupting_rank(rank: int, store_path: str) -> str:
    """What each side raised, and how soon after the transfer began."""
    world = heal_world(rank, store_path)
    model, optimizer = trained(seed=0, steps=1)
    started = time.monotonic()
    try:
        if rank == 0:
            group = CorruptingGroup(world.heal_pair(HEAL, SOURCE, TARGET), SECOND_BUCKET)
            send_state([group], {**local_state(model, optimizer), "rng": rng.capture(False)}, BUCKET_BYTES)
        else:
            receive_state(world.heal_pair(HEAL, SOURCE, TARGET))
    except Exception as error:  # noqa: BLE001 - what it raised is the answer
        return f"{type(error).__name__} after {time.monotonic() - started:.1f}s: {error}"
    return "nothing raised"


def test_a_bucket_changed_on_the_way_fails_both_sides_at_once(tmp_path):
    source, target = gloo_ranks(corrupting_rank, 2, str(tmp_path / "init"), str(tmp_path / "store"))
    assert target.startswith(ChecksumMismatch.__name__) and "bucket 2 of " in target, target
    # the target closed the pair: the source's wait for the buckets it will never take ends now,
    # not at the group's timeout
    assert source != "nothing raised", source
    assert float(source.split(" after ")[1].split("s:")[0]) < TIMEOUT_S / 4, source


def test_buckets_pack_small_tensors_and_cut_large_ones_at_multiples_of_the_bucket():
    assert bucket_plan([3, 4, 0, 10, 2], 8) == [
        [Piece(0, 0, 3), Piece(1, 0, 4)],
        [Piece(3, 0, 8)],
        [Piece(3, 8, 10), Piece(4, 0, 2)],
    ]
    assert bucket_plan([], 8) == []


@pytest.mark.parametrize("size", [64, 61])  # whole int64 words, and a few bytes over
def test_the_checksum_sees_every_single_flipped_bit(size):
    data = torch.randint(0, 256, (size,), dtype=torch.uint8)
    for byte in range(size):
        for bit in range(8):
            changed = data.clone()
            changed[byte] ^= 1 << bit
            assert not torch.equal(checksum(changed), checksum(data)), (byte, bit)


@ray.remote
class HealCalls:
    """A rank's side of a heal, answering the state's bytes; a receive that fails where told."""

    def __init__(self, failing: bool):
        self.failing = failing

    def send_state(self, heal: int, targets: list[int]) -> int:
        return 100

    def receive_state(self, heal: int, source: int) -> int:
        if self.failing:
            raise ChecksumMismatch("bucket 2 of 9 (512 bytes) arrived with checksum 7, sent with 5")
        return 100

    def export_state(self) -> dict:
        return {"rng": {}}

    def import_state(self, state: dict) -> int:
        return 100


def test_a_pair_whose_copy_failed_goes_through_the_object_store_and_says_why(ray_cluster, tmp_path):
    fleet = Fleet(tiny_config(tmp_path, groups=2, shard=2), hooks=None, topology=Topology(2, 1), rendezvous=None)
    fleet.actors = {rank: HealCalls.remote(failing=rank == 3) for rank in range(4)}
    copies = fleet.copy_state([(0, 2), (1, 3)])
    assert copies[0] == HealCopy(0, 2, 100)
    assert (copies[1].source, copies[1].target, copies[1].bytes) == (1, 3, 100)
    assert "rank 3" in copies[1].fallback and "ChecksumMismatch: bucket 2 of 9" in copies[1].fallback, copies[1]
    assert (copies[1].rank_to_rank_bytes, copies[1].object_store_bytes) == (0, 100)

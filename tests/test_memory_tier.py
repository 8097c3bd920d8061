"""The in-memory tier: buddies and restore plans (pure), and a rank's host copies (torch,
one process, with a stand-in buddy)."""

import random

import pytest
import torch

from elastic.core.data_plan import DataCursor
from elastic.core.memory_tier import BuddyPairing, Holdings, choose_buddies, plan_memory_restore
from elastic.core.topology import Topology


def cursor(step: int) -> DataCursor:
    return DataCursor(0, step * 8)


def test_buddies_keep_the_two_copies_of_a_position_at_two_positions_of_two_groups():
    topology = Topology(shard=2, tp=1, max_groups=2)
    buddies = choose_buddies(topology, [0, 1], {})
    assert buddies == {0: 3, 1: 2, 2: 1, 3: 0}
    # losing both copies of shard 0 (ranks 0 and 2) leaves their buddies alive
    assert {buddies[0], buddies[2]}.isdisjoint({0, 2})


def test_a_single_group_keeps_copies_at_its_other_positions():
    assert choose_buddies(Topology(shard=2, tp=2), [0], {}) == {0: 1, 1: 2, 2: 3, 3: 0}


def test_a_single_rank_has_no_buddy_and_one_rank_groups_pair_across_groups():
    assert choose_buddies(Topology(shard=1, tp=1, max_groups=1), [0], {}) == {}
    assert choose_buddies(Topology(shard=1, tp=1, max_groups=3), [0, 1, 2], {}) == {0: 1, 1: 2, 2: 0}


def test_a_buddy_on_another_node_comes_first():
    topology = Topology(shard=2, tp=1, max_groups=2)
    # ranks 0, 3 on node a; 1, 2 on node b: rank 0's first candidate (3) shares its node
    node_of = {0: "a", 1: "b", 2: "b", 3: "a"}
    buddies = choose_buddies(topology, [0, 1], node_of)
    assert all(node_of[rank] != node_of[buddy] for rank, buddy in buddies.items())
    assert buddies[0] == 2


def test_the_restore_takes_the_newest_step_every_rank_can_reach():
    # one group of two; rank 1 died (its replacement holds nothing). Rank 0 holds its own
    # copies of steps 4 and 6, and rank 1's copy of step 4 only (step 6 was on its way)
    holdings = {0: Holdings(own={4: cursor(4), 6: cursor(6)}, held={1: {2: cursor(2), 4: cursor(4)}}),
                1: Holdings({}, {})}
    plan = plan_memory_restore([0, 1], holdings)
    assert (plan.step, plan.cursor, plan.own, plan.transfers, plan.ranks) == (4, cursor(4), (0,), ((0, 1),), (0, 1))


def test_a_restore_after_a_mismatch_takes_no_step_after_the_verified_one():
    holdings = {0: Holdings(own={4: cursor(4), 6: cursor(6)}, held={}), 1: Holdings(own={4: cursor(4), 6: cursor(6)}, held={})}
    assert plan_memory_restore([0, 1], holdings, at_most=5).step == 4
    assert plan_memory_restore([0, 1], holdings, at_most=3) is None


def test_own_copies_come_before_a_buddys():
    holdings = {0: Holdings(own={6: cursor(6)}, held={1: {6: cursor(6)}}), 1: Holdings(own={6: cursor(6)}, held={})}
    assert plan_memory_restore([0, 1], holdings).transfers == ()


def test_no_plan_when_a_rank_and_its_buddy_are_both_gone():
    holdings = {0: Holdings(own={6: cursor(6)}, held={})}  # rank 1's buddy copy died with rank 2
    assert plan_memory_restore([0, 1], holdings) is None
    assert plan_memory_restore([], holdings) is None


class StandInBuddy:
    """A buddy's ``hold_copy`` as an actor handle's method would take it."""

    def __init__(self):
        self.held = {}
        outer = self

        class Method:
            def remote(self, owner, step, cursor, state):
                from workers.memory_tier import from_wire

                outer.held[owner] = (step, cursor, from_wire(state))
                return "confirmed"

        self.hold_copy = Method()


@pytest.fixture
def tier(monkeypatch):
    import ray

    from workers.memory_tier import MemoryTier

    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)
    tier = MemoryTier(rank=0, send_timeout_s=30.0)
    yield tier
    tier.sender.shutdown(wait=True)


def trained_model():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optimizer


def step(model, optimizer):
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_a_rank_keeps_its_newest_two_copies_sends_each_and_a_restore_is_a_copy(tier):
    buddy = StandInBuddy()
    tier.set_buddy(buddy)
    model, optimizer = trained_model()
    states = {}
    for number in range(1, 4):
        step(model, optimizer)
        states[number] = [param.detach().clone() for param in model.parameters()]
        tier.snapshot(number, cursor(number), model, optimizer, {"cpu": b"generators"})
        tier.sending.result()
    holdings = tier.holdings()
    assert holdings.own == {2: cursor(2), 3: cursor(3)} and holdings.nbytes > 0
    assert buddy.held[0][0] == 3 and torch.equal(buddy.held[0][2]["model"][0], states[3][0])
    step(model, optimizer)  # training moves on; the copies do not
    restored = tier.own_state(2)
    assert [torch.equal(a, b) for a, b in zip(restored["model"], states[2])] == [True, True]
    assert restored["rng"] == {"cpu": b"generators"}
    assert tier.holdings().own == {2: cursor(2)}  # the run goes on from step 2: step 3's copy is gone
    with pytest.raises(KeyError):
        tier.own_state(3)
    # the restored state is a copy: the next snapshots into the arenas do not change it
    kept = restored["model"][0].clone()
    for number in (3, 4):
        step(model, optimizer)
        tier.snapshot(number, cursor(number), model, optimizer, {})
    assert torch.equal(restored["model"][0], kept)


def test_a_run_of_one_rank_has_no_buddy_and_takes_no_copy(tier):
    model, optimizer = trained_model()
    assert tier.snapshot(1, cursor(1), model, optimizer, {}) == 0.0
    assert tier.holdings() == Holdings({}, {}, 0)


def test_a_snapshot_waits_until_the_buddy_has_the_last_one(tier):
    import threading

    release, arrived = threading.Event(), []

    class SlowBuddy:
        class hold_copy:
            @staticmethod
            def remote(owner, step, cursor, state):
                release.wait()
                arrived.append(step)
                return "confirmed"

    tier.set_buddy(SlowBuddy())
    model, optimizer = trained_model()
    step(model, optimizer)
    assert tier.snapshot(1, cursor(1), model, optimizer, {}) < 0.1
    threading.Timer(0.2, release.set).start()
    assert tier.snapshot(2, cursor(2), model, optimizer, {}) >= 0.15  # it waited for step 1's copy
    tier.sending.result()
    assert arrived == [1, 2]


def test_copies_held_for_others_are_the_newest_two_handed_out_by_step_and_dropped_after_a_rewind(tier):
    state = {"model": [torch.ones(3)]}
    for held_step in (2, 3, 4):
        tier.hold(5, held_step, cursor(held_step), state)
    tier.hold(6, 3, cursor(3), state)
    assert tier.holdings().held == {5: {3: cursor(3), 4: cursor(4)}, 6: {3: cursor(3)}}
    assert tier.held_state(5, 4) is state
    with pytest.raises(KeyError):
        tier.held_state(5, 2)
    model, optimizer = trained_model()
    tier.set_buddy(StandInBuddy())
    tier.snapshot(3, cursor(3), model, optimizer, {})
    tier.own_state(3)  # the run goes back to step 3: rank 5's copy of step 4 is from a future that is gone
    assert tier.holdings().held == {5: {3: cursor(3)}, 6: {3: cursor(3)}}


def test_a_single_group_that_loses_a_rank_resumes_from_memory_with_the_losses_of_an_unbroken_run(
        ray_cluster, tmp_path):
    """No peer group and no checkpoint: before the memory tier this run went back to step 0."""
    from elastic import ElasticTrainer
    from elastic.core.events import EventKind
    from elastic.testing.losses import max_relative_difference
    from tests.reference import reference_run
    from tests.tiny import tiny_config

    steps = 10
    config = tiny_config(tmp_path, groups=1, shard=2, steps=steps, checkpoint__every=0, checkpoint__memory_every=1,
                         fault_tolerance__inject="kill:rank=1,step=6", fault_tolerance__min_deadline_s=3.0)
    result = ElasticTrainer(config).fit()
    assert result.ok, result.exit
    [restored] = [event for event in result.summary["events"] if event["kind"] == EventKind.RESTORED_FROM_MEMORY]
    # step 6's copies, or step 5's if rank 1's copy of step 6 was still on its way to rank 0
    assert restored["step"] in (5, 6) and restored["from_buddies"] == [1] and restored["host_bytes_per_rank"] > 0
    assert [event for event in result.summary["events"] if event["kind"] == EventKind.RESTORED_INITIAL_STATE] == []
    reference, _ = reference_run(config, steps)
    assert max_relative_difference(result.losses, reference) <= 1e-5


def test_a_buddy_that_does_not_take_a_copy_in_time_is_given_up_on_and_the_next_snapshot_goes_ahead(monkeypatch):
    import ray

    from workers.memory_tier import MemoryTier

    timeouts = []

    def get(ref, timeout=None):
        timeouts.append(timeout)
        raise ray.exceptions.GetTimeoutError("the buddy did not answer")

    monkeypatch.setattr(ray, "get", get)
    tier = MemoryTier(rank=0, send_timeout_s=0.5)
    tier.set_buddy(StandInBuddy())
    model, optimizer = trained_model()
    try:
        tier.snapshot(1, cursor(1), model, optimizer, {})
        assert tier.snapshot(2, cursor(2), model, optimizer, {}) < 0.4  # the failed send did not hold it up
        tier.sending.result()
    finally:
        tier.sender.shutdown(wait=True)
    assert timeouts == [0.5, 0.5]
    assert tier.holdings().own == {1: cursor(1), 2: cursor(2)}  # its own copies are kept all the same


@pytest.mark.parametrize("seed", range(6))
def test_a_pairing_kept_across_quorum_changes_equals_one_made_from_nothing(seed):
    """Groups leave, join and are renewed (new processes, maybe on other nodes); after each
    change the kept pairing is the one made from nothing, and it re-paired every rank whose
    buddy changed."""
    rng = random.Random(seed)
    topology = Topology(shard=rng.choice([1, 2, 4]), tp=rng.choice([1, 2]), max_groups=rng.choice([2, 5, 9]))
    per_group, nodes = topology.ranks_per_group, rng.choice([1, 2, 3, 6])
    node_of = {rank: f"n{rng.randrange(nodes)}" for rank in range(topology.max_ranks)}
    pairing, live = BuddyPairing(topology), set(range(topology.max_groups))
    told = dict(pairing.update(live, node_of))
    for _ in range(30):
        before = dict(pairing.buddies)
        change = rng.choice(["leave", "join", "renew"])
        pool = sorted(live) if change != "join" else sorted(set(range(topology.max_groups)) - live)
        if not pool:
            continue
        groups = set(rng.sample(pool, rng.randint(1, min(2, len(pool)))))
        live = live - groups if change == "leave" else live | groups
        if change != "leave":
            for group in groups:  # the group's new processes may land on other nodes
                node_of.update({rank: f"n{rng.randrange(nodes)}" for rank in topology.global_ranks(group)})
        changes = pairing.update(live, node_of, renewed=groups if change == "renew" else ())
        assert pairing.buddies == choose_buddies(topology, live, node_of)
        told.update(changes)
        moved = {rank for rank, buddy in pairing.buddies.items() if before.get(rank) != buddy}
        assert moved <= set(changes)
        if change != "leave":
            assert {rank for group in groups for rank in topology.global_ranks(group)} <= set(changes)
        assert all(told[rank] == buddy for rank, buddy in pairing.buddies.items())
    assert per_group * len(live) >= len(pairing.buddies)


def test_one_group_lost_re_pairs_only_the_ranks_that_kept_copies_there():
    topology = Topology(shard=8, tp=1, max_groups=64)
    node_of = {rank: f"node{rank // 8}" for rank in range(topology.max_ranks)}
    pairing = BuddyPairing(topology)
    pairing.update(range(64), node_of)
    changes = pairing.update(set(range(64)) - {10}, node_of)
    assert set(changes) == set(topology.global_ranks(9))  # group 9's ranks kept their copies in group 10
    assert set(pairing.update(range(64), node_of)) == set(topology.global_ranks(9)) | set(topology.global_ranks(10))


def test_on_one_node_a_group_lost_tells_only_the_ranks_whose_buddy_changed():
    # Every walk passes every group when no rank is on another node: each is looked at again,
    # but only the ranks that kept their copies in the lost group are told (a call each).
    topology = Topology(shard=2, tp=1, max_groups=8)
    node_of = dict.fromkeys(range(topology.max_ranks), "node")
    pairing = BuddyPairing(topology)
    pairing.update(range(8), node_of)
    assert set(pairing.update(set(range(8)) - {7}, node_of)) == set(topology.global_ranks(6))
    # group 7 back on new processes: its ranks, and the ranks whose buddies they are again
    assert set(pairing.update(range(8), node_of, renewed=[7])) == set(topology.global_ranks(6)) | set(
        topology.global_ranks(7))

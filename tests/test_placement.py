"""Placement readiness: one ``ready()`` per placement group, however often the driver polls.

Each ``ready()`` submits a Ray task; a fresh one on every 50 ms poll flooded a busy GPU node
until the group was never placed."""

import time

from ray.util.placement_group import PlacementGroup

from elastic.setup.capacity import on_cluster
from elastic.core.membership import Membership
from elastic.core.topology import Topology
from elastic.fleet.ray_fleet import Fleet
from tests.tiny import tiny_config


def test_readiness_is_requested_once_per_group(ray_cluster, tmp_path, monkeypatch):
    calls = []
    real_ready = PlacementGroup.ready

    def counted_ready(self):
        calls.append(self.id)
        return real_ready(self)

    monkeypatch.setattr(PlacementGroup, "ready", counted_ready)
    config = on_cluster(tiny_config(tmp_path, groups=2, shard=2), ray_cluster.cluster_resources())
    membership = Membership(Topology(config.scaling.shard, config.scaling.tp))
    fleet = Fleet(config, hooks=None, topology=membership.topology, rendezvous=None)
    groups = [membership.add_group(), membership.add_group()]
    try:
        for group in groups:
            fleet.reserve(group)
        give_up = time.monotonic() + 60
        while not all(fleet.placed(group) for group in groups) and time.monotonic() < give_up:
            time.sleep(0.01)
        for _ in range(50):  # the driver keeps polling at every step boundary
            assert all(fleet.placed(group) for group in groups)
        assert len(calls) == 2 and len(set(calls)) == 2
    finally:
        for group in groups:
            fleet.release(group)

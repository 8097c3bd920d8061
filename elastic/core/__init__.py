"""The driver's pure core: membership and the group lifecycle, the topology, the data plan,
failure diagnosis and recovery plans, policies, straggler handling, goodput, events and
fault schedules; and the ranks' segment protocol (``segment_loop``), which the rank actors follow.

Plain data in, decisions out, time from an injected clock. Nothing here imports Ray, torch,
fsspec, pydantic or prometheus_client, nor the layers above (``workers``, ``checkpointing``);
``tests/test_core.py`` checks every module here. So each decision is tested in milliseconds
without a cluster, and the controller and the fleet keep the side effects at the edge.
"""

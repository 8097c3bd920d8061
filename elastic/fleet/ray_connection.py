"""The driver's Ray: the surrounding cluster's (``RAY_ADDRESS``, ``ray job submit``), or a local
instance on loopback that it starts and stops itself."""

from __future__ import annotations

import logging
import os

import ray

log = logging.getLogger("elastic")


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
    settings = dict(
        address="local",  # a new instance, even when another one runs on this machine
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        configure_logging=False,
        runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}},
        **{"log_to_driver": True, **options},
    )
    try:
        ray.init(**settings)
    except Exception as error:  # Ray raises a bare Exception when its raylet registers late
        if "timed out during startup" not in str(error):
            raise
        # Ray waits a fixed 30 s for its raylet: a machine busy with other work can take longer once.
        log.warning("the local Ray instance was slow to start (%s); starting it again", error)
        ray.shutdown()
        ray.init(**settings)

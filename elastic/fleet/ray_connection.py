"""The driver's Ray: the surrounding cluster's (``RAY_ADDRESS``, ``ray job submit``), or a local
instance on loopback that it starts and stops itself."""

from __future__ import annotations

import logging
import os
from importlib.machinery import PathFinder

import ray

from workers import TRAINER_PACKAGES

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
        ray.init(log_to_driver=True, runtime_env=installed_packages_first() or None)
        return False
    start_local_ray()
    return True


def installed_packages_first() -> dict:
    """The job's runtime env where the driver's working directory holds a namesake of one of
    ``TRAINER_PACKAGES``, a folder or a module, which the ranks would import instead of the
    installed package: Ray puts that directory first on each worker's path as the worker takes
    its first task. Ray's setup hook runs before that, and imports the installed packages;
    every later import finds them loaded. Empty otherwise: a runtime env costs each worker
    Ray's setup process."""
    if not any(PathFinder.find_spec(name, [os.getcwd()]) for name in TRAINER_PACKAGES):
        return {}
    return {"worker_process_setup_hook": f"{__name__}.{import_packages.__name__}"}


def import_packages() -> None:
    """A worker's setup hook (``installed_packages_first``); importing this module imported ``elastic``."""
    import checkpointing  # noqa: F401
    import workers  # noqa: F401


def start_local_ray(**options) -> None:
    """A local Ray instance on loopback only; gloo follows the same interface. Ray 2.60 turns
    token authentication on for it and says so on every run: that notice is dropped
    (docs/operations.md says it). Ray's usage statistics are off. A ``runtime_env`` in
    ``options`` adds to the workers' own (a benchmark's setup hook, its variables)."""
    extra_env = options.pop("runtime_env", {})
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    settings = dict(
        address="local",  # a new instance, even when another one runs on this machine
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        configure_logging=False,
        **{"log_to_driver": True, **options},
        runtime_env={**installed_packages_first(), **extra_env,
                     "env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra_env.get("env_vars", {})}},
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

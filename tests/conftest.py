import os

import pytest
import ray

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance on loopback for the whole session."""
    ray.init(
        num_cpus=8,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}},
    )
    yield ray
    ray.shutdown()

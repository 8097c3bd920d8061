import pytest
import ray

from elastic.trainer import start_local_ray


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance on loopback for the whole session."""
    start_local_ray(num_cpus=8, log_to_driver=False)
    yield ray
    ray.shutdown()

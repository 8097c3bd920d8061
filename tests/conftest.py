import pytest
import ray

from elastic.trainer import start_local_ray
from tests.s3 import MotoServer, set_test_credentials


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance on loopback for the whole session."""
    set_test_credentials()
    start_local_ray(num_cpus=8, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def s3_server():
    set_test_credentials()
    server = MotoServer().start()
    yield server
    server.stop()

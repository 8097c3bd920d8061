import os
import secrets

# Ray reads its auth mode and token once per process, when it is imported: set them first, so
# that this process and every driver it starts join the test run's head with them.
os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})

import pytest  # noqa: E402
import ray  # noqa: E402

from tests.ray_head import RayHead  # noqa: E402
from tests.s3 import MotoServer, set_test_credentials  # noqa: E402


@pytest.fixture(scope="session")
def ray_head():
    """The one Ray instance of the whole test run, on loopback (tests/ray_head.py). This
    process joins it, and so does every driver a test starts with ``RAY_ADDRESS`` set."""
    set_test_credentials()  # before the head starts: its workers inherit them
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    head = RayHead(num_cpus=8)
    try:
        ray.init(address=head.gcs_address, log_to_driver=False, configure_logging=False)
        yield head
    finally:
        ray.shutdown()
        leftovers = head.stop()
    assert not leftovers, f"processes of the test run's Ray head outlived it: {leftovers}"


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    yield ray


@pytest.fixture
def s3_server():
    set_test_credentials()
    server = MotoServer().start()
    yield server
    server.stop()

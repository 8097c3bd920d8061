import itertools
import os
import secrets

# Ray reads its auth mode and token once per process, when it is imported: set them first, so
# that this process and every driver it starts join the test run's head with them.
os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
# Ray's usage statistics off in this process and the drivers it starts, as in the product's own
# Ray (start_local_ray) and the lanes' heads (--disable-usage-stats): with them on, Ray Data's
# usage threads query a Prometheus on localhost:9090 beside every test.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# One thread per test process, read as torch loads, as the ranks run: the two lanes
# (pytest_collection_modifyitems) share two cores, and a thread per core each would contend.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import ray  # noqa: E402

from elastic.testing.ray_head import RayHead  # noqa: E402
from elastic.testing.s3 import MotoServer, set_test_credentials  # noqa: E402

BUCKETS = itertools.count()


def pytest_configure(config):
    config.addinivalue_line("markers", "waits: mostly waiting (paced steps, an outage, a lease, a process, node, job "
                                       "or Ray of its own starting): runs in the lane beside the computing tests")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """Two lanes (pyproject's ``-n 2 --dist loadgroup``), each a pytest-xdist worker with a Ray
    head of its own: the tests marked ``waits``, one after another, beside the rest, one after
    another. A waiting test leaves a core idle for the computing one beside it; two computing
    tests side by side would only contend for the two cores."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group("waits" if item.get_closest_marker("waits") else "computes"))


def end_detached_actors() -> None:
    """Ray Data's detached actors (its stats, autoscaling coordinator and usage collector)
    outlive the job that started them, and a head stopping with them alive waits 30 s for
    them before it kills them: they are ended first."""
    if not ray.is_initialized():
        return
    for actor in ray.util.list_named_actors(all_namespaces=True):
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))


@pytest.fixture(scope="session")
def ray_head():
    """The one Ray instance of this lane's whole test run, on loopback (elastic/testing/ray_head.py). This
    process joins it, and so does every driver a test starts with ``driver_env()``; the
    workers of both fork from the head's server (elastic/testing/forked_ray_workers.py)."""
    set_test_credentials()  # before the head starts: its workers inherit them
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    head = RayHead(num_cpus=8)
    try:
        ray.init(address=head.gcs_address, log_to_driver=False, configure_logging=False)
        yield head
    finally:
        end_detached_actors()
        ray.shutdown()
        leftovers = head.stop()
    assert not leftovers, f"processes of the test run's Ray head outlived it: {leftovers}"


@pytest.fixture(scope="session")
def ray_cluster(ray_head):
    yield ray


@pytest.fixture(scope="session")
def s3_process():
    set_test_credentials()
    server = MotoServer().start()
    yield server
    server.stop()


@pytest.fixture
def s3_server(s3_process):
    """A bucket of the test's own on the test run's S3 server: a server takes 0.6 s to start,
    and 40-odd tests use one."""
    return s3_process.for_bucket(f"elastic-test-{next(BUCKETS)}")


@pytest.fixture
def own_s3_server():
    """An S3 server of the test's own, for a test that stops or freezes it."""
    set_test_credentials()
    server = MotoServer().start()
    yield server
    server.stop()

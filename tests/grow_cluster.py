"""A job that grows when its cluster does, on a multi-node local Ray cluster.

Run by tests/test_elastic_grow.py in its own process, so that this cluster's Ray instance
stays apart from the test session's. The head node fits one replica group; the job trains
on a thread while, once the first group has joined and trained for a moment, the main
thread adds a node that fits the second (Ray starts nodes from the main thread only).
Writes the run's summary to OUT/summary.json.

    python tests/grow_cluster.py OUT STEPS
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from elastic import ElasticTrainer  # noqa: E402
from elastic.core.events import EventKind  # noqa: E402
from tests.tiny import tiny_config  # noqa: E402

# A group is shard 2 x 0.5 CPU: one fits on each 1-CPU node.
NODE = {"num_cpus": 1, "include_dashboard": False}
GROW_AFTER_S = 1.0


class FirstJoin(logging.Handler):
    """Sets ``joined`` on the first group-joined event (events are logged as JSON)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.joined = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if json.loads(record.getMessage())["kind"] == EventKind.GROUP_JOINED:
            self.joined.set()


def main(out: Path, steps: int) -> None:
    # The nodes and their workers inherit these. gloo stays on loopback, as under
    # start_local_ray. Cluster records its address in $RAY_TMPDIR/ray/ray_current_cluster,
    # which any plain ray.init() on this machine would then join: keep it private.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-grow-")
    cluster = Cluster(initialize_head=True, head_node_args=NODE)
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}})
    handler = FirstJoin()
    events = logging.getLogger("elastic.events")
    events.setLevel(logging.INFO)
    events.addHandler(handler)
    config = tiny_config(out, groups=2, min_groups=1, shard=2, steps=steps, scaling__cpus_per_rank=0.5,
                         stragglers__enabled=False)
    results = []
    training = threading.Thread(target=lambda: results.append(ElasticTrainer(config).fit()))
    training.start()
    handler.joined.wait(timeout=300)
    time.sleep(GROW_AFTER_S)
    cluster.add_node(**NODE)
    training.join()
    (out / "summary.json").write_text(json.dumps(results[0].summary, default=str))
    ray.shutdown()
    cluster.shutdown()
    shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))

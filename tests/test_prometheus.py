"""A real Prometheus server (the binary on PATH, bound to loopback) scrapes a real run with an
injected failure; then every query of the Grafana dashboard, sent to Prometheus's HTTP API,
returns data, and every metric the dashboard uses is one the run exported.

.ci/run installs the Debian package ``prometheus``; without the binary the test is skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request

import pytest
import yaml

from elastic import ElasticTrainer
from tests.test_deploy import dashboard_queries, metric_names
from elastic.testing.loopback import free_port, wait_for
from tests.tiny import FAST_DETECTION, tiny_config

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.skipif(PROMETHEUS is None,
                       reason="no prometheus binary on PATH: install the Debian package prometheus (.ci/run does)"),
    pytest.mark.waits,  # a Prometheus of its own starts and scrapes each second
]

SCRAPE_INTERVAL_S = 1


class PrometheusServer:
    """One ``prometheus`` process on 127.0.0.1 scraping one target, with its TSDB in tmp."""

    def __init__(self, tmp_path, target: str):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = {
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [{"job_name": "elastic", "static_configs": [{"targets": [target]}]}],
        }
        config_path = tmp_path / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp_path / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self.ready, 30, f"Prometheus at {self.url} (log: {self.log_path})")

    def ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def api(self, path: str, **params) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", data
        return data["result"]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture
def prometheus_and_target(tmp_path):
    """A running Prometheus, and the loopback port it expects the run's metrics on."""
    metrics_port = free_port()
    server = PrometheusServer(tmp_path, f"127.0.0.1:{metrics_port}")
    yield server, metrics_port
    server.stop()


def test_dashboard_queries_return_data_from_a_real_run(ray_cluster, tmp_path, prometheus_and_target):
    prometheus, metrics_port = prometheus_and_target
    steps = 40
    # Long enough for a few scrapes before and after the kill: recoveries and evictions must
    # be seen at zero first, or increase() cannot see them go up. Four ranks: straggler scores
    # need at least three. A mixture of experts: the expert-load panel has nothing of a dense model.
    config = tiny_config(
        tmp_path, groups=2, shard=2, steps=steps, fault_tolerance__inject="kill:rank=1,step=20", checkpoint__every=10,
        metrics__port=metrics_port, eval__every=15, model__experts=4, model__experts_per_token=2, **FAST_DETECTION,
    )
    scraped = []

    def hold_the_first_step_until_scraped(_result) -> None:
        # Ranks start in about a second: without this the kill could land before Prometheus
        # has seen the counters at zero. The driver is held, so the run at step 20 is too.
        if not scraped:
            scraped.append(wait_for(lambda: prometheus.query("elastic_generation"), 30, "a scrape of the run"))

    result = ElasticTrainer(config, on_step=[hold_the_first_step_until_scraped]).fit()
    assert result.ok, result.exit
    assert result.summary["steps_discarded"] >= 1

    # The metrics server outlives fit() (a daemon thread); wait for a scrape of the final state.
    wait_for(
        lambda: [s for s in prometheus.query("elastic_steps_committed_total") if float(s["value"][1]) == steps],
        30, f"a scrape with {steps} committed steps",
    )

    empty = [f"{title}: {expr}" for title, expr in dashboard_queries() if not prometheus.query(expr)]
    assert not empty, "dashboard queries with no data:\n  " + "\n  ".join(empty)

    [annotation] = [expr for title, expr in dashboard_queries() if title == "annotation: Recoveries"]
    assert [s["metric"]["cause"] for s in prometheus.query(annotation)] == ["death"]
    [evicted] = prometheus.query('increase(elastic_evictions_total{cause="death"}[1h])')
    assert float(evicted["value"][1]) > 0

    # What the endpoint serves once the run has ended (while it lingers) is the summary's figures.
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        samples = {(sample.name, sample.labels.get("category")): sample.value
                   for family in text_string_to_metric_families(response.read().decode())
                   for sample in family.samples}
    assert samples[("elastic_goodput_ratio", None)] == pytest.approx(result.summary["goodput"], rel=1e-9)
    for category, seconds in result.summary["time_breakdown"].items():
        if category != "wall_s":
            assert samples[("elastic_time_seconds", category)] == pytest.approx(seconds, rel=1e-9, abs=1e-9), category

    scraped = set(prometheus.api("label/__name__/values"))
    used = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    assert used <= scraped, f"the dashboard uses metrics the run did not export: {sorted(used - scraped)}"


def test_the_step_gauge_and_the_committed_counter_agree(tmp_path):
    from prometheus_client import CollectorRegistry

    from elastic.outputs.metrics import Metrics
    from tests.test_controller_scenarios import Scenario

    scenario = Scenario(tmp_path, steps=3)
    registry = CollectorRegistry()
    metrics = Metrics("t", registry)
    scenario.controller.step_listeners.append(lambda record: metrics.on_step(record, scenario.ledger))
    assert scenario.run() == "completed"
    assert registry.get_sample_value("elastic_step") == registry.get_sample_value("elastic_steps_committed_total") == 3


def test_a_learner_lost_inside_a_round_counts_as_a_round_redone_or_as_learners_dropped():
    from prometheus_client import CollectorRegistry

    from elastic.core.events import EventKind
    from elastic.outputs.metrics import Metrics

    registry = CollectorRegistry()
    metrics = Metrics("t", registry)
    assert registry.get_sample_value("elastic_rounds_redone_total") == 0
    metrics.on_event({"t": 1.0, "kind": EventKind.ROUND_REDONE, "step": 4, "groups": [1, 2], "rolled_back_steps": 2,
                      "seconds": 0.1})
    metrics.on_event({"t": 2.0, "kind": EventKind.LEARNER_DROPPED, "step": 9, "groups": [0, 2], "round_start": 8,
                      "returned_samples": 64})
    assert registry.get_sample_value("elastic_rounds_redone_total") == 1
    assert registry.get_sample_value("elastic_learners_dropped_total") == 2


def test_every_failure_cause_has_its_series_from_the_start_and_counts_its_diagnoses():
    """One series per cause a failure can be diagnosed with, at 0 before any failure: those
    the run recovers from and those that stop it (own-data, own-code)."""
    from prometheus_client import CollectorRegistry

    from elastic.core.diagnosis import Cause
    from elastic.core.events import EventKind
    from elastic.outputs.metrics import Metrics

    registry = CollectorRegistry()
    metrics = Metrics("t", registry)
    causes = {Cause.DEATH, Cause.HANG, Cause.OWN_ERROR, Cause.OWN_DATA, Cause.OWN_CODE, Cause.COLLECTIVE_ERROR,
              Cause.CONTROL_ERROR, Cause.INTEGRITY_MISMATCH}
    for cause in causes:
        assert registry.get_sample_value("elastic_failures_total", {"cause": cause}) == 0, cause
    metrics.on_event({"t": 1.0, "kind": EventKind.FAILURE_DIAGNOSED, "cause": Cause.OWN_DATA, "work": "step",
                      "step": 4, "culprits": {3: Cause.OWN_DATA}})
    assert registry.get_sample_value("elastic_failures_total", {"cause": "own-data"}) == 1

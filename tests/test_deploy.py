"""Static checks of deploy/: KubeRay manifests against the CRD schemas, the training config they
point at, the Grafana dashboard against the metrics elastic/outputs/metrics.py exports, and the
PodMonitor against the head pod it scrapes, and docs/monitoring.md's metric table against the same
metrics; token authentication on every Ray container, the NetworkPolicy against the pods and
ports of the manifests, and the shutdown budget against the kill deadlines. Fast: no network,
no Ray, no Kubernetes.

``dashboard_queries()`` is also used by tests that evaluate every query on a real Prometheus.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
RAYJOB = DEPLOY / "kuberay" / "rayjob.yaml"
RAYCLUSTER = DEPLOY / "kuberay" / "raycluster.yaml"
TRAIN_TOML = DEPLOY / "kuberay" / "train.toml"
PODMONITOR = DEPLOY / "kuberay" / "podmonitor.yaml"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "elastic-dashboard.json"

CRD_FILES = {"RayJob": "ray.io_rayjobs.yaml", "RayCluster": "ray.io_rayclusters.yaml"}
IMAGE_ROOT = "/app"  # deploy/Dockerfile copies the repository here

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB each


def load_yaml(path: Path):
    return yaml.load(path.read_text(), Loader=_Loader)


# --------------------------------------------------------------------------- Grafana helpers

# Grafana variables replaced by concrete values, so a query can be sent to Prometheus as is.
GRAFANA_SUBSTITUTIONS = {
    "job": ".+",  # used as {job=~"$job"}: match every job
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "1h",
}


def substitute_variables(expr: str) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if name not in GRAFANA_SUBSTITUTIONS:
            raise KeyError(f"unknown Grafana variable ${name} in {expr!r}")
        return GRAFANA_SUBSTITUTIONS[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, expr)


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict | None = None) -> list[dict]:
    """Every non-row panel, including those nested in collapsed rows."""
    dashboard = dashboard or load_dashboard()
    out = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def dashboard_queries(raw: bool = False) -> list[tuple[str, str]]:
    """(title, PromQL expr) for every panel target and every Prometheus annotation of the
    dashboard. Annotation titles are ``"annotation: <name>"``. By default Grafana variables
    ($job, $__rate_interval, $__range, ...) are substituted so each expr is plain PromQL;
    ``raw=True`` returns the exprs exactly as stored."""
    dashboard = load_dashboard()
    queries = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if target.get("expr"):
                queries.append((panel["title"], target["expr"]))
    for annotation in dashboard.get("annotations", {}).get("list", []):
        if annotation.get("expr"):
            queries.append((f"annotation: {annotation['name']}", annotation["expr"]))
    if raw:
        return queries
    return [(title, substitute_variables(expr)) for title, expr in queries]


_STRING_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_ELASTIC_NAME = re.compile(r"(?<![\w:])elastic_[A-Za-z0-9_]*")


def metric_names(expr: str) -> set[str]:
    """Metric names (``elastic_*`` identifiers) in a PromQL expr, ignoring string literals."""
    return set(_ELASTIC_NAME.findall(_STRING_LITERAL.sub('""', expr)))


@functools.lru_cache(maxsize=1)
def exported_metrics() -> dict[str, tuple[str, set[str]]]:
    """family name -> (type, names of the samples it exposes), from elastic.outputs.metrics itself.
    Derived from family name and type, because a labelled metric without children exposes no
    sample at all: counter -> name_total, histogram -> name_bucket/_sum/_count, gauge -> name."""
    from elastic.outputs.metrics import Metrics

    metrics = Metrics("test")
    families = {}
    for family in metrics.registry.collect():
        if family.type == "counter":
            names = {family.name + "_total"}
        elif family.type == "histogram":
            names = {family.name + suffix for suffix in ("_bucket", "_sum", "_count")}
        elif family.type in {"gauge", "untyped"}:
            names = {family.name}
        else:  # summary, info, ... : not used by elastic/outputs/metrics.py today
            raise AssertionError(f"{family.name}: unhandled metric type {family.type}")
        families[family.name] = (family.type, names)
    return families


# --------------------------------------------------------------------------- CRD -> JSON Schema

_SCHEMA_MAP_KEYS = {"properties", "patternProperties", "definitions"}
_SCHEMA_KEYS = {"items", "additionalProperties", "not"}
_SCHEMA_LIST_KEYS = {"allOf", "anyOf", "oneOf"}
_DROPPED_KEYS = {"nullable", "description", "default", "example", "externalDocs"}


def openapi_to_jsonschema(node: dict, strict: bool = True) -> dict:
    """Convert a CRD's structural OpenAPI v3 schema into a Draft 7 JSON Schema.

    - ``x-kubernetes-*`` keys are dropped (list/map types, CEL validations: not checkable here);
      ``x-kubernetes-int-or-string: true`` becomes ``type: [integer, string]``;
      ``x-kubernetes-preserve-unknown-fields: true`` keeps unknown fields allowed;
      ``x-kubernetes-embedded-resource: true`` allows apiVersion/kind/metadata.
    - ``nullable: true`` adds ``null`` to the type.
    - ``strict``: an object schema that lists ``properties`` rejects other keys, as the API server
      does with strict field validation (the kubectl default), so a misspelt field fails instead of
      being silently pruned.
    - ``format`` (int32, int64, ...) is kept for the format checker in :func:`validator`.
    """
    if not isinstance(node, dict):
        return node
    out: dict = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in _DROPPED_KEYS:
            continue
        if key in _SCHEMA_MAP_KEYS:
            out[key] = {name: openapi_to_jsonschema(sub, strict) for name, sub in value.items()}
        elif key in _SCHEMA_KEYS and isinstance(value, dict):
            out[key] = openapi_to_jsonschema(value, strict)
        elif key in _SCHEMA_LIST_KEYS:
            out[key] = [openapi_to_jsonschema(sub, strict) for sub in value]
        else:  # type, required, enum, pattern, format, minimum, maxLength, ...
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string") and "type" not in out:
        out["type"] = ["integer", "string"]
    if node.get("nullable") and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = [*types, "null"]
    if node.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {}).update(
            {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}}
        )
    if (
        strict
        and "properties" in out
        and "additionalProperties" not in out
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _format_checker() -> jsonschema.FormatChecker:
    checker = jsonschema.FormatChecker()
    for name, bits in (("int32", 32), ("int64", 64)):

        def check(value, bits=bits) -> bool:
            if isinstance(value, bool) or not isinstance(value, int):
                return True  # the type keyword reports non-integers
            return -(2 ** (bits - 1)) <= value < 2 ** (bits - 1)

        checker.checks(name)(check)
    return checker


# The KubeRay CRDs, vendored (see kuberay_crds/README.md for their source and licence).
CRD_DIR = Path(__file__).resolve().parent / "kuberay_crds"


@functools.lru_cache(maxsize=None)
def validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    """A validator for ``kind`` at ``api_version`` (group/version) from the KubeRay CRD."""
    crd = load_yaml(CRD_DIR / CRD_FILES[kind])
    group, _, version = api_version.partition("/")
    assert crd["spec"]["group"] == group, f"{kind}: CRD group {crd['spec']['group']} != {group}"
    assert crd["spec"]["names"]["kind"] == kind
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    assert version in versions, f"{kind}: the CRD serves {sorted(versions)}, not {version}"
    assert versions[version].get("served", True), f"{kind} {version} is not served"
    schema = openapi_to_jsonschema(versions[version]["schema"]["openAPIV3Schema"])
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema, format_checker=_format_checker())


def schema_errors(manifest: dict) -> list[str]:
    check = validator(manifest["kind"], manifest["apiVersion"])
    return [
        f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(check.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    ]


# --------------------------------------------------------------------------- manifest helpers


def rayjob() -> dict:
    return load_yaml(RAYJOB)


def raycluster() -> dict:
    return load_yaml(RAYCLUSTER)


def head_container(cluster_spec: dict) -> dict:
    containers = cluster_spec["headGroupSpec"]["template"]["spec"]["containers"]
    return containers[0]


def entrypoint_args(job: dict) -> tuple[list[str], dict[str, str]]:
    """The entrypoint as argv, and its ``--flag value`` options."""
    argv = shlex.split(job["spec"]["entrypoint"])
    options = {}
    for index, token in enumerate(argv):
        if token.startswith("--") and index + 1 < len(argv) and not argv[index + 1].startswith("--"):
            options[token] = argv[index + 1]
    return argv, options


def train_config():
    from elastic.setup.preflight import load_config

    return load_config(TRAIN_TOML)


def env_names(container: dict) -> dict[str, dict]:
    return {item["name"]: item for item in container.get("env", [])}


# --------------------------------------------------------------------------- (a) CRD schemas


@pytest.mark.parametrize("path", [RAYJOB, RAYCLUSTER], ids=lambda p: p.name)
def test_manifest_validates_against_kuberay_crd(path):
    manifest = load_yaml(path)
    assert manifest["apiVersion"] == "ray.io/v1"
    assert manifest["metadata"]["name"]
    errors = schema_errors(manifest)
    assert not errors, f"{path.name} does not validate against its CRD:\n  " + "\n  ".join(errors)


_DELETE = object()


def _set(manifest: dict, path: tuple, value) -> dict:
    """A copy of ``manifest`` with the node at ``path`` (keys and list indices) replaced or deleted."""
    broken = copy.deepcopy(manifest)
    node = broken
    for part in path[:-1]:
        node = node[part]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return broken


_CLUSTER = ("spec", "rayClusterSpec")
_HEAD = (*_CLUSTER, "headGroupSpec")
_WORKER = (*_CLUSTER, "workerGroupSpecs", 0)
_WORKER_CONTAINER = (*_WORKER, "template", "spec", "containers", 0)

BROKEN_RAYJOBS = {
    "bool as string": (("spec", "shutdownAfterJobFinishes"), "yes"),
    "int as string": (("spec", "backoffLimit"), "3"),
    "int32 overflow": (("spec", "ttlSecondsAfterFinished"), 2**40),
    "misspelt field": (("spec", "shutdownAfterJobFinish"), True),
    "int rayStartParam": ((*_HEAD, "rayStartParams", "num-gpus"), 0),
    "fractional replicas": ((*_WORKER, "replicas"), 2.5),
    "missing groupName": ((*_WORKER, "groupName"), _DELETE),
    "bad quantity": ((*_WORKER_CONTAINER, "resources", "limits", "nvidia.com/gpu"), "eight"),
    "port as string": ((*_HEAD, "template", "spec", "containers", 0, "ports", 0, "containerPort"), "6379"),
    "unknown container field": ((*_WORKER_CONTAINER, "imagePullPolicyy"), "Always"),
    "bad upscalingMode": ((*_CLUSTER, "autoscalerOptions", "upscalingMode"), "Eager"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_RAYJOBS))
def test_broken_rayjob_fails_validation(case):
    """The validator is real: each deliberately broken copy of rayjob.yaml is rejected."""
    path, value = BROKEN_RAYJOBS[case]
    assert schema_errors(_set(rayjob(), path, value)), f"broken rayjob.yaml ({case}) passed validation"


def test_broken_raycluster_fails_validation():
    assert schema_errors(_set(raycluster(), ("spec", "workerGroupSpecs", 0, "maxReplicas"), "4"))
    assert schema_errors(_set(raycluster(), ("spec", "headGroupSpec", "template"), _DELETE))


def test_openapi_conversion_quirks():
    schema = openapi_to_jsonschema(
        {
            "type": "object",
            "properties": {
                "q": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
                "p": {"x-kubernetes-int-or-string": True},
                "t": {"type": "string", "format": "date-time", "nullable": True},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {}},
                "default": {"type": "integer", "description": "a field named like a keyword"},
            },
        }
    )
    check = jsonschema.Draft7Validator(schema, format_checker=_format_checker())
    assert not list(check.iter_errors({"q": 1, "p": "50%", "t": None, "free": {"x": 1}, "default": 3}))
    assert list(check.iter_errors({"p": 1.5}))
    assert list(check.iter_errors({"unknown": 1}))
    assert list(check.iter_errors({"default": "3"}))


# --------------------------------------------------------------------------- (b) RayJob semantics


def test_rayjob_lifecycle_and_retries():
    spec = rayjob()["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["backoffLimit"], int) and spec["backoffLimit"] >= 1
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    assert spec.get("submissionMode") == "K8sJobMode"
    # The driver must stay on the head pod, where the metrics port is exposed.
    for key in ("entrypointNumCpus", "entrypointNumGpus", "entrypointResources"):
        assert key not in spec, f"{key} could move the driver off the head pod"
    assert spec["rayClusterSpec"]["enableInTreeAutoscaling"] is True


def test_rayjob_entrypoint_trains_on_s3():
    job = rayjob()
    argv, options = entrypoint_args(job)
    assert argv[:4] == ["python", "-m", "elastic", "train"]
    assert options["--storage"].startswith("s3://"), options["--storage"]
    assert options.get("--run-name"), "retries resume only when the run name is fixed"
    assert options["--metrics-host"] == "0.0.0.0"
    assert int(options["--checkpoint-every"]) > 0
    config_path = options["--config"]
    assert config_path.startswith(IMAGE_ROOT + "/")
    assert (REPO / config_path.removeprefix(IMAGE_ROOT + "/")) == TRAIN_TOML


def test_train_toml_is_a_valid_gpu_config():
    config = train_config()
    _, options = entrypoint_args(rayjob())
    assert config.scaling.device == "cuda" and config.scaling.gpus_per_rank == 1
    assert (config.scaling.shard, config.scaling.tp) == (4, 2)
    assert config.storage.startswith("s3://") and config.storage == options["--storage"]
    assert config.run_name == options["--run-name"]
    assert config.metrics.port == int(options["--metrics-port"])
    assert config.checkpoint.every == int(options["--checkpoint-every"])
    assert config.checkpoint.keep == int(options["--keep"])


def test_entrypoint_parses_with_the_real_cli():
    """The RayJob's command line, through elastic's own parser, gives a valid S3/GPU config."""
    from elastic.cli import build_parser, train_overrides
    from elastic.setup.preflight import load_config

    argv, _ = entrypoint_args(rayjob())
    args = build_parser().parse_args(argv[3:])  # after `python -m elastic`
    assert args.command == "train"
    config = load_config(TRAIN_TOML, train_overrides(args))
    assert config.storage == "s3://elastic-checkpoints/runs"
    assert config.run_name == "llama-elastic"
    assert (config.metrics.host, config.metrics.port) == ("0.0.0.0", 9400)
    assert (config.checkpoint.every, config.checkpoint.keep) == (50, 3)
    assert config.scaling.uses_gpu


def test_cluster_shape_fits_the_training_layout():
    cluster = rayjob()["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in head_container(cluster).get("resources", {}).get("limits", {})

    (workers,) = [g for g in cluster["workerGroupSpecs"] if g["groupName"] == "gpu-workers"]
    gpus = int(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    scaling = train_config().scaling
    group_gpus = scaling.shard * scaling.tp * scaling.gpus_per_rank
    # A group's TP ranks must share a node: one pod holds whole groups.
    assert gpus % group_gpus == 0, f"{gpus} GPUs per pod do not hold whole {group_gpus}-GPU groups"
    groups_per_pod = gpus // group_gpus
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]
    assert workers["minReplicas"] * groups_per_pod >= scaling.min_groups
    assert workers["maxReplicas"] * groups_per_pod == scaling.max_groups  # more pods would hold no group
    cpus = float(workers["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
    assert cpus >= groups_per_pod * scaling.shard * scaling.tp * scaling.cpus_per_rank


def test_pods_get_s3_credentials_from_a_secret():
    cluster = rayjob()["spec"]["rayClusterSpec"]
    containers = [head_container(cluster)] + [
        g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]
    ]
    for container in containers:
        env = env_names(container)
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert "secretKeyRef" in env[name]["valueFrom"], f"{container['name']}: {name} not from a Secret"
        assert "AWS_REGION" in env
        if "AWS_ENDPOINT_URL" in env:
            assert env["AWS_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"].get("optional") is True


def test_the_driver_signs_checkpoints_with_a_key_from_a_secret():
    from checkpointing.signing import SIGNING_KEY_ENV

    for cluster in (rayjob()["spec"]["rayClusterSpec"], raycluster()["spec"]):
        env = env_names(head_container(cluster))  # the driver runs on the head
        ref = env[SIGNING_KEY_ENV]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "elastic-checkpoint-key" and not ref.get("optional")


def test_raycluster_has_the_rayjob_shape():
    job_cluster = rayjob()["spec"]["rayClusterSpec"]
    cluster = raycluster()["spec"]
    assert cluster == job_cluster, "raycluster.yaml drifted from rayjob.yaml's rayClusterSpec"


def test_container_ports_are_valid_service_names():
    cluster = rayjob()["spec"]["rayClusterSpec"]
    containers = [head_container(cluster)] + [
        g["template"]["spec"]["containers"][0] for g in cluster["workerGroupSpecs"]
    ]
    for container in containers:
        names = [port["name"] for port in container.get("ports", [])]
        assert len(names) == len(set(names))
        for name in names:  # IANA_SVC_NAME, which the CRD schema does not check
            assert len(name) <= 15 and re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", name), name
            assert re.search(r"[a-z]", name) and "--" not in name, name


def test_image_matches_dockerfile():
    dockerfile = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+(\S+)", dockerfile, re.M).group(1)
    cluster = rayjob()["spec"]["rayClusterSpec"]
    assert base.startswith(f"rayproject/ray:{cluster['rayVersion']}-"), base
    assert re.search(r"torch==\$\{TORCH_VERSION\}|torch==2\.13\.0", dockerfile)
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", dockerfile, re.M)
    assert re.search(r"^COPY\b.*\s\.\s+/app$", dockerfile, re.M)
    assert re.search(r"^WORKDIR /app$", dockerfile, re.M)
    assert re.search(r"^RUN pip install .*\s/app$", dockerfile, re.M)
    images = {c["image"] for c in [head_container(cluster)]} | {
        c["image"] for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]
    }
    assert len(images) == 1, f"head and workers must run the same image: {images}"


# --------------------------------------------------------------------------- (c) dashboard


def test_dashboard_structure():
    dashboard = load_dashboard()
    assert dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    job = variables["job"]
    assert job["type"] == "query"
    query = job["query"]["query"] if isinstance(job["query"], dict) else job["query"]
    assert query == "label_values(elastic_generation, job)"

    panels = dashboard_panels(dashboard)
    ids = [p["id"] for p in dashboard["panels"]] + [p["id"] for p in panels if p not in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("targets"), f"{panel['title']}: no query"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"{panel['title']}: empty expr"
            assert target.get("datasource", panel["datasource"])["uid"] == "${datasource}"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), f"{panel['title']}: duplicate refIds"

    (recoveries,) = [a for a in dashboard["annotations"]["list"] if a.get("name") == "Recoveries"]
    assert recoveries["enable"] is True
    assert metric_names(recoveries["expr"]) & {"elastic_recoveries_total", "elastic_generation"}


def test_dashboard_queries_use_only_exported_metrics():
    exported = set().union(*(names for _, names in exported_metrics().values()))
    dashboard = load_dashboard()
    variable_queries = [
        ("variable: " + v["name"], v["query"]["query"] if isinstance(v["query"], dict) else v["query"])
        for v in dashboard["templating"]["list"]
        if v["type"] == "query"
    ]
    unknown = {
        (title, name)
        for title, expr in dashboard_queries(raw=True) + variable_queries
        for name in metric_names(expr)
        if name not in exported
    }
    assert not unknown, f"queries use metrics elastic/outputs/metrics.py does not export: {sorted(unknown)}"


def test_dashboard_covers_every_exported_metric():
    used = set().union(*(metric_names(expr) for _, expr in dashboard_queries(raw=True)))
    missing = sorted(family for family, (_, names) in exported_metrics().items() if not names & used)
    assert not missing, f"metrics with no dashboard panel: {missing}"


def test_dashboard_promql_is_well_formed():
    kinds = {name: kind for kind, names in exported_metrics().values() for name in names}
    for title, expr in dashboard_queries(raw=True):
        stripped = _STRING_LITERAL.sub('""', expr)
        assert stripped.count('"') % 2 == 0, f"{title}: unbalanced quotes in {expr!r}"
        for open_, close in ("()", "[]", "{}"):
            depth = 0
            for char in stripped:
                depth += (char == open_) - (char == close)
                assert depth >= 0, f"{title}: unbalanced {open_}{close} in {expr!r}"
            assert depth == 0, f"{title}: unbalanced {open_}{close} in {expr!r}"
        # Every elastic_* selector is filtered by the dashboard's job.
        for match in re.finditer(r"(?<![\w:])(elastic_\w+)(\{[^}]*\})?", stripped):
            assert match.group(2) and "job=~" in match.group(2), (
                f"{title}: {match.group(1)} lacks the {{job=~\"$job\"}} filter"
            )
        # rate/increase only over counters and histogram series; quantiles only over buckets by le.
        for func, name in re.findall(r"\b(rate|irate|increase)\(\s*(elastic_\w+)", stripped):
            assert kinds[name] in {"counter", "histogram"}, f"{title}: {func}() over gauge {name}"
        if "histogram_quantile" in stripped:
            assert "_bucket" in stripped and re.search(r"by \([^)]*\ble\b", stripped), (
                f"{title}: histogram_quantile needs *_bucket aggregated by le"
            )
        plain = substitute_variables(expr)
        assert "$" not in plain, f"{title}: unsubstituted variable in {plain!r}"


def test_dashboard_queries_helper():
    queries = dashboard_queries()
    titles = {title for title, _ in queries}
    assert "annotation: Recoveries" in titles
    assert all("$" not in expr for _, expr in queries)
    assert any('job=~".+"' in expr for _, expr in queries)
    assert len(queries) == len(dashboard_queries(raw=True))


# --------------------------------------------------------------------------- (d) PodMonitor


def test_podmonitor_scrapes_the_driver_metrics_port():
    monitor = load_yaml(PODMONITOR)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    selector = monitor["spec"]["selector"]
    labels = selector.get("matchLabels", {})
    assert labels.get("ray.io/node-type") == "head"
    assert any(
        e["key"] == "ray.io/cluster" and e["operator"] in {"Exists", "In"} for e in selector.get("matchExpressions", [])
    ) or "ray.io/cluster" in labels

    # KubeRay sets ray.io/* on every pod; any other label must come from the head pod template.
    kuberay_labels = {"ray.io/node-type", "ray.io/cluster", "ray.io/group", "ray.io/is-ray-node"}
    _, options = entrypoint_args(rayjob())
    port = int(options["--metrics-port"])
    for cluster in (rayjob()["spec"]["rayClusterSpec"], raycluster()["spec"]):
        template_labels = cluster["headGroupSpec"]["template"]["metadata"]["labels"]
        for key, value in labels.items():
            assert key in kuberay_labels or template_labels.get(key) == value, (key, value)
        ports = {p["name"]: p["containerPort"] for p in head_container(cluster)["ports"]}
        assert ports["elastic-metrics"] == port

    endpoints = {e["port"]: e for e in monitor["spec"]["podMetricsEndpoints"]}
    assert endpoints["elastic-metrics"].get("path", "/metrics") == "/metrics"
    assert "metrics" in endpoints, "Ray's own metrics endpoint (port 8080, name metrics)"
    ports = {p["name"]: p["containerPort"] for p in head_container(rayjob()["spec"]["rayClusterSpec"])["ports"]}
    assert ports["metrics"] == 8080


def test_prometheus_config_scrapes_the_local_driver():
    config = load_yaml(PROMETHEUS)
    (job,) = [j for j in config["scrape_configs"] if any(
        "localhost:9400" in s["targets"] for s in j.get("static_configs", []))]
    assert job.get("scrape_interval", config["global"]["scrape_interval"]) == "5s"
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_the_monitoring_page_lists_every_exported_metric():
    page = (REPO / "docs" / "monitoring.md").read_text()
    listed = set(re.findall(r"^\| `(elastic_\w+)` \|", page, flags=re.MULTILINE))
    exported = {
        family + "_total" if kind == "counter" else family for family, (kind, _) in exported_metrics().items()
    }
    assert listed == exported, f"docs/monitoring.md metric table: missing {sorted(exported - listed)}, stale {sorted(listed - exported)}"


# --------------------------------------------------------------------------- (e) closed doors

NETWORKPOLICY = DEPLOY / "kuberay" / "networkpolicy.yaml"

# Seconds between the end of the final checkpoint and the driver being gone: process exit, the
# run summary written to S3, Ray tearing the job down, signal delivery. Stated in train.toml too.
SHUTDOWN_MARGIN_S = 30.0
POD_DEFAULT_GRACE_S = 30  # Kubernetes' terminationGracePeriodSeconds when unset
RAY_DEFAULT_JOB_STOP_WAIT_S = 3  # Ray's JobSupervisor.DEFAULT_RAY_JOB_STOP_WAIT_TIME_S

# Labels KubeRay puts on every Ray pod it creates, whatever the pod template says.
KUBERAY_POD_LABELS = {"ray.io/is-ray-node": "yes"}
RAY_AUTH_TOKEN_KEY = "auth_token"  # the Secret key KubeRay's authOptions.secretName reads


def cluster_specs() -> dict[str, dict]:
    return {RAYJOB.name: rayjob()["spec"]["rayClusterSpec"], RAYCLUSTER.name: raycluster()["spec"]}


def pod_templates(cluster_spec: dict) -> dict[str, dict]:
    """Pod template of the head and of every worker group, by group name."""
    templates = {"head": cluster_spec["headGroupSpec"]["template"]}
    for group in cluster_spec["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    return templates


def ray_containers(cluster_spec: dict) -> dict[str, dict]:
    """The Ray container (index 0, as KubeRay reads it) of every pod template."""
    return {group: template["spec"]["containers"][0] for group, template in pod_templates(cluster_spec).items()}


def effective_train_config():
    """train.toml with the RayJob entrypoint's flags applied, through elastic's own CLI."""
    from elastic.cli import build_parser, train_overrides
    from elastic.setup.preflight import load_config

    argv, _ = entrypoint_args(rayjob())
    return load_config(TRAIN_TOML, train_overrides(build_parser().parse_args(argv[3:])))


def kill_deadlines(cluster_spec: dict) -> dict[str, float]:
    """Every deadline after which a stopping driver (or the ranks saving for it) is SIGKILLed."""
    deadlines = {
        f"{group} terminationGracePeriodSeconds": template["spec"].get(
            "terminationGracePeriodSeconds", POD_DEFAULT_GRACE_S
        )
        for group, template in pod_templates(cluster_spec).items()
    }
    # `ray job stop` runs in the JobSupervisor, on the head with the driver: the head's env counts.
    head_env = env_names(head_container(cluster_spec))
    wait = head_env.get("RAY_JOB_STOP_WAIT_TIME_S", {"value": RAY_DEFAULT_JOB_STOP_WAIT_S})
    deadlines["head RAY_JOB_STOP_WAIT_TIME_S"] = int(wait["value"])  # Ray parses it with int()
    return deadlines


def shutdown_budget_problems(config, cluster_spec: dict) -> list[str]:
    grace = config.checkpoint.grace_s
    longest_step = config.fault_tolerance.min_deadline_s  # the longest expected step, see train.toml
    budget = grace + longest_step + SHUTDOWN_MARGIN_S
    return [
        f"{name} = {deadline} s is not above checkpoint.grace_s {grace:g} + longest step "
        f"(fault_tolerance.min_deadline_s) {longest_step:g} + margin {SHUTDOWN_MARGIN_S:g} = {budget:g} s"
        for name, deadline in kill_deadlines(cluster_spec).items()
        if not budget < deadline
    ]


@pytest.mark.parametrize("manifest", [RAYJOB.name, RAYCLUSTER.name])
def test_shutdown_budget_fits_the_kill_deadlines(manifest):
    """A stop (SIGTERM) finishes the step in flight, then the final checkpoint gets grace_s: the
    driver must be done before the pod is killed and before `ray job stop` SIGKILLs it."""
    problems = shutdown_budget_problems(effective_train_config(), cluster_specs()[manifest])
    assert not problems, f"{manifest}:\n  " + "\n  ".join(problems)


def test_shutdown_budget_check_is_real():
    config, cluster = effective_train_config(), cluster_specs()[RAYJOB.name]
    longer_grace = config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update={"grace_s": 1000.0})})
    assert shutdown_budget_problems(longer_grace, cluster)
    for path, value in (
        (("headGroupSpec", "template", "spec", "terminationGracePeriodSeconds"), 90),
        (("workerGroupSpecs", 0, "template", "spec", "terminationGracePeriodSeconds"), _DELETE),  # default 30 s
        (("headGroupSpec", "template", "spec", "containers", 0, "env"), []),  # Ray's default wait, 3 s
    ):
        assert shutdown_budget_problems(config, _set(cluster, path, value)), path


def auth_problems(cluster_spec: dict) -> list[str]:
    auth = cluster_spec.get("authOptions") or {}
    secret = auth.get("secretName")
    problems = []
    if auth.get("mode") != "token":
        problems.append(f"authOptions.mode is {auth.get('mode')!r}, not 'token'")
    if not secret:
        problems.append("authOptions.secretName is not set: KubeRay would make a new token per cluster")
    rv = tuple(int(part) for part in cluster_spec["rayVersion"].split(".")[:2])
    if rv < (2, 52):
        problems.append(f"rayVersion {cluster_spec['rayVersion']} has no token authentication (2.52+)")
    for group, container in ray_containers(cluster_spec).items():
        env = env_names(container)
        mode = env.get("RAY_AUTH_MODE", {})
        if mode.get("value") != "token" or "valueFrom" in mode:
            problems.append(f"{group}: RAY_AUTH_MODE is {mode!r}, not the literal 'token'")
        token = env.get("RAY_AUTH_TOKEN", {})
        ref = token.get("valueFrom", {}).get("secretKeyRef", {})
        if "value" in token or not ref:
            problems.append(f"{group}: RAY_AUTH_TOKEN does not come from a Secret: {token!r}")
        elif (ref.get("name"), ref.get("key")) != (secret, RAY_AUTH_TOKEN_KEY) or ref.get("optional"):
            problems.append(f"{group}: RAY_AUTH_TOKEN reads {ref!r}, not key {RAY_AUTH_TOKEN_KEY} of {secret}")
    for group, template in pod_templates(cluster_spec).items():  # no token in clear anywhere else
        for container in template["spec"].get("containers", []) + template["spec"].get("initContainers", []):
            for item in container.get("env", []):
                if item["name"].startswith("RAY_AUTH_TOKEN") and "value" in item:
                    problems.append(f"{group}/{container['name']}: {item['name']} is a literal")
    return problems


@pytest.mark.parametrize("manifest", [RAYJOB.name, RAYCLUSTER.name])
def test_every_ray_container_gets_the_auth_token_from_a_secret(manifest):
    cluster = cluster_specs()[manifest]
    problems = auth_problems(cluster)
    assert not problems, f"{manifest}:\n  " + "\n  ".join(problems)
    # The manifest tells its reader how to make the Secret and how a submitter passes the token.
    text = (DEPLOY / "kuberay" / manifest).read_text()
    secret = cluster["authOptions"]["secretName"]
    assert f"kubectl create secret generic {secret} --from-literal={RAY_AUTH_TOKEN_KEY}=" in text
    assert "export RAY_AUTH_MODE=token" in text and f"kubectl get secret {secret}" in text


_HEAD_ENV = ("headGroupSpec", "template", "spec", "containers", 0, "env")
_WORKER_SPEC = ("workerGroupSpecs", 0, "template", "spec")

BROKEN_AUTH = {
    "auth disabled": (("authOptions", "mode"), "disabled"),
    "generated secret": (("authOptions", "secretName"), _DELETE),
    "old ray": (("rayVersion",), "2.51.0"),
    "worker without env": ((*_WORKER_SPEC, "containers", 0, "env"), []),
    "literal token": ((*_HEAD_ENV,), [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "value": "t0ken"},
    ]),
    "wrong secret key": ((*_HEAD_ENV,), [
        {"name": "RAY_AUTH_MODE", "value": "token"},
        {"name": "RAY_AUTH_TOKEN", "valueFrom": {"secretKeyRef": {"name": "elastic-ray-auth", "key": "token"}}},
    ]),
    "literal token in an init container": ((*_WORKER_SPEC, "initContainers"), [
        {"name": "init", "image": "busybox", "env": [{"name": "RAY_AUTH_TOKEN", "value": "t0ken"}]},
    ]),
}


@pytest.mark.parametrize("case", sorted(BROKEN_AUTH))
def test_auth_check_is_real(case):
    path, value = BROKEN_AUTH[case]
    assert auth_problems(_set(cluster_specs()[RAYJOB.name], path, value)), case


def load_networkpolicy() -> dict:
    (policy,) = [doc for doc in yaml.load_all(NETWORKPOLICY.read_text(), Loader=_Loader) if doc]
    return policy


def _allows_port(rule: dict, number: int, name: str, protocol: str = "TCP") -> bool:
    if not rule.get("ports"):
        return True  # no ports: every port
    for port in rule["ports"]:
        if port.get("protocol", "TCP") != protocol:
            continue
        if "port" not in port or port["port"] == name:
            return True
        if isinstance(port["port"], int) and port["port"] <= number <= port.get("endPort", port["port"]):
            return True
    return False


def _peer_kind(peer: dict, ray_selector: dict) -> str:
    """'ray' for this cluster's Ray pods; 'named' for pods or namespaces picked by explicit labels;
    'open' for anything wider (an empty selector, an expression, an IP block)."""
    if peer == {"podSelector": ray_selector}:
        return "ray"
    selectors = [peer[key] for key in ("podSelector", "namespaceSelector") if key in peer]
    if set(peer) - {"podSelector", "namespaceSelector"} or not selectors:
        return "open"
    if any(not s.get("matchLabels") or s.get("matchExpressions") for s in selectors):
        return "open"
    return "named"


def exposed_ports() -> dict[tuple[str, int], set[str]]:
    """(port name, number) -> the pod groups exposing it, over both manifests."""
    ports: dict[tuple[str, int], set[str]] = {}
    for manifest, cluster in cluster_specs().items():
        for group, container in ray_containers(cluster).items():
            for port in container.get("ports", []):
                ports.setdefault((port["name"], port["containerPort"]), set()).add(f"{manifest}:{group}")
    return ports


def networkpolicy_problems(policy: dict) -> list[str]:
    problems = []
    if (policy.get("apiVersion"), policy.get("kind")) != ("networking.k8s.io/v1", "NetworkPolicy"):
        return [f"not a networking.k8s.io/v1 NetworkPolicy: {policy.get('apiVersion')} {policy.get('kind')}"]
    spec = policy["spec"]
    selector = spec.get("podSelector", {})
    labels = selector.get("matchLabels", {})
    if not labels or selector.get("matchExpressions"):
        problems.append(f"podSelector {selector!r} must pick the Ray pods by matchLabels only")
    # Every selected label is on every Ray pod of both manifests (template label or KubeRay's).
    for manifest, cluster in cluster_specs().items():
        for group, template in pod_templates(cluster).items():
            pod_labels = {**template.get("metadata", {}).get("labels", {}), **KUBERAY_POD_LABELS}
            for key, value in labels.items():
                if pod_labels.get(key) != value:
                    problems.append(f"{manifest}:{group} pods lack {key}={value}: the policy misses them")
    if not labels.keys() & KUBERAY_POD_LABELS.keys():
        problems.append("podSelector must include a KubeRay Ray-pod label, so it selects Ray pods only")
    if set(spec.get("policyTypes", [])) != {"Ingress", "Egress"}:
        problems.append(f"policyTypes {spec.get('policyTypes')!r}: both Ingress and Egress must be closed")

    ingress = spec.get("ingress", [])
    by_kind: dict[str, list[dict]] = {"ray": [], "named": [], "open": []}
    for rule in ingress:
        peers = rule.get("from")
        if not peers:
            problems.append(f"ingress rule without `from` admits everyone: {rule!r}")
            continue
        for peer in peers:
            by_kind[_peer_kind(peer, selector)].append(rule)
        if any(_peer_kind(p, selector) != "ray" for p in peers) and not rule.get("ports"):
            problems.append(f"ingress rule from outside the cluster opens every port: {rule!r}")
    for rule in by_kind["open"]:
        problems.append(f"ingress peer not named by explicit labels: {rule['from']!r}")

    ports = exposed_ports()
    named = {name: number for name, number in ports}
    for (name, number), groups in ports.items():  # the cluster's own pods reach every port
        if not any(_allows_port(rule, number, name) for rule in by_kind["ray"]):
            problems.append(f"port {name}/{number} ({sorted(groups)}) is closed to the cluster's own Ray pods")

    def outside_rules(port_name: str) -> list[dict]:
        return [r for r in by_kind["named"] if _allows_port(r, named[port_name], port_name)]

    monitor = load_yaml(PODMONITOR)
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:  # Prometheus reaches what it scrapes
        rules = outside_rules(endpoint["port"])
        if not any("namespaceSelector" in peer for rule in rules for peer in rule["from"]):
            problems.append(f"Prometheus (another namespace) cannot scrape port {endpoint['port']}")
    submitter = {"podSelector": {"matchLabels": {"batch.kubernetes.io/job-name": rayjob()["metadata"]["name"]}}}
    dashboard_peers = [peer for rule in outside_rules("dashboard") for peer in rule["from"]]
    if submitter not in dashboard_peers:
        problems.append(f"the RayJob's submitter pod ({submitter}) cannot reach the dashboard port")
    if not any(
        "kuberay-operator" in peer.get("podSelector", {}).get("matchLabels", {}).values() for peer in dashboard_peers
    ):
        problems.append("the KubeRay operator cannot reach the dashboard port (it polls and stops RayJobs there)")
    if outside_rules("gcs-server"):
        problems.append("GCS (gcs-server) is reachable from outside the cluster")

    egress = spec.get("egress", [])

    def egress_allows(number: int, protocol: str) -> bool:
        return any(not rule.get("to") and _allows_port(rule, number, "", protocol) for rule in egress)

    if not any(rule.get("to") == [{"podSelector": selector}] and not rule.get("ports") for rule in egress):
        problems.append("egress to the cluster's own Ray pods is not open on every port")
    for number, protocol, what in ((53, "UDP", "DNS"), (53, "TCP", "DNS"), (443, "TCP", "S3 (HTTPS)")):
        if not egress_allows(number, protocol):
            problems.append(f"egress {what} {number}/{protocol} is blocked")
    if policy["metadata"].get("namespace") != rayjob()["metadata"].get("namespace"):
        problems.append("the policy must live in the namespace of the Ray pods")
    return problems


def test_networkpolicy_closes_the_ray_pods():
    problems = networkpolicy_problems(load_networkpolicy())
    assert not problems, "deploy/kuberay/networkpolicy.yaml:\n  " + "\n  ".join(problems)


_INGRESS = ("spec", "ingress")

BROKEN_NETWORKPOLICIES = {
    "selects other pods": (("spec", "podSelector", "matchLabels", "app.kubernetes.io/part-of"), "other"),
    "ingress only": (("spec", "policyTypes"), ["Ingress"]),
    "open ingress": ((*_INGRESS, 0), {}),
    "cluster limited to gcs": ((*_INGRESS, 0, "ports"), [{"port": 6379}]),
    "no prometheus": ((*_INGRESS, 1), {"from": [{"podSelector": {"matchLabels": {"a": "b"}}}], "ports": [{"port": 1}]}),
    "dashboard from any namespace": ((*_INGRESS, 2, "from", 0, "namespaceSelector"), {}),
    "dashboard from an ip block": ((*_INGRESS, 2, "from"), [{"ipBlock": {"cidr": "0.0.0.0/0"}}]),
    "every port to clients": ((*_INGRESS, 3, "ports"), _DELETE),
    "gcs to clients": ((*_INGRESS, 3, "ports"), [{"port": 6379}, {"port": 8265}]),
    "no dns": (("spec", "egress"), [{"ports": [{"port": 443, "protocol": "TCP"}]}]),
    "no s3": (("spec", "egress"), [{"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}]),
}


@pytest.mark.parametrize("case", sorted(BROKEN_NETWORKPOLICIES))
def test_networkpolicy_check_is_real(case):
    path, value = BROKEN_NETWORKPOLICIES[case]
    assert networkpolicy_problems(_set(load_networkpolicy(), path, value)), case

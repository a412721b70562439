"""k8s/grafana/hybridserve.json: made by its generator, every field one of Grafana's dashboard
schema (its typed models read it back whole), and every query naming metrics and labels the
ingress really exports (a real ServeMetrics, rendered as /metrics renders it)."""

from __future__ import annotations

import json
import re

from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import Dashboard
from prometheus_client.parser import text_string_to_metric_families

from deployments.front import grafana_dashboard
from deployments.front.metrics import ServeMetrics
from deployments.messages import Recovery
from deployments.routing.cost import RouteReason
from deployments.routing.decisions import count_decision
from deployments.turn.lease_keeper import Renewal
from tests.k8s.k8s_helpers import one

METRIC = re.compile(r"\b(?:hybridserve_|vllm:)[a-z0-9_:]+")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
SELECTOR = re.compile(r"\{([^}]*)\}")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def dashboard() -> dict:
    return json.loads(grafana_dashboard.DASHBOARD_PATH.read_text())


def queries() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel.get("targets", [])]


def exported() -> dict[str, set[str]]:
    """{sample name: its label names} from a ServeMetrics that has seen one of everything."""
    metrics = ServeMetrics("model")
    for recovery in Recovery:
        metrics.turn_done(continued=True, cached_tokens=3, recovery=recovery, moved=True, reused_from="head",
                          tool_resume=True, tool_calls=1)
    for source in ("prefix", "system"):
        metrics.turn_done(continued=False, cached_tokens=1, recovery=Recovery.NEW, moved=False, reused_from=source)
    for outcome in Renewal:
        metrics.lease_renewal_rpc(0.01, outcome)
    count_decision(RouteReason.OWNER)
    metrics.requests.labels("200").inc()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_the_committed_dashboard_is_what_the_generator_makes():
    assert grafana_dashboard.DASHBOARD_PATH.read_text() == grafana_dashboard.dashboard_json(), (
        "stale: run python -m deployments.front.grafana_dashboard")


def test_grafana_s_dashboard_model_reads_every_field_back():
    # The typed model keeps only fields of Grafana's schema: anything else would be lost here.
    loaded = Dashboard.from_json(dashboard())
    assert json.loads(json.dumps(loaded, cls=JSONEncoder)) == dashboard()
    ids = [panel["id"] for panel in dashboard()["panels"]]
    assert len(ids) == len(set(ids))


def test_every_query_names_exported_metrics_and_their_labels():
    names = exported()
    assert len(queries()) >= 15
    for expr in queries():
        used = METRIC.findall(expr)
        assert used, expr
        for metric in used:
            assert metric in names, f"{metric} is not exported ({expr})"
        labels = set().union(*(names[m] for m in used)) | {"le"}
        grouped = {label.strip() for match in GROUPING.findall(expr) for label in match.split(",")}
        selected = {part.split("=")[0].rstrip("!~") for match in SELECTOR.findall(expr) for part in match.split(",")}
        assert grouped | selected <= labels, expr


def test_the_dashboard_reaches_grafana_as_a_sidecar_configmap():
    # kube-prometheus-stack's Grafana loads every ConfigMap labelled grafana_dashboard; the manifest
    # tests validate it with the other objects, and check kustomize itself renders it so.
    config_map = one("ConfigMap", "hybridserve-grafana-dashboard")
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert config_map["data"] == {"hybridserve.json": grafana_dashboard.DASHBOARD_PATH.read_text()}

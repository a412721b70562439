"""The Grafana dashboard of the ingress's `/metrics` (k8s/grafana/hybridserve.json), built with
Grafana's own typed builders (grafana-foundation-sdk, a dev dependency) so every field is one of
Grafana's dashboard schema.

    python -m deployments.front.grafana_dashboard      rewrites k8s/grafana/hybridserve.json

What it shows, row by row:

    Latency   TTFT p50/p95 by turn (a reused head keeps later turns flat), TTFT of stateless
              requests, inter-token latency, end-to-end latency
    Cache     prompt tokens served from cached state by source (head, prefix, system prompt) as a
              share of all prompt tokens; continued turns that reused their head; prefix lookups;
              KV cache usage
    Leases    RenewLease latency by outcome, renewals failed or lost, the worst renewal delay,
              turns refused because their conversation was busy
    Tier      heads moved between replicas: tier imports, older heads imported, ledger
              recomputes, migrations; the router's decisions by reason
    Load      requests by status, in flight, waiting and running, tokens per second

Its queries name only metrics the ingress exports (tests/k8s/test_grafana_dashboard.py checks them
against a real ServeMetrics), and one Prometheus data source chosen by the `datasource` variable.
"""

from __future__ import annotations

import json
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "k8s" / "grafana" / "hybridserve.json"
UID = "hybridserve-serving"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
WINDOW = "[$__rate_interval]"
PREFIX_HITS = 'hybridserve_prefix_lookups_total{result="hit"}'
NOT_RENEWED = 'hybridserve_lease_renewal_rpc_seconds_count{outcome!="renewed"}'


def rate(metric: str) -> str:
    return f"rate({metric}{WINDOW})"


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) ({rate(histogram + '_bucket')}))"


def panel(title: str, unit: str, description: str, *queries: tuple[str, str], width: int = 12) -> Panel:
    """A time series of `queries` ((PromQL, legend) pairs)."""
    chart = Panel().title(title).description(description).unit(unit).datasource(DATASOURCE).height(8).span(width)
    for expr, legend in queries:
        chart = chart.with_target(Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE))
    return chart


def latency_panels() -> list[Panel]:
    ttft = "hybridserve_time_to_first_token_seconds"
    return [
        panel("Time to first token by turn", "s", "p50 and p95 per turn range: with the conversation's head "
              "reused, later turns run only their new messages and stay flat",
              (quantile(0.5, ttft, "turn"), "p50 turn {{turn}}"), (quantile(0.95, ttft, "turn"), "p95 turn {{turn}}")),
        panel("Inter-token latency", "s", "between streamed token deltas",
              (quantile(0.5, "hybridserve_inter_token_latency_seconds"), "p50"),
              (quantile(0.95, "hybridserve_inter_token_latency_seconds"), "p95"),
              (quantile(0.95, "vllm:e2e_request_latency_seconds"), "end to end p95")),
    ]


def cache_panels() -> list[Panel]:
    prompt = f"sum({rate('hybridserve_prompt_tokens_total')})"
    return [
        panel("Prompt tokens served from cache, by source", "percentunit", "share of all prompt tokens whose "
              "state came from the conversation's head, a held prefix or a shared system prompt",
              (f"sum by (source) ({rate('hybridserve_cached_tokens_by_source_total')}) / ignoring(source) "
               f"group_left {prompt}", "{{source}}"),
              (f"sum({rate('hybridserve_cached_tokens_total')}) / {prompt}", "all")),
        panel("Head reuse and prefix lookups", "percentunit", "continued turns that reused their committed head; "
              "requests without a head that a held prefix served; KV cache blocks in use",
              (f"sum({rate('hybridserve_cache_hits_total')}) / (sum({rate('hybridserve_cache_hits_total')}) + "
               f"sum({rate('hybridserve_cache_misses_total')}))", "head reused"),
              (f"sum({rate(PREFIX_HITS)}) / sum({rate('hybridserve_prefix_lookups_total')})", "prefix hit"),
              ("avg(vllm:kv_cache_usage_perc)", "KV cache usage")),
    ]


def lease_panels() -> list[Panel]:
    rpc = "hybridserve_lease_renewal_rpc_seconds"
    return [
        panel("Lease renewals", "s", "RenewLease latency by outcome (renewed, failed: retried at the next tick, "
              "lost) and the worst any renewal ran past its time",
              (quantile(0.99, rpc, "outcome"), "p99 {{outcome}}"),
              ("max(hybridserve_lease_renewal_delay_max_seconds)", "worst delay")),
        panel("Renewals not renewed, busy conversations", "reqps", "renewals that failed or found the lease lost; "
              "turns refused because their conversation had a turn in flight",
              (f"sum by (outcome) ({rate(NOT_RENEWED)})", "{{outcome}}"),
              (f"sum({rate('hybridserve_lease_conflicts_total')})", "conversation busy")),
    ]


def tier_panels() -> list[Panel]:
    moves = [("hybridserve_tier_imports_total", "tier import"), ("hybridserve_tier_prefix_imports_total",
             "older head imported"), ("hybridserve_prefix_imports_total", "prefix checkpoint imported"),
             ("hybridserve_ledger_recomputes_total", "ledger recompute"),
             ("hybridserve_migrations_total", "served away from owner")]
    return [
        panel("Heads moved between replicas", "ops", "where a replica without the head got it: the state tier, an "
              "older head plus recompute, or the ledger",
              *((f"sum({rate(metric)})", legend) for metric, legend in moves)),
        panel("Routing decisions", "ops", "why each turn went where it went (owner, owner busy: moved, prefix "
              "holder, least loaded, ...)",
              (f"sum by (reason) ({rate('hybridserve_route_decisions_total')})", "{{reason}}")),
    ]


def load_panels() -> list[Panel]:
    return [
        panel("Requests", "reqps", "chat completions by HTTP status",
              (f"sum by (status) ({rate('hybridserve_requests_total')})", "{{status}}")),
        panel("Queue", "short", "requests admitted at the ingress: waiting for a first token, streaming",
              ("sum(vllm:num_requests_waiting)", "waiting"), ("sum(vllm:num_requests_running)", "running"),
              ("sum(hybridserve_inflight_requests)", "in flight")),
        panel("Tokens", "short", "tokens per second",
              (f"sum({rate('hybridserve_prompt_tokens_total')})", "prompt"),
              (f"sum({rate('hybridserve_output_tokens_total')})", "generated"), width=24),
    ]


def build() -> Dashboard:
    dashboard = (Dashboard("hybridserve").uid(UID).tags(["hybridserve", "llm-serving"]).refresh("30s")
                 .time("now-1h", "now").with_variable(DatasourceVariable("datasource").label("Data source")
                                                      .type("prometheus")))
    rows = [("Latency", latency_panels()), ("Cache", cache_panels()), ("Leases", lease_panels()),
            ("State tier and routing", tier_panels()), ("Load", load_panels())]
    ids = iter(range(1, 100))  # Grafana links and repeats panels by id: one each
    for title, panels in rows:
        dashboard = dashboard.with_row(Row(title).id(next(ids)))
        for chart in panels:
            dashboard = dashboard.with_panel(chart.id(next(ids)))
    return dashboard


def dashboard_json() -> str:
    return json.dumps(build().build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(dashboard_json())
    print(f"wrote {DASHBOARD_PATH}")

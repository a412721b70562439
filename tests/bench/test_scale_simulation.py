"""`python -m bench.scale --quick` at its smallest point: the report's figures are real numbers
and agree with each other and with Redis (every completed turn is in a ledger). Nothing here is a
timing assertion: the figures are the benchmark's own run.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kit.tables import format_number as num
from bench.scale.report import markdown

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("scale")
    subprocess.run([sys.executable, "-m", "bench.scale", "--quick", "--max-points", "1", "--results-dir", str(out)],
                   cwd=ROOT, check=True, timeout=300)
    assert (out / "scale.quick.png").stat().st_size > 0
    return json.loads((out / "scale.quick.json").read_text()), (out / "scale.quick.md").read_text()


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_turns_completed_are_the_turns_in_the_ledgers(results):
    (point,) = results[0]["points"]
    assert point["errors"] == {}
    assert point["turns_completed_all"] > 0
    assert point["turns_completed_all"] == point["turns_in_ledgers"]
    assert 0 < point["turns"] <= point["turns_completed_all"]
    assert 0 < point["conversations_touched"] <= point["point"]["conversations"]


def test_rates_latencies_and_redis_figures_agree(results):
    res, _ = results
    (point,) = res["points"]
    assert math.isclose(point["turns_per_s"], point["turns"] / point["seconds"])
    assert math.isclose(point["turns_per_s_per_instance"] * point["point"]["instances"], point["turns_per_s"])
    for kind in ("acquire", "publish", "tier_put"):
        lat = point["latency"][kind]
        assert lat["count"] > 0 and finite(lat["p50_ms"]) and 0 < lat["p50_ms"] <= lat["p99_ms"], kind
    calls = point["latency"]["acquire"]["count"] + point["latency"]["publish"]["count"]
    redis = point["redis"]
    assert math.isclose(redis["commands_per_turn"] * point["turns"], redis["commands"])
    # Every acquire and publish is one EVALSHA on Redis (renewals and tier marks add more).
    assert redis["evalsha_per_turn"] * point["turns"] >= 0.9 * calls
    assert redis["bytes_in_per_turn"] > 0 and redis["bytes_out_per_turn"] > 0
    tier = point["tier"]
    assert tier["bytes"] == tier["puts"] * res["plan"]["state_bytes"]
    assert math.isclose(tier["MBps"], tier["bytes"] / point["seconds"] / 1e6)
    assert point["route"]["count"] > 0 and finite(point["route"]["mean_ms"])
    assert sum(point["route"]["reasons"].values()) == point["route"]["count"]
    assert all(finite(v) and v >= 0 for v in point["cpu_cores"].values())


def test_sizing_follows_from_the_points_and_the_markdown_from_the_json(results):
    res, md = results
    sizing = res["sizing"]
    assert math.isclose(sizing["demand_turns_per_s"], 1000 * res["cost_model"]["gpu_turns_per_s"])
    assert sizing["instances_needed"] == math.ceil(sizing["demand_turns_per_s"] / sizing["turns_per_instance_core_s"])
    assert sizing["redis_shards_needed"] >= 1 and sizing["router_cores_needed"] > 0
    assert res["env"]["cpu_model"]
    assert md.rstrip("\n") == markdown(res).rstrip("\n")


def test_an_earlier_run_beside_the_results_is_compared_point_by_point(results):
    res, _ = results
    before = copy.deepcopy(res)
    before["points"][0]["turns_per_s_per_instance"] = 12345.0
    before["env"]["git"]["commit"] = "0123456789abcdef"
    md = markdown(res, before)
    assert "## Before and after" not in markdown(res)
    section = md.split("## Before and after", 1)[1].split("\n## ", 1)[0]
    assert "commit 0123456789ab" in section
    rows = [line for line in section.splitlines() if "| before |" in line or "| after |" in line]
    assert len(rows) == 2 * len(res["points"])
    assert "| before | 12,345 |" in section
    assert f"| after | {num(res['points'][0]['turns_per_s_per_instance'], 0)} |" in section

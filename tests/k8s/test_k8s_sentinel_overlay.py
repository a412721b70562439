"""The k8s-sentinel overlay of k8s/: Redis as a primary and two replicas under three sentinels,
the cache service pointed at the sentinels. Valid as the base is, and wired together."""

from __future__ import annotations

import copy
import re
import shutil

import pytest
from kubernetes_validate import validate as k8s_validate

from k8s_helpers import KUBERNETES_VERSION, SENTINEL_OVERLAY, canonical, kustomized, objects, render_overlay

CHANGED = {("StatefulSet", "hybridserve-redis"), ("Service", "hybridserve-redis"), ("Deployment", "hybridserve-cache")}
ADDED = {("ConfigMap", "hybridserve-redis-ha"), ("Service", "hybridserve-sentinel"),
         ("StatefulSet", "hybridserve-sentinel"), ("PodDisruptionBudget", "hybridserve-sentinel"),
         ("PodDisruptionBudget", "hybridserve-redis")}


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render_overlay(SENTINEL_OVERLAY)}


def _container(doc: dict) -> dict:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return copy.deepcopy(c)


def _env(doc: dict) -> dict[str, str | None]:
    return {v["name"]: v.get("value") for v in _container(doc)["env"]}


def test_overlay_adds_the_sentinels_and_changes_only_redis_and_the_cache_service(rendered):
    base = {(m.kind, m.name): m.doc for m in objects()}
    assert set(rendered) == set(base) | ADDED
    assert {key for key in base if rendered[key] != base[key]} == CHANGED


@pytest.mark.parametrize("key", sorted(CHANGED | ADDED), ids=str)
def test_changed_and_added_objects_validate_strictly(rendered, key):
    k8s_validate(rendered[key], KUBERNETES_VERSION, strict=True)


def test_cache_service_finds_the_primary_through_every_sentinel(rendered):
    env = _env(rendered[("Deployment", "hybridserve-cache")])
    assert "REDIS_URL" not in env and "REDIS_PASSWORD" in env
    sentinels = rendered[("StatefulSet", "hybridserve-sentinel")]
    (port,) = rendered[("Service", "hybridserve-sentinel")]["spec"]["ports"]
    name, service = sentinels["metadata"]["name"], sentinels["spec"]["serviceName"]
    assert env["REDIS_SENTINELS"].split(",") == [
        f"{name}-{i}.{service}:{port['port']}" for i in range(sentinels["spec"]["replicas"])]
    script = rendered[("ConfigMap", "hybridserve-redis-ha")]["data"]["sentinel-start.sh"]
    (monitored, quorum) = re.search(r"^sentinel monitor (\S+) \S+ 6379 (\d+)$", script, re.M).groups()
    assert env["REDIS_MASTER_NAME"] == monitored
    assert int(quorum) == sentinels["spec"]["replicas"] // 2 + 1  # a majority: one sentinel may be lost


def test_a_write_waits_for_a_replica_that_remains_after_a_failover(rendered):
    env = _env(rendered[("Deployment", "hybridserve-cache")])
    redis_pods = rendered[("StatefulSet", "hybridserve-redis")]["spec"]["replicas"]
    # Once a replica is promoted, redis_pods - 2 replicas are left to acknowledge writes.
    assert 1 <= int(env["CACHE_PUBLISH_WAIT_REPLICAS"]) <= redis_pods - 2
    assert int(env["CACHE_PUBLISH_WAIT_TIMEOUT_MS"]) > 0


def test_cache_service_settings_are_flags_of_python_m_cache_service(rendered):
    from cache_service.__main__ import build_parser

    known = set(re.findall(r"\[([A-Z_]+)", build_parser().format_help()))
    assert set(_env(rendered[("Deployment", "hybridserve-cache")])) <= known


def test_redis_keeps_the_bases_durability_settings_and_runs_its_scripts(rendered):
    scripts = rendered[("ConfigMap", "hybridserve-redis-ha")]["data"]
    start = scripts["redis-start.sh"]
    for setting in ("--appendonly yes", "--appendfsync always", "--maxmemory-policy noeviction",
                    '--masterauth "$REDIS_PASSWORD"', '--requirepass "$REDIS_PASSWORD"'):
        assert setting in start
    for key in (("StatefulSet", "hybridserve-redis"), ("StatefulSet", "hybridserve-sentinel")):
        spec = rendered[key]["spec"]["template"]["spec"]
        c = _container(rendered[key])
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["scripts"]["configMap"]["name"] == "hybridserve-redis-ha"
        script = c["command"][-1]
        assert script.startswith(mounts["scripts"] + "/") and script.rsplit("/", 1)[1] in scripts
        assert "POD_NAME" in {v["name"] for v in c["env"]}
    # Pods must resolve each other's names before they are ready (a replica syncing).
    for name in ("hybridserve-redis", "hybridserve-sentinel"):
        assert rendered[("Service", name)]["spec"]["publishNotReadyAddresses"] is True


def test_disruption_budgets_select_the_redis_and_sentinel_pods(rendered):
    for name in ("hybridserve-redis", "hybridserve-sentinel"):
        pdb = rendered[("PodDisruptionBudget", name)]["spec"]
        labels = rendered[("StatefulSet", name)]["spec"]["template"]["metadata"]["labels"]
        assert pdb["selector"]["matchLabels"].items() <= labels.items() and pdb["maxUnavailable"] == 1


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to render the overlay with kustomize itself")
def test_kustomize_renders_the_sentinel_overlay_as_the_tests_do(rendered):
    assert kustomized(SENTINEL_OVERLAY) == canonical(rendered.values())

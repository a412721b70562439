"""Offline validation of k8s/: every object against its schema, and the wiring between them."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from urllib.parse import urlsplit

import pytest
import yaml
from kubernetes_validate import ValidationError as K8sValidationError
from kubernetes_validate import validate as k8s_validate

from k8s_helpers import (
    K8S_DIR,
    KUBERNETES_VERSION,
    REPO,
    SECRET_NAME,
    SHARED_CRD,
    containers,
    crd_schema_copy,
    crd_schema_shared,
    load_all,
    manifest_paths,
    objects,
    one,
    pod_specs,
    rayservice_errors,
)

BUILTIN_KINDS = {"ConfigMap", "Service", "StatefulSet", "Deployment", "PersistentVolumeClaim", "PodDisruptionBudget"}


# -- every file parses; every object validates --------------------------------------------------
def test_every_manifest_parses_to_named_objects():
    assert {p.name for p in manifest_paths()} >= {
        "configmap.yaml", "redis.yaml", "cache-service.yaml", "models-pvc.yaml", "rayservice.yaml", "kustomization.yaml",
    }
    seen = set()
    for m in load_all():
        assert {"apiVersion", "kind"} <= m.doc.keys(), m.path
        if m.kind == "Kustomization":
            continue
        key = (m.kind, m.name)
        assert key not in seen, f"{key} defined twice"
        seen.add(key)
    assert {kind for kind, _ in seen} == BUILTIN_KINDS | {"RayService"}


@pytest.mark.parametrize("kind_name", [(m.kind, m.name) for m in objects() if m.kind in BUILTIN_KINDS], ids=str)
def test_builtin_objects_validate_strictly(kind_name):
    k8s_validate(one(*kind_name), KUBERNETES_VERSION, strict=True)


def test_kubernetes_validator_refuses_a_misspelled_field():
    doc = one("Deployment", "hybridserve-cache")
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = doc["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(K8sValidationError):
        k8s_validate(doc, KUBERNETES_VERSION, strict=True)


def test_rayservice_validates_against_the_kuberay_crd():
    assert rayservice_errors(one("RayService")) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        # A typo the API server would drop under non-strict validation.
        (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"].__setitem__("rayStartParam", {}), "rayStartParam"),
        # rayStartParams values are strings in the CRD.
        (lambda d: d["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].__setitem__("num-gpus", 0), "num-gpus"),
        # workerGroupSpecs require groupName.
        (lambda d: d["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
        # serveConfigV2 is a string (YAML inside), not a mapping.
        (lambda d: d["spec"].__setitem__("serveConfigV2", {"applications": []}), "serveConfigV2"),
    ],
    ids=["unknown-field", "non-string-param", "missing-required", "serve-config-not-string"],
)
def test_crd_validation_catches_broken_rayservices(mutate, expected):
    doc = one("RayService")
    mutate(doc)
    errors = rayservice_errors(doc)
    assert errors and any(expected in e for e in errors), errors


@pytest.mark.skipif(not SHARED_CRD.exists(), reason="the shared KubeRay CRD is not beside the repository")
def test_schema_copy_is_the_shared_crd_v1_schema():
    assert crd_schema_copy() == crd_schema_shared()


def test_kustomization_applies_every_manifest_once():
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert sorted(listed) == sorted(p.name for p in manifest_paths() if p.name != "kustomization.yaml")
    # The model volume must exist before the pods that mount it; Redis before its client.
    assert listed.index("redis.yaml") < listed.index("cache-service.yaml") < listed.index("rayservice.yaml")
    assert listed.index("models-pvc.yaml") < listed.index("rayservice.yaml")


# -- the wiring between objects ---------------------------------------------------------------
def test_every_service_selects_a_workload_and_its_named_ports():
    for svc in [m.doc for m in objects() if m.kind == "Service"]:
        selector = svc["spec"]["selector"]
        workloads = [
            m.doc for m in objects()
            if m.kind in ("Deployment", "StatefulSet")
            and selector.items() <= m.doc["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(workloads) == 1, f"Service {svc['metadata']['name']} selects {len(workloads)} workloads"
        (workload,) = workloads
        assert workload["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()
        port_names = {p["name"] for c in workload["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in port_names


def test_configmap_and_secret_references_resolve():
    configmaps = {m.name for m in objects() if m.kind == "ConfigMap"}
    claims = {m.name for m in objects() if m.kind == "PersistentVolumeClaim"}
    documented = set(re.findall(r"--from-literal=([a-z-]+)=", (K8S_DIR / "README.md").read_text()))
    used_keys = set()
    for where, c in containers():
        for src in c.get("envFrom", []):
            assert src["configMapRef"]["name"] in configmaps, where
        for var in c.get("env", []):
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == SECRET_NAME, where
                used_keys.add(ref["key"])
    for where, spec in pod_specs():
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                assert volume["secret"]["secretName"] == SECRET_NAME, where
                used_keys |= {item["key"] for item in volume["secret"]["items"]}
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, where
        mounted = {v["name"] for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in mounted | {t["metadata"]["name"] for t in _claim_templates(where)}, where
    # The guide's `kubectl create secret` makes exactly the keys the manifests read.
    assert used_keys == documented, (used_keys, documented)


def _claim_templates(where: str) -> list[dict]:
    if not where.startswith("StatefulSet/"):
        return []
    return one("StatefulSet", where.split("/")[1])["spec"].get("volumeClaimTemplates", [])


def test_redis_keeps_an_fsynced_aof_on_a_persistent_volume():
    sts = one("StatefulSet", "hybridserve-redis")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    flags = dict(zip(args[::2], args[1::2]))
    assert flags["--appendonly"] == "yes" and flags["--appendfsync"] == "always"
    assert flags["--maxmemory-policy"] == "noeviction"
    assert flags["--maxmemory"].endswith("mb")  # bounded: over it a write is storage_full, never an eviction
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == flags["--dir"]
    # A headless Service named by the StatefulSet gives the pod its stable DNS name.
    svc = one("Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None"


def test_cache_service_reaches_redis_at_the_statefulsets_pod_name():
    sts = one("StatefulSet", "hybridserve-redis")
    env = {v["name"]: v for v in one("Deployment", "hybridserve-cache")["spec"]["template"]["spec"]["containers"][0]["env"]}
    url = urlsplit(env["REDIS_URL"]["value"])
    assert url.scheme == "redis"
    assert url.hostname == f"{sts['metadata']['name']}-0.{sts['spec']['serviceName']}"
    assert url.port == one("Service", sts["spec"]["serviceName"])["spec"]["ports"][0]["port"]
    # $(REDIS_PASSWORD) is expanded only from variables defined before it.
    names = list(env)
    assert url.password == "$(REDIS_PASSWORD)" and names.index("REDIS_PASSWORD") < names.index("REDIS_URL")


def test_cache_service_has_grpc_health_probes_on_its_port():
    deployment = one("Deployment", "hybridserve-cache")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["grpc"]
    config = one("ConfigMap", "hybridserve-config")["data"]
    assert int(config["CACHE_SERVICE_PORT"]) == port and config["CACHE_SERVICE_HOST"] == "0.0.0.0"
    proto = (REPO / "proto" / "cache.proto").read_text()
    service = re.search(r"^package (\S+);", proto, re.M).group(1) + "." + re.search(r"^service (\w+)", proto, re.M).group(1)
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": port, "service": service}, probe
    assert "livenessProbe" in c


def test_cache_service_runs_several_instances_that_a_disruption_never_takes_all_of():
    deployment = one("Deployment", "hybridserve-cache")
    pods = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] >= 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] < deployment["spec"]["replicas"]
    pdb = one("PodDisruptionBudget", "hybridserve-cache")["spec"]
    assert pdb["minAvailable"] >= 1 and pdb["selector"]["matchLabels"].items() <= pods.items()
    # The instances share the tier, so heads report Redis's record of it (cache_service/config.py).
    assert one("ConfigMap", "hybridserve-config")["data"]["CACHE_TIER_PLACEMENT"] == "rendezvous"
    # The headless Service: one DNS record per ready pod, for the clients' placement.
    peers = one("Service", "hybridserve-cache-peers")["spec"]
    assert peers["clusterIP"] == "None" and not peers["publishNotReadyAddresses"]
    assert peers["selector"].items() <= pods.items()


def test_cache_service_settings_are_flags_of_python_m_cache_service():
    """Every setting given to the cache service is one its command line reads ([ENV] in --help)."""
    from cache_service.__main__ import build_parser

    known = set(re.findall(r"\[([A-Z_]+)", build_parser().format_help()))
    (c,) = one("Deployment", "hybridserve-cache")["spec"]["template"]["spec"]["containers"]
    given = set(one("ConfigMap", "hybridserve-config")["data"]) | {v["name"] for v in c["env"]}
    given -= {"REDIS_PASSWORD"}  # only an input of REDIS_URL's expansion
    assert given <= known, given - known


def test_cache_service_requires_the_shared_secret_from_the_mounted_secret():
    spec = one("Deployment", "hybridserve-cache")["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {v["name"]: v.get("value") for v in c["env"]}
    path = PurePosixPath(env["CACHE_SERVICE_AUTH_TOKEN_FILE"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    secret = mounts[str(path.parent)]["secret"]
    assert secret["secretName"] == SECRET_NAME
    assert {"key": "cache-service-secret", "path": path.name} in secret["items"]


def test_the_worker_group_asks_for_gpus_and_the_head_for_none():
    cluster = one("RayService")["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    for c in head["template"]["spec"]["containers"]:
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    (group,) = cluster["workerGroupSpecs"]
    (c,) = group["template"]["spec"]["containers"]
    # Extended resources: the request must equal the limit.
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"]
    assert any(t["key"] == "nvidia.com/gpu" for t in group["template"]["spec"]["tolerations"])
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_every_container_has_requests_a_memory_limit_and_a_pinned_image():
    for where, c in containers():
        resources = c["resources"]
        assert {"cpu", "memory"} <= resources["requests"].keys(), where
        assert "memory" in resources["limits"], where
        image = c["image"]
        assert ":" in image and not image.endswith(":latest"), where


def test_ray_version_agrees_across_image_rayservice_and_installed_ray():
    import ray

    base = re.search(r"^FROM rayproject/ray:(\S+)", (K8S_DIR / "Dockerfile").read_text(), re.M).group(1)
    ray_version = one("RayService")["spec"]["rayClusterConfig"]["rayVersion"]
    assert base.split("-")[0] == ray_version == ray.__version__
    pyproject = (REPO / "pyproject.toml").read_text()
    pin = re.search(r'"ray\[serve\]==([^"]+)"', pyproject)
    if pin:
        assert pin.group(1) == ray_version
    # Every image the manifests run is the one the Dockerfile builds.
    images = {c["image"] for _, c in containers() if not c["image"].startswith("redis:")}
    assert images == {"hybridserve:0.1.0"}


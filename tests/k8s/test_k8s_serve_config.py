"""The RayService's serveConfigV2: valid for Ray Serve and for the app, and config.yaml's
application with only the values a cluster changes."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
import yaml

from k8s_helpers import REPO, SECRET_NAME, app, deployments, one, pod_specs, serve_config, serve_config_errors

# config.yaml arguments a cluster does not pass: they configure the cache service the app
# starts for itself, and the cluster runs its own (cache-service.yaml); the API keys come
# from a file mounted from the Secret instead of plain text in the RayService.
LOCAL_ONLY_ARGS = {"redis_url", "data_dir", "api_keys"}
# Arguments only the cluster passes.
CLUSTER_ONLY_ARGS = {"device", "api_keys_file", "cache_service_token_file"}
# The deployment build_app adds only when no cache_service address is given.
LOCAL_ONLY_DEPLOYMENTS = {"CacheService"}


@pytest.fixture(scope="module")
def k8s() -> dict:
    return serve_config(one("RayService"))


@pytest.fixture(scope="module")
def local() -> dict:
    return yaml.safe_load((REPO / "config.yaml").read_text())


def test_serve_config_validates_with_rays_own_schema(k8s):
    assert serve_config_errors(k8s) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda c: app(c)["deployments"][1]["autoscaling_config"].__setitem__("min_replicas", 9), "min_replicas"),
        (lambda c: app(c)["deployments"][1].__setitem__("num_replica", 2), "num_replica"),
        (lambda c: app(c)["deployments"][1]["ray_actor_options"].__setitem__("num_gpu", 1), "num_gpu"),
        (lambda c: app(c)["deployments"][0].__setitem__("num_replicas", 0), "num_replicas"),
    ],
    ids=["min-above-max", "unknown-deployment-field", "unknown-actor-option", "zero-replicas"],
)
def test_serve_validation_catches_broken_configs(k8s, mutate, expected):
    broken = yaml.safe_load(yaml.safe_dump(k8s))
    mutate(broken)
    errors = serve_config_errors(broken)
    assert errors and any(expected in e for e in errors), errors


def test_same_application_as_config_yaml(k8s, local):
    for key in ("name", "route_prefix", "import_path"):
        assert app(k8s)[key] == app(local)[key], key
    assert k8s["proxy_location"] == local["proxy_location"]
    assert k8s["http_options"]["port"] == local["http_options"]["port"]


def test_same_deployments_as_config_yaml_less_the_local_cache_service(k8s, local):
    assert set(deployments(k8s)) == set(deployments(local)) - LOCAL_ONLY_DEPLOYMENTS
    from deployments.app import app_names

    assert set(deployments(k8s)) <= set(app_names())
    worker, local_worker = deployments(k8s)["Worker"], deployments(local)["Worker"]
    # A conversation survives losing a replica in both settings.
    assert worker["autoscaling_config"]["min_replicas"] >= local_worker["autoscaling_config"]["min_replicas"] >= 2
    assert worker["graceful_shutdown_timeout_s"] >= local_worker["graceful_shutdown_timeout_s"]


def test_same_arguments_as_config_yaml_but_the_local_ones(k8s, local):
    args, local_args = app(k8s)["args"], app(local)["args"]
    assert set(local_args) - set(args) == LOCAL_ONLY_ARGS
    assert set(args) - set(local_args) == CLUSTER_ONLY_ARGS
    assert args["tier_export"] == local_args["tier_export"]


def test_arguments_are_valid_app_settings(k8s):
    from deployments.settings import AppSettings

    assert CLUSTER_ONLY_ARGS <= set(AppSettings.model_fields)
    settings = AppSettings.model_validate(app(k8s)["args"])
    assert settings.cache_service and settings.model


def test_the_cache_service_argument_names_every_instance_through_the_headless_service(k8s):
    from cache_service.placement import parse_targets

    targets = parse_targets(app(k8s)["args"]["cache_service"])
    assert not targets.addresses  # no fixed address: the instances are the Service's pods
    ((host, port),) = targets.dns_names
    svc = one("Service", host)
    assert svc["spec"]["clusterIP"] == "None"
    assert port in {p["port"] for p in svc["spec"]["ports"]}


def test_file_arguments_are_mounted_in_every_ray_pod(k8s):
    args = app(k8s)["args"]
    ray_pods = [(where, spec) for where, spec in pod_specs() if where.startswith("hybridserve/")]
    assert len(ray_pods) == 2
    for where, spec in ray_pods:
        volumes = {v["name"]: v for v in spec["volumes"]}
        (container,) = spec["containers"]
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        for name in ("api_keys_file", "cache_service_token_file"):
            path = PurePosixPath(args[name])
            secret = mounts[str(path.parent)]["secret"]
            assert secret["secretName"] == SECRET_NAME and path.name in {i["path"] for i in secret["items"]}, (where, name)
        model = PurePosixPath(args["model"])
        volume = next(v for mount, v in mounts.items() if model.is_relative_to(mount))
        assert "persistentVolumeClaim" in volume, where


def test_workers_need_a_gpu_and_fit_the_gpu_group(k8s):
    worker = deployments(k8s)["Worker"]
    assert worker["ray_actor_options"]["num_gpus"] == 1
    assert app(k8s)["args"]["device"] == "cuda"
    (group,) = one("RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
    cpus_per_pod = float(container["resources"]["limits"]["cpu"])
    assert worker["ray_actor_options"]["num_cpus"] <= cpus_per_pod
    scaling = worker["autoscaling_config"]
    # The minimum runs without waiting for new pods; the maximum can be reached.
    assert group["minReplicas"] * gpus_per_pod >= scaling["min_replicas"]
    assert group["maxReplicas"] * gpus_per_pod >= scaling["max_replicas"]
    # Replicas export their heads on shutdown: the pod must live that long.
    assert group["template"]["spec"]["terminationGracePeriodSeconds"] > worker["graceful_shutdown_timeout_s"]


def test_config_yaml_passes_the_same_validation(local):
    # The comparisons above are only as good as the file they compare with.
    assert serve_config_errors(local) == []


def test_head_exposes_the_ports_kuberay_looks_up_by_name(k8s):
    head = one("RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    # KubeRay submits serveConfigV2 through "dashboard" and points its Serve Service at "serve".
    assert ports["serve"] == k8s["http_options"]["port"]
    assert ports["dashboard"] == 8265 and ports["gcs-server"] == 6379

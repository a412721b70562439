"""The package layering: workers/ never imports the cache service or the Ray Serve app (the
worker deployment bridges them), and the cache service imports neither workers nor the app.
What both sides must agree on lives in proto/contract.py. Inside workers/, imports go one
way: no module reaches itself again through its imports."""

from __future__ import annotations

import ast
import itertools
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


CONTRACT = "proto/contract.py"
CONTRACT_NAMES = {
    "conversation_key", "ConversationRef", "tokens_digest", "token_bytes", "chunk_digest", "message_prefix_digests",
    "ModelIdentity",
}


def test_the_contract_is_stated_once():
    """Everyone imports the contract under its own names: nothing outside proto/contract.py
    defines one of them again, renames one on import, or spells its hash domain."""
    from proto import contract

    assert CONTRACT_NAMES <= set(vars(contract))
    domain = contract._DOMAIN.rstrip(b"\0").decode()
    found = []
    for package in ("workers", "cache_service", "deployments", "bench", "proto"):
        for path in sorted((ROOT / package).rglob("*.py")):
            where = str(path.relative_to(ROOT))
            if where == CONTRACT:
                continue
            text = path.read_text()
            if domain in text:
                found.append(f"{where}: spells the conversation hash domain")
            for node in ast.walk(ast.parse(text, filename=where)):
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in CONTRACT_NAMES:
                    found.append(f"{where}: defines {node.name}")
                elif isinstance(node, ast.ImportFrom) and node.module == "proto.contract":
                    found += [f"{where}: imports {a.name} as {a.asname}" for a in node.names
                              if a.asname and a.asname != a.name]
    assert not found, found


# -- the import graph of workers/ -------------------------------------------------------------
# Every import counts: at module level, inside functions and under `if TYPE_CHECKING:` (a
# cycle hidden from the interpreter is still two modules that cannot be read one at a time).


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of `package` it imports (relative imports resolved; `from a
    import b` is an edge to a.b when b is a module, else to a)."""
    modules = {_module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}
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
            while target and target not in modules:  # an attribute of a module, or outside `package`
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


def test_the_import_graph_sees_what_it_must():
    graph = import_graph("workers")
    assert "workers.cache.heads" in graph["workers.cache.coordinator"]  # from module import name
    assert "workers.conversation.history" in graph["workers.conversation.cache"]  # from package import module
    assert "workers.checkpoint.writer" in graph["workers.checkpoint.builtin"]  # inside a function
    assert "workers.cache.heads" in graph["workers.conversation.ledger"]  # under TYPE_CHECKING
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_workers_has_no_import_cycles():
    cycles = import_cycles(import_graph("workers"))
    assert not cycles, f"import cycles in workers/: {[sorted(c) for c in cycles]}"



def collapse(graph: dict[str, set[str]], groups: list[str]) -> dict[str, set[str]]:
    """The graph with each package in `groups` (and everything under it) one node."""

    def node(module: str) -> str:
        return next((g for g in groups if module == g or module.startswith(g + ".")), module)

    collapsed: dict[str, set[str]] = {}
    for module, deps in graph.items():
        collapsed.setdefault(node(module), set()).update(node(d) for d in deps)
    return {name: deps - {name} for name, deps in collapsed.items()}


def test_the_cache_package_and_requests_import_one_way():
    """workers/cache/ as a whole imports workers/request.py, never the other way round (the
    names both use live below both, in workers/state_names.py)."""
    graph = collapse(import_graph("workers"), ["workers.cache"])
    assert "workers.request" in graph["workers.cache"]
    cycles = import_cycles(graph)
    assert not cycles, f"package-level import cycles in workers/: {[sorted(c) for c in cycles]}"
    planted = collapse({**import_graph("workers"), "workers.request": {"workers.cache.holders"}}, ["workers.cache"])
    assert import_cycles(planted), "a planted request -> cache import goes unseen"

# The scheduler decides on plain Python state and the cache managers do accounting: neither
# touches tensors. layout.py is the exception: it describes (with torch dtypes) and allocates
# the tensors the runner owns.
TENSOR_FREE = ["workers/scheduler.py", *(
    str(p.relative_to(ROOT))
    for p in sorted((ROOT / "workers/cache").glob("*.py"))
    if p.name not in {"layout.py", "__init__.py"}
)]


@pytest.mark.parametrize("path", TENSOR_FREE)
def test_scheduler_and_cache_managers_import_no_torch(path):
    tree = ast.parse((ROOT / path).read_text())
    top = []
    for node in tree.body:  # module level, including `if TYPE_CHECKING:` blocks
        nodes = ast.walk(node) if isinstance(node, ast.If) else [node]
        for n in nodes:
            if isinstance(n, ast.Import):
                top += [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                top.append(n.module)
    assert top, f"no imports found in {path}: the scan is broken"
    assert not [m for m in top if m.split(".")[0] in {"torch", "numpy"}], f"{path} imports tensors: {top}"

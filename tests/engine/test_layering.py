"""The engine room's layering: what both sides of the service agree on is stated once, in
proto/contract.py; workers/cache/ and workers/request.py import one way; the scheduler and
the cache managers touch no tensors. (The whole tree's rules, cycles included, are in
tests/test_tree_layering.py.)"""

from __future__ import annotations

import ast

import pytest

from tests.import_graph import ROOT, import_cycles, import_graph, package_graph


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


def test_the_import_graph_sees_what_it_must():
    graph = import_graph("workers")
    assert "workers.cache.heads" in graph["workers.cache.coordinator"]  # from module import name
    assert "workers.conversation.history" in graph["workers.conversation.cache"]  # from package import module
    assert "workers.checkpoint.writer" in graph["workers.checkpoint.builtin"]  # inside a function
    assert "workers.cache.heads" in graph["workers.conversation.ledger"]  # under TYPE_CHECKING
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_the_cache_package_and_requests_import_one_way():
    """workers/cache/ as a whole imports workers/request.py, never the other way round (the
    names both use live below both, in workers/state_names.py). No cycles at all: see
    tests/test_tree_layering.py."""
    rooms = package_graph(import_graph("workers"), 2)
    assert "workers.request" in rooms["workers.cache"]
    assert "workers.cache" not in rooms["workers.request"]
    planted = package_graph({**import_graph("workers"), "workers.request": {"workers.cache.holders"}}, 2)
    assert {"workers.cache", "workers.request"} in import_cycles(planted), "a planted request -> cache import goes unseen"


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

"""The whole tree's layering: no import cycle anywhere (benchmarks included, between packages
too), the top-level packages in one direction, and the app's rooms calling one way.

    proto  <-  workers  <-  deployments  <-  bench        cache_service <- deployments, bench
    (the engine knows no service, the service knows no engine, nothing product-side knows bench)

    deployments/   app ──> front ──> turn ──> routing          shared by all rooms: settings,
                    │                  └────> service          messages, errors, tool_replies
                    └────> worker ──> routing, service
    front/ and turn/ run in the ingress process and never import worker/ (the replica's), so the
    ingress never loads the engine; worker/ never imports front/ or turn/.
"""

from __future__ import annotations

import pytest

from tests.import_graph import PACKAGES, crossings, import_cycles, import_graph, package_graph

GRAPH = import_graph(*PACKAGES)

# (importer, imported): never allowed. Folders and modules alike, by dotted prefix.
ROOMS = ("front", "turn", "routing", "worker", "service")
SHARED = ("settings", "messages", "errors", "tool_replies")


def app(*names: str) -> list[str]:
    return [f"deployments.{n}" for n in names]


FORBIDDEN = [
    *[("workers", p) for p in ("cache_service", "deployments", "bench")],
    *[("cache_service", p) for p in ("workers", "deployments", "bench")],
    *[("proto", p) for p in ("workers", "cache_service", "deployments", "bench")],
    ("deployments", "bench"),
    *[(a, b) for a in app("front", "turn") for b in app("worker")],
    *[(a, b) for a in app("turn") for b in app("front")],
    *[(a, b) for a in app("worker") for b in app("front", "turn")],
    *[(a, b) for a in app("routing") for b in app("front", "turn", "worker", "service")],
    *[(a, b) for a in app("service") for b in app("front", "turn", "routing", "worker")],
    *[(a, b) for a in app(*SHARED) for b in app(*ROOMS)],
]


def test_the_graph_covers_the_tree():
    for package in PACKAGES:
        assert any(m.split(".")[0] == package for m in GRAPH), f"no module of {package}/ read: the scan is broken"
    # edges across packages, from a function body, and relative to a subpackage are all seen
    assert "proto.contract" in GRAPH["cache_service.keys"]
    assert "deployments.turn.run" in GRAPH["deployments.front.inflight"]
    assert "workers.checkpoint.writer" in GRAPH["workers.checkpoint.builtin"]


def test_no_import_cycle_anywhere():
    cycles = import_cycles(GRAPH)
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


@pytest.mark.parametrize("depth", [2, 3])
def test_no_two_rooms_need_each_other(depth):
    """workers.cache -> workers.request -> workers.cache is a cycle of rooms even when no single
    module imports itself back: the rooms could not be read (or moved) one at a time."""
    cycles = import_cycles(package_graph(GRAPH, depth))
    assert not cycles, f"rooms that import each other (depth {depth}): {[sorted(c) for c in cycles]}"


@pytest.mark.parametrize("source, target", FORBIDDEN, ids=lambda x: x)
def test_calls_go_one_way(source, target):
    found = crossings(GRAPH, source, target)
    assert not found, f"{source} must not import {target}: {found}"


def test_the_checks_catch_planted_violations():
    planted = {"deployments.front.ingress": {"deployments.worker.replica"},
               "deployments.worker.replica": {"deployments.routing.router"},
               "deployments.routing.router": {"deployments.worker.replica"},
               "bench.a": {"bench.b.x"}, "bench.b.x": {"bench.a"}, "bench.b": set(),
               "workers.cache.heads": {"workers.request"}, "workers.request": {"workers.cache.layout"},
               "workers.cache.layout": set()}
    assert crossings(planted, "deployments.front", "deployments.worker") == [
        "deployments.front.ingress -> deployments.worker.replica"]
    assert sorted(map(sorted, import_cycles(planted))) == [
        ["bench.a", "bench.b.x"], ["deployments.routing.router", "deployments.worker.replica"]]
    rooms = import_cycles(package_graph(planted, 2))
    assert {"workers.cache", "workers.request"} in rooms

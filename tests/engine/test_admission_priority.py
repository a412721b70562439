"""vLLM's `priority`: waiting requests are admitted lower value first, ties in arrival order;
with every priority at its default the order is plain FCFS."""

from __future__ import annotations

import dataclasses

from tests.engine.conftest import GREEDY, new_engine, prompt_of
from workers.checkpoint import Arch


def _admission_order(engine, priorities: dict[str, int]) -> list[str]:
    """One request runs at a time (max_num_seqs=1): the order replies start is the admission order."""
    for i, (rid, priority) in enumerate(priorities.items()):
        engine.add_request(rid, prompt_of(5 + i, seed=i), dataclasses.replace(GREEDY, max_tokens=2, priority=priority))
    order: list[str] = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.request_id not in order:
                order.append(out.request_id)
    assert not engine.has_unfinished()
    return order


def test_lower_priority_value_is_admitted_first_ties_by_arrival(tiny):
    engine = new_engine(tiny[Arch.BAMBA].path, max_num_seqs=1)
    order = _admission_order(engine, {"a": 0, "b": 5, "c": -1, "d": 0, "e": -1, "f": 1 << 40})
    assert order == ["c", "e", "a", "d", "b", "f"]
    assert _admission_order(engine, {f"fcfs{i}": 0 for i in range(4)}) == [f"fcfs{i}" for i in range(4)]

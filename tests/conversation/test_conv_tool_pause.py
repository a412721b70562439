"""A conversation waiting for its tools' results keeps its head: under pressure the head
manager evicts every other idle state before one whose reply ended in tool calls (within
tool_pause_s), and counts it when memory runs out anyway."""

from __future__ import annotations

import pytest

from tests.conversation.helpers import drive, greedy, head_of, new_cache, new_engine, run_turn, user
from proto.contract import ConversationRef
from workers.checkpoint import Arch

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string", "maxLength": 6}}, "required": ["q"],
    "additionalProperties": False}}}]
FORCED = {"type": "tool_calls", "tools": [{"name": "lookup", "parameters": TOOLS[0]["function"]["parameters"]}],
          "parallel": False}


def _tool_turn(cc, conversation_id: str):
    request = cc.begin_turn(ConversationRef(conversation_id, "s"), user("find it"),
                            greedy(max_tokens=200, constraint=FORCED), f"{conversation_id}-1", tools=TOOLS)
    result = drive(cc.engine)[request.request_id]
    assert result.error is None
    return request


@pytest.mark.parametrize("pause_s, evicted", [(300.0, "plain"), (0.0, "waiting")])
def test_a_head_waiting_for_tool_results_is_evicted_last(models, pause_s, evicted):
    engine = new_engine(models[Arch.BAMBA])
    engine.caches.heads.tool_pause_s = pause_s
    cc = new_cache(engine)
    request = _tool_turn(cc, "waiting")  # the older head: LRU would take it first
    assert request.awaiting_tool and head_of(cc, "waiting", "s").awaiting_tool
    run_turn(cc, "plain", "s", user("hello"), greedy(), "plain-1")
    assert not head_of(cc, "plain", "s").awaiting_tool
    heads = cc.engine.caches.heads
    heads.budget_bytes = heads.bytes_used()  # room for these two, not a third
    run_turn(cc, "third", "s", user("and another"), greedy(), "third-1")
    survivors = {name for name in ("waiting", "plain") if head_of(cc, name, "s") is not None}
    assert survivors == {"waiting", "plain"} - {evicted}
    assert cc.stats()["tool_pause_evictions"] == (1 if evicted == "waiting" and pause_s else 0)

"""A reply's tool calls as the worker streams them and as the ledger replays them: the same
calls with the same ids, and a replay after a partial stream sends only what is missing."""

from __future__ import annotations

from deployments.messages import TurnDelta
from deployments.tool_replies import ReplyCalls
from deployments.turn.outcome import Streamed, replay
from proto import cache_pb2 as pb
from workers.tools.formats import FORMATS

REPLY = 'Checking. <tool_call>{"name": "add", "arguments": {"a": 1, "b": [2, 3]}}</tool_call>' \
        '<tool_call>{"name": "get", "arguments": {"q": "x}"}}</tool_call>'


def _streamed(text: str, cut: int) -> tuple[ReplyCalls, list[TurnDelta]]:
    calls = ReplyCalls(FORMATS["hermes"], "turn-7")
    deltas = []
    for i in range(0, cut, 5):
        content, pieces = calls.feed(text[i:min(i + 5, cut)])
        deltas.append(TurnDelta(content, (), None, pieces))
    return calls, deltas


def _ledger_turn() -> pb.LedgerTurn:
    return pb.LedgerTurn(turn=3, publish_id="turn-7", messages=[
        pb.Message(role="tool", content="r"), pb.Message(role="assistant", content=REPLY)],
        result=pb.TurnResult(finish_reason="tool_calls", tool_format="hermes"))


def _merge(deltas: list[TurnDelta]) -> tuple[str, dict[int, list[str]]]:
    text, calls = "", {}
    for delta in deltas:
        text += delta.text
        for piece in delta.tool_calls:
            entry = calls.setdefault(piece.index, ["", "", ""])
            if piece.id:
                assert not entry[0], "a call is named once"
                entry[0], entry[1] = piece.id, piece.name
            entry[2] += piece.arguments
    return text, calls


def test_a_replay_gives_the_streamed_calls_with_their_ids():
    calls, deltas = _streamed(REPLY, len(REPLY))
    content, pieces = calls.finish()
    deltas.append(TurnDelta(content, (), None, pieces))
    *_, done = replay(_ledger_turn())
    assert done.tool_calls == calls.calls and len(done.tool_calls) == 2
    assert _merge(deltas) == _merge(replay(_ledger_turn())[:-1])


def test_a_replay_after_a_partial_stream_sends_only_the_rest():
    full = _merge(replay(_ledger_turn())[:-1])
    for cut in range(0, len(REPLY), 7):
        _, deltas = _streamed(REPLY, cut)
        sent = Streamed()
        for delta in deltas:
            sent.add(delta)
        rest = replay(_ledger_turn(), sent)[:-1]
        assert _merge(deltas + rest) == full, cut

"""A replayed answer is the live answer, byte for byte: an Idempotency-Key retry (streamed or
not) and the ledger's verdict after a stream cut anywhere give the text, tool calls, finish
reason and usage the live stream sent, with `stop` (cut before it, or after it with
`include_stop_str_in_output`), special tokens in the reply, and tool calls.

The ledger's message of a reply keeps every generated token's text (what the next prompt
re-renders); replays used to read it, so a retry returned the stop string and what followed it
in the last token, and the special tokens the live detokenizer skips.

The verdict after a cut stream is `outcome.replay(entry, streamed)` (TurnRun._ledger_verdict):
it is run here on the real ledger entry with the live stream's first k deltas as `streamed`,
for every k: no timing of a real replica's death reaches each of these instants."""

from __future__ import annotations

import json
import shutil
import uuid

import pytest
from ray import serve

from deployments.app import ChatIngress, Worker
from deployments.messages import ToolCallDelta, TurnDelta, TurnDone
from deployments.settings import AppSettings
from deployments.turn import outcome
from proto.contract import ConversationRef
from tests.cache_service.cs_helpers import fast_client
from tests.serve.conftest import app_args
from tests.serve.helpers import user
from workers.checkpoint.tokens import EOS_TOKEN_ID

SALT = "replay"
SPECIALS_APP = "hybridserve-specials"
# A short argument: the tiny model's call ends well within max_tokens.
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}}
CALL = {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 400,
        "temperature": 0}


def _events(text: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


class Answer:
    """What a client was told, from a stream's chunks or a whole body: the fields that matter."""

    def __init__(self, content: str | None, calls: list[dict], finish_reason: str, usage: dict,
                 deltas: list[TurnDelta] = ()):
        self.content, self.calls, self.finish_reason, self.usage = content, calls, finish_reason, usage
        self.deltas = list(deltas)  # the stream's deltas, as the ingress had them (a cut's `streamed`)

    def fields(self) -> tuple:
        return (self.content or "", self.calls, self.finish_reason, self.usage)

    @classmethod
    def of_body(cls, body: dict) -> "Answer":
        choice = body["choices"][0]
        return cls(choice["message"]["content"], choice["message"].get("tool_calls") or [],
                   choice["finish_reason"], body["usage"])

    @classmethod
    def of_stream(cls, text: str) -> "Answer":
        content, calls, finish, usage, deltas = "", [], None, None, []
        for chunk in _events(text):
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice["delta"]
                finish = choice["finish_reason"] or finish
                pieces = tuple(ToolCallDelta(p["index"], p.get("id", ""), p["function"].get("name", ""),
                                             p["function"]["arguments"]) for p in delta.get("tool_calls") or ())
                if delta.get("role"):
                    continue
                if delta.get("content") or pieces:
                    deltas.append(TurnDelta(delta.get("content") or "", (), None, pieces))
                content += delta.get("content") or ""
                for piece in pieces:
                    if piece.id:
                        calls.append({"id": piece.id, "type": "function",
                                      "function": {"name": piece.name, "arguments": piece.arguments}})
                    else:
                        calls[piece.index]["function"]["arguments"] += piece.arguments
        return cls(content, calls, finish, usage, deltas)

    def after_cut(self, k: int, replayed: list) -> "Answer":
        """The first k live deltas, then what the ledger's verdict sends."""
        content, calls = "", []
        for delta in self.deltas[:k] + [e for e in replayed if isinstance(e, TurnDelta)]:
            content += delta.text
            for piece in delta.tool_calls:
                if piece.id:
                    calls.append({"id": piece.id, "type": "function",
                                  "function": {"name": piece.name, "arguments": piece.arguments}})
                else:
                    calls[piece.index]["function"]["arguments"] += piece.arguments
        done = replayed[-1]
        assert isinstance(done, TurnDone), replayed
        usage = {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                 "total_tokens": done.prompt_tokens + done.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}
        return Answer(content, calls, done.finish_reason, usage)


async def _live_then_replays(stack, base: str, conv_id: str, body: dict) -> tuple[Answer, list[Answer]]:
    """The turn's live stream, then its retries (same key, streamed and not) answered from the ledger."""
    key = {"Idempotency-Key": f"key-{uuid.uuid4().hex}"}
    body = {"model": stack.model, "conversation_id": conv_id, "cache_salt": SALT, **body}
    async with stack.http() as http:
        live = await http.post(f"{base}/v1/chat/completions", headers=key,
                               json=body | {"stream": True, "stream_options": {"include_usage": True}})
        assert live.status_code == 200, live.text
        again = await http.post(f"{base}/v1/chat/completions", headers=key, json=body)
        assert again.status_code == 200, again.text
        streamed = await http.post(f"{base}/v1/chat/completions", headers=key,
                                   json=body | {"stream": True, "stream_options": {"include_usage": True}})
    assert again.json()["hybridserve"]["recovery"] == "replay"  # answered from the ledger, not run again
    return Answer.of_stream(live.text), [Answer.of_body(again.json()), Answer.of_stream(streamed.text)]


async def _items(stack, conv_id: str) -> list[dict]:
    async with stack.http() as http:
        listed = await http.get(f"/v1/conversations/{conv_id}/items", params={"cache_salt": SALT, "order": "asc"})
    assert listed.status_code == 200, listed.text
    return listed.json()["data"]


async def _ledger_turn(stack, conv_id: str, turn: int):
    async with fast_client(stack.service.target) as cache:
        ledger = await cache.read_ledger(ConversationRef(conv_id, SALT), from_turn=turn)
    return ledger.turns[0]


async def _assert_replays_equal_live(stack, conv_id: str, live: Answer, replays: list[Answer], turn: int = 1):
    for replayed in replays:
        assert replayed.fields() == live.fields()
    entry = await _ledger_turn(stack, conv_id, turn)
    assert len(live.deltas) >= 2, "too short a stream to cut"
    for k in range(len(live.deltas) + 1):  # every cut: after k of the live deltas
        streamed = outcome.Streamed()
        for delta in live.deltas[:k]:
            streamed.add(delta)
        assert live.after_cut(k, outcome.replay(entry, streamed)).fields() == live.fields(), f"cut after {k}"
    return entry


async def _first_text(stack, conv_id: str, words: str) -> str:
    async with stack.http() as http:
        r = await http.post("/v1/chat/completions", json={
            "model": stack.model, "messages": [user(words)], "max_tokens": 40, "temperature": 0,
            "cache_salt": f"probe-{conv_id}"})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("include", [False, True], ids=["stop-cut", "stop-included"])
async def test_a_reply_cut_by_a_stop_string_replays_as_it_was_sent(stack, conv_id, include):
    words = "tell me something"
    text = await _first_text(stack, conv_id, words)  # the same greedy reply the turn will run to
    stop = text[12:14]
    cut = text.find(stop)
    live, replays = await _live_then_replays(stack, "", conv_id, {
        "messages": [user(words)], "max_tokens": 40, "temperature": 0, "stop": [stop],
        "include_stop_str_in_output": include})
    assert live.finish_reason == "stop"
    assert live.content == (text[: cut + len(stop)] if include else text[:cut])
    entry = await _assert_replays_equal_live(stack, conv_id, live, replays)
    # the ledger's message keeps what the model generated: the stop string, for the next prompt
    assert entry.messages[-1].content.startswith(text[: cut + len(stop)])
    items = await _items(stack, conv_id)  # the Conversations API shows what the client was sent
    assert [(i["role"], i["content"][0]["text"]) for i in items] == [("user", words), ("assistant", live.content)]


@pytest.mark.parametrize("parallel", [False, True], ids=["one-call", "parallel-calls"])
async def test_tool_calls_replay_as_they_were_sent(stack, conv_id, parallel):
    """With parallel calls allowed, the stop string (kept) ends the reply after its first call."""
    live, replays = await _live_then_replays(stack, "", conv_id, {
        "messages": [user("weather in Paris?")], **CALL, "parallel_tool_calls": parallel,
        "stop": ["</tool_call>"], "include_stop_str_in_output": True})
    assert live.finish_reason == "tool_calls" and len(live.calls) == 1, live.fields()
    await _assert_replays_equal_live(stack, conv_id, live, replays)
    user_item, reply, call = await _items(stack, conv_id)
    assert reply["content"][0]["text"] == (live.content or "")
    assert {"type": "function_call", "call_id": live.calls[0]["id"], **live.calls[0]["function"]}.items() <= call.items()


@pytest.fixture(scope="module")
def specials(stack, tmp_path_factory):
    """An app whose model may sample special tokens (all but the end of turn, still banned)."""
    model_dir = tmp_path_factory.mktemp("specials") / "model"
    shutil.copytree(stack.model_dir, model_dir)
    meta = json.loads((model_dir / "hybridserve.json").read_text())
    meta["never_sample_token_ids"] = [EOS_TOKEN_ID]
    (model_dir / "hybridserve.json").write_text(json.dumps(meta))
    settings = AppSettings.model_validate(app_args(str(model_dir), stack.service, tier_export="off"))
    serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=1).bind(settings, None), None),
              name=SPECIALS_APP, route_prefix="/specials")
    yield "/specials"
    serve.delete(SPECIALS_APP)


async def test_special_tokens_in_a_reply_replay_as_they_were_sent(stack, specials, conv_id):
    """The live detokenizer skips special tokens; the ledger's message keeps them."""
    for seed in range(8):  # a seed whose reply holds a special token (most do, at temperature 2)
        conv = f"{conv_id}-{seed}"
        live, replays = await _live_then_replays(stack, specials, conv, {
            "messages": [user("anything")], "max_tokens": 48, "temperature": 2.0, "seed": seed})
        entry = await _ledger_turn(stack, conv, 1)
        if "<|" in entry.messages[-1].content and "<|" not in live.content:
            break
    else:
        pytest.fail("no reply held a special token")
    await _assert_replays_equal_live(stack, conv, live, replays)

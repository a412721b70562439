"""The Responses API over HTTP with the official client: state reuse, forks, scopes, streaming."""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from tests.serve.helpers import MAX_TOKENS, conversation, stateless_reference, user

pytestmark = pytest.mark.timeout(300)


def _salt() -> str:
    return f"resp-{uuid.uuid4().hex[:12]}"  # a scope of its own: no other test's prefixes are shared


async def respond(client: openai.AsyncOpenAI, model: str, text: str | list, salt: str, **kw):
    kw.setdefault("max_output_tokens", MAX_TOKENS)
    return await client.responses.create(model=model, input=text, temperature=0, extra_body={"cache_salt": salt},
                                         **kw)


def history_of(*pairs) -> list[dict]:
    """[user, assistant, user, assistant, ...] from (input text, response) pairs (None: no reply)."""
    out = []
    for text, response in pairs:
        out.append(user(text))
        if response is not None:
            out.append({"role": "assistant", "content": response.output_text})
    return out


async def test_continuing_reuses_the_state_and_matches_a_stateless_replay(stack):
    client, salt = stack.client(), _salt()
    first = await respond(client, stack.model, "tell me about the number 7", salt)
    assert first.object == "response" and first.id.startswith("resp_") and first.store
    # The test model never ends a reply by itself: every reply runs to max_output_tokens.
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == MAX_TOKENS and first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.output_tokens_details.reasoning_tokens == 0
    assert [item.type for item in first.output] == ["message"] and first.output_text
    second = await respond(client, stack.model, "and of 14?", salt, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.conversation.id == first.conversation.id
    assert second.usage.input_tokens_details.cached_tokens > 0
    reference = await stateless_reference(client, stack.model, history_of(("tell me about the number 7", first),
                                                                          ("and of 14?", None)))
    assert second.output_text == reference.text
    assert second.usage.input_tokens == reference.prompt_tokens
    async with stack.http() as http:
        state = await conversation(http, first.conversation.id, salt)
    assert state["turn"] == 2 and state["object"] == "conversation" and state["metadata"] == {}
    assert state["turns"][1]["messages"] == [user("and of 14?"), {"role": "assistant", "content": second.output_text}]


async def test_an_older_response_is_continued_in_a_fork(stack):
    client, salt = stack.client(), _salt()
    first = await respond(client, stack.model, "a story about a cat", salt)
    second = await respond(client, stack.model, "go on", salt, previous_response_id=first.id)
    branch = await respond(client, stack.model, "make it a dog", salt, previous_response_id=first.id)
    original = first.conversation.id
    assert second.conversation.id == original and branch.conversation.id != original
    reference = await stateless_reference(client, stack.model, history_of(("a story about a cat", first),
                                                                          ("make it a dog", None)))
    assert branch.output_text == reference.text
    # Both lines go on from their own latest response.
    third = await respond(client, stack.model, "and then?", salt, previous_response_id=second.id)
    branch_2 = await respond(client, stack.model, "and then?", salt, previous_response_id=branch.id)
    assert third.conversation.id == original and branch_2.conversation.id == branch.conversation.id
    assert third.usage.input_tokens_details.cached_tokens > 0
    reference = await stateless_reference(client, stack.model, history_of(
        ("a story about a cat", first), ("go on", second), ("and then?", None)))
    assert third.output_text == reference.text
    reference = await stateless_reference(client, stack.model, history_of(
        ("a story about a cat", first), ("make it a dog", branch), ("and then?", None)))
    assert branch_2.output_text == reference.text
    async with stack.http() as http:
        kept = await conversation(http, original, salt)
        forked = await conversation(http, branch.conversation.id, salt)
    assert [t["messages"][0]["content"] for t in kept["turns"]] == ["a story about a cat", "go on", "and then?"]
    assert [t["messages"][0]["content"] for t in forked["turns"]] == ["a story about a cat", "make it a dog",
                                                                      "and then?"]


async def test_a_chat_conversations_turn_is_a_response_to_fork_from(stack, conv_id):
    """A chat completion's conversation turn carries its response id, so the Responses API forks
    a chat conversation; the body that ends a turn says where it ran and what it reused."""
    client, salt = stack.client(), _salt()
    body = {"conversation_id": conv_id, "cache_salt": salt}
    first = await client.chat.completions.create(model=stack.model, messages=[user("a story about a cat")],
                                                 max_tokens=MAX_TOKENS, temperature=0, extra_body=body)
    chunks = await client.chat.completions.create(model=stack.model, messages=[user("go on")], max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body=body, stream=True,
                                                  stream_options={"include_usage": True})
    last = [chunk async for chunk in chunks][-1]
    assert first.model_extra["hybridserve"]["cached_from"] is None and first.model_extra["hybridserve"]["replica"]
    assert last.usage.prompt_tokens_details.cached_tokens > 0 and last.model_extra["turn"] == 2
    assert last.model_extra["hybridserve"]["cached_from"] == "head"
    assert last.model_extra["hybridserve"]["recovery"] in ("local", "tier_import")
    stored = await client.responses.retrieve(first.model_extra["response_id"], extra_query={"cache_salt": salt})
    assert stored.output_text == first.choices[0].message.content and stored.conversation.id == conv_id
    branch = await respond(client, stack.model, "make it a dog", salt,
                           previous_response_id=first.model_extra["response_id"])
    assert branch.conversation.id != conv_id and branch.model_extra["hybridserve"]["replica"]
    reference = await stateless_reference(client, stack.model, [
        user("a story about a cat"), {"role": "assistant", "content": first.choices[0].message.content},
        user("make it a dog")])
    assert branch.output_text == reference.text
    async with stack.http() as http:
        assert (await conversation(http, conv_id, salt))["turn"] == 2  # the original is untouched


async def test_another_salt_finds_no_response(stack):
    client, salt = stack.client(), _salt()
    mine = await respond(client, stack.model, "a secret: 4711", salt)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(mine.id, extra_query={"cache_salt": "another"})
    with pytest.raises(openai.NotFoundError):
        await respond(client, stack.model, "what was it?", "another", previous_response_id=mine.id)
    assert (await client.responses.retrieve(mine.id, extra_query={"cache_salt": salt})).output_text == \
        mine.output_text


async def test_another_api_key_finds_no_response(stack, notier):
    """With API keys the key scopes the state too: the same salt under another key finds nothing."""
    salt = _salt()
    k1 = openai.AsyncOpenAI(base_url=f"{stack.base_url}{notier}/v1", api_key="k1", max_retries=0, timeout=120)
    k2 = openai.AsyncOpenAI(base_url=f"{stack.base_url}{notier}/v1", api_key="k2", max_retries=0, timeout=120)
    keyed = await respond(k1, stack.model, "a secret: 4711", salt)
    with pytest.raises(openai.NotFoundError):
        await k2.responses.retrieve(keyed.id, extra_query={"cache_salt": salt})
    with pytest.raises(openai.NotFoundError):
        await respond(k2, stack.model, "what was it?", salt, previous_response_id=keyed.id)
    assert (await k1.responses.retrieve(keyed.id, extra_query={"cache_salt": salt})).id == keyed.id


async def test_store_false_keeps_nothing_and_replays_a_stored_history(stack):
    client, salt = stack.client(), _salt()
    alone = await respond(client, stack.model, "hello there", salt, store=False)
    assert alone.conversation is None and alone.store is False
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(alone.id, extra_query={"cache_salt": salt})
    first = await respond(client, stack.model, "count to three", salt)
    stateless = await respond(client, stack.model, "again", salt, previous_response_id=first.id, store=False)
    stored = await respond(client, stack.model, "again", salt, previous_response_id=first.id)
    assert stateless.output_text == stored.output_text and stateless.conversation is None
    async with stack.http() as http:
        assert (await conversation(http, first.conversation.id, salt))["turn"] == 2  # the stateless one left none


async def test_streaming_yields_the_typed_events_and_the_same_text(stack):
    client, salt = stack.client(), _salt()
    plain = await respond(client, stack.model, "stream me a line", salt, store=False)
    events = [event async for event in await respond(client, stack.model, "stream me a line", salt, stream=True)]
    kinds = [event.type for event in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    final = events[-1].response
    assert text == plain.output_text == final.output_text == events[-4].text
    assert final.usage.output_tokens == MAX_TOKENS and final.conversation is not None
    assert final.id == events[0].response.id
    stored = await client.responses.retrieve(final.id, extra_query={"cache_salt": salt})
    assert stored.output_text == text and stored.output[0].id == final.output[0].id


async def test_retrieve_input_items_and_delete(stack):
    client, salt = stack.client(), _salt()
    first = await respond(client, stack.model, "first words", salt)
    second = await respond(client, stack.model, "second words", salt, previous_response_id=first.id)
    query = {"cache_salt": salt}
    stored = await client.responses.retrieve(second.id, extra_query=query)
    assert stored.output_text == second.output_text and stored.status == "incomplete"
    assert stored.previous_response_id == first.id and stored.conversation.id == first.conversation.id
    assert stored.usage.model_dump() == second.usage.model_dump()
    items = await client.responses.input_items.list(second.id, extra_query=query, order="asc")
    assert [(i.role, i.content[0].text) for i in items.data] == [("user", "second words")]
    with pytest.raises(openai.ConflictError):  # an older response: later ones build on it
        await client.responses.delete(first.id, extra_query=query)
    await client.responses.delete(second.id, extra_query=query)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(second.id, extra_query=query)
    # The first response is the conversation's latest again: continued in place, exactly.
    again = await respond(client, stack.model, "other words", salt, previous_response_id=first.id)
    assert again.conversation.id == first.conversation.id
    reference = await stateless_reference(client, stack.model, history_of(("first words", first),
                                                                          ("other words", None)))
    assert again.output_text == reference.text
    with pytest.raises(openai.NotFoundError):  # the deleted response's turn is another's now
        await respond(client, stack.model, "x", salt, previous_response_id=second.id)
    await client.responses.delete(again.id, extra_query=query)
    await client.responses.delete(first.id, extra_query=query)  # its first turn: the conversation goes
    async with stack.http() as http:
        gone = await http.get(f"/v1/conversations/{first.conversation.id}", params=query)
    assert gone.status_code == 404


async def test_a_created_conversation_collects_its_responses(stack):
    client, salt = stack.client(), _salt()
    created = await client.conversations.create(metadata={"topic": "numbers"})
    assert created.id.startswith("conv_") and created.metadata == {"topic": "numbers"}
    first = await respond(client, stack.model, "one", salt, conversation=created.id, instructions="Be brief.")
    second = await respond(client, stack.model, "two", salt, conversation={"id": created.id},
                           instructions="Be brief.")
    assert first.conversation.id == second.conversation.id == created.id
    assert second.usage.input_tokens_details.cached_tokens > 0
    reference = await stateless_reference(client, stack.model, [{"role": "system", "content": "Be brief."}]
                                           + history_of(("one", first), ("two", None)))
    assert second.output_text == reference.text
    with pytest.raises(openai.BadRequestError) as changed:  # the committed history keeps its instructions
        await respond(client, stack.model, "three", salt, conversation=created.id, instructions="Be long.")
    assert changed.value.body["param"] == "instructions"
    retrieved = await client.conversations.retrieve(created.id, extra_query={"cache_salt": salt})
    assert retrieved.id == created.id and retrieved.object == "conversation"
    items = await client.conversations.items.list(created.id, extra_query={"cache_salt": salt}, order="asc")
    assert [i.role for i in items.data] == ["system", "user", "assistant", "user", "assistant"]
    with pytest.raises(openai.BadRequestError):
        await client.conversations.create(items=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("patch, field", [
    ({"reasoning": {"effort": "low"}}, "reasoning"), ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"truncation": "auto"}, "truncation"), ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"), ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"), ({"input": []}, "input"),
    ({"previous_response_id": "resp_x", "conversation": "c"}, "conversation"),
    ({"stream": "yes"}, "stream"), ({"max_output_tokens": "12"}, "max_output_tokens"),
    ({"deterministic": "1"}, "deterministic"), ({"store": "false"}, "store"),
    ({"top_k": "5"}, "top_k"), ({"min_p": "0.1"}, "min_p"), ({"ignore_eos": "true"}, "ignore_eos"),
    ({"stop_token_ids": ["2"]}, "stop_token_ids"),
], ids=lambda p: next(iter(p)) if isinstance(p, dict) else None)
async def test_bad_fields_are_400_naming_them(stack, patch, field):
    body = {"model": stack.model, "input": "hi", "max_output_tokens": 2, **patch}
    async with stack.http() as http:
        response = await http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].split(".")[0] == field


async def test_unknown_response_ids_are_404(stack):
    async with stack.http() as http:
        for bad in ("nothing", "resp_", "resp_!!!", "resp_WyJjb252X3giLDEsInJlc3AtMSJd"):
            assert (await http.get(f"/v1/responses/{bad}")).status_code == 404
            assert (await http.delete(f"/v1/responses/{bad}")).status_code == 404
            body = {"model": stack.model, "input": "hi", "max_output_tokens": 2, "previous_response_id": bad}
            assert (await http.post("/v1/responses", json=body)).status_code == 404


WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
                          "additionalProperties": False}}


async def test_a_forced_tool_call_is_a_function_call_item_and_its_output_continues(stack):
    client, salt = stack.client(), _salt()
    kw = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_output_tokens=200)
    called = await respond(client, stack.model, "weather in Paris?", salt, **kw)
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    # The test model never samples its end token: the reply ends where the forced call's grammar does.
    assert calls[0].status == called.status == "completed"
    assert json.loads(calls[0].arguments)["unit"] in ("c", "f")
    streamed = [e async for e in await respond(client, stack.model, "weather in Paris?", salt, stream=True, **kw)]
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    final = streamed[-1].response
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments
    stored = await client.responses.retrieve(called.id, extra_query={"cache_salt": salt})
    assert [(i.type, getattr(i, "call_id", None)) for i in stored.output] == \
        [(i.type, getattr(i, "call_id", None)) for i in called.output]
    output = [{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 degrees"}]
    answer = await respond(client, stack.model, output, salt, previous_response_id=called.id, tools=[WEATHER])
    assert answer.conversation.id == called.conversation.id and answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens > 0

"""Prefix state travels, through a real app, Redis and cache service: a tenant's long system
prompt, computed by a replica of one app, goes to the state tier; a replica that never computed
it (a second app's, on the same cache service) imports it instead of computing it, with the same
tokens as a recompute; a request under another salt never imports it. In one app of two
replicas, a holder running all it may (max_ongoing_requests) leaves the tenant's next chat to
the other replica, which imports the prefix rather than computing it."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from ray import serve

from cache_service.client import CacheClient
from deployments.app import ChatIngress, Worker
from deployments.settings import AppSettings
from proto.contract import message_prefix_digests
from tests.serve.conftest import app_args
from tests.serve.helpers import chat_turn, metric, stateless_reference, user

pytestmark = pytest.mark.timeout(300)
IMPORT_APP, IMPORT_PREFIX = "hybridserve-prefix-import", "/prefix-import"
PAIR_APP, PAIR_PREFIX = "hybridserve-prefix-pair", "/prefix-pair"
WORKER_MAX_ONGOING = 8  # the Worker deployment's max_ongoing_requests
# Long enough to be exported (prefix_export_min_tokens: 256) and worth importing.
SYSTEM = {"role": "system", "content": "You plan trips for a travel agency: check the tools, then answer. " * 10}


async def tier_prefix(cache: CacheClient, scope: str, names: list[str], timeout_s: float = 60.0) -> tuple[str, int]:
    """(name, tokens) of the longest of `names` the state tier holds, once it does (the export
    is write-behind)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        match = await cache.find_prefix(names, scope=scope)
        if match is not None and match.tier is not None:
            return match.tier
        await asyncio.sleep(0.1)
    raise AssertionError("the prefix never reached the state tier")


@pytest.fixture
def importer(stack):
    """A second app of one replica on the same cache service: its engine holds nothing yet."""
    settings = AppSettings.model_validate(app_args(stack.model_dir, stack.service, tier_export="async"))
    serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=1).bind(settings, None), None),
              name=IMPORT_APP, route_prefix=IMPORT_PREFIX)
    yield stack.client(IMPORT_PREFIX)
    serve.delete(IMPORT_APP)


async def ask(client, model: str, messages: list[dict], salt: str):
    return await client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=0,
        extra_body={"cache_salt": salt})


async def test_a_replica_that_never_computed_a_prefix_imports_it_from_the_tier(stack, importer):
    salt = f"tenant-{uuid.uuid4().hex[:8]}"
    first_chat = [SYSTEM, user("hello")]
    await chat_turn(stack.client(), stack.model, first_chat, conversation_id=None, cache_salt=salt)
    async with CacheClient(stack.service.target) as cache:
        name, tokens = await tier_prefix(cache, salt, message_prefix_digests(salt, first_chat))
    assert name in message_prefix_digests(salt, first_chat) and tokens >= 256

    chat = [SYSTEM, user("good morning")]  # shares the system prompt, not the first chat's end
    async with stack.http() as http:
        imports = await metric(http, "hybridserve_prefix_imports_total", prefix=IMPORT_PREFIX)
        reply = await ask(importer, stack.model, chat, salt)
        assert reply.model_extra["hybridserve"]["recovery"] == "prefix_import"
        assert reply.usage.prompt_tokens_details.cached_tokens >= min(tokens, len(SYSTEM["content"]) // 2)
        assert await metric(http, "hybridserve_prefix_imports_total", prefix=IMPORT_PREFIX) == imports + 1
        decided = 'hybridserve_route_decisions_total{reason="prefix_import"}'
        assert await metric(http, decided, prefix=IMPORT_PREFIX) >= 1
    reference = await stateless_reference(stack.client(), stack.model, chat, max_tokens=8)
    assert [t.token for t in reply.choices[0].logprobs.content] == reference.tokens

    # Another tenant sending the very same messages gets none of it, here or anywhere.
    other = await ask(importer, stack.model, chat, f"other-{uuid.uuid4().hex[:8]}")
    assert other.model_extra["hybridserve"]["recovery"] == "new"
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) == 0


@pytest.fixture
def pair(stack):
    """An app of two replicas on the same cache service, measuring nothing yet (no earlier test's
    imports or prefills priced them)."""
    settings = AppSettings.model_validate(app_args(stack.model_dir, stack.service, tier_export="async",
                                                   kv_cache_mb=64))
    serve.run(ChatIngress.bind(settings, Worker.options(num_replicas=2).bind(settings, None), None),
              name=PAIR_APP, route_prefix=PAIR_PREFIX)
    yield stack.client(PAIR_PREFIX)
    serve.delete(PAIR_APP)


async def content_started(stream) -> None:
    """Returns once the stream carries reply text: its request runs on a replica."""
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            return
    raise AssertionError("the stream ended before any reply text")


async def test_a_prefix_held_only_by_a_full_replica_is_imported_from_the_tier_by_the_other(stack, pair):
    """The tenant's first chat leaves its system prompt on one replica (the holder) and in the
    tier. Eight more of the same chat, long replies, fill the holder (each costs it nothing to
    prefill: it holds their whole prompt). The tenant's next chat cannot go there (Serve skips a
    full replica): the other replica imports the system prompt from the tier instead of computing
    it, the router counts why (`prefix_import`), and the reply equals a recompute."""
    salt = f"tenant-{uuid.uuid4().hex[:8]}"
    first_chat = [SYSTEM, user("hello")]
    first = await ask(pair, stack.model, first_chat, salt)
    holder = first.model_extra["hybridserve"]["replica"]
    async with CacheClient(stack.service.target) as cache:
        _, tokens = await tier_prefix(cache, salt, message_prefix_digests(salt, first_chat)[:1])
    busy = []
    try:
        for _ in range(WORKER_MAX_ONGOING):
            stream = await pair.chat.completions.create(
                model=stack.model, messages=first_chat, max_tokens=3000, temperature=0, stream=True,
                extra_body={"cache_salt": salt})
            busy.append(stream)
            await content_started(stream)
        async with stack.http() as http:
            decided = 'hybridserve_route_decisions_total{reason="prefix_import"}'
            before = await metric(http, decided, prefix=PAIR_PREFIX)
            chat = [SYSTEM, user("good morning")]
            reply = await ask(pair, stack.model, chat, salt)
            assert reply.model_extra["hybridserve"]["replica"] != holder
            assert reply.model_extra["hybridserve"]["recovery"] == "prefix_import"
            assert reply.usage.prompt_tokens_details.cached_tokens >= tokens
            assert await metric(http, decided, prefix=PAIR_PREFIX) == before + 1
    finally:
        for stream in busy:
            await stream.close()
    reference = await stateless_reference(stack.client(), stack.model, chat, max_tokens=8)
    assert [t.token for t in reply.choices[0].logprobs.content] == reference.tokens


"""Prefix state travels, through a real app, Redis and cache service: a tenant's long system
prompt, computed by a replica of one app, goes to the state tier; a replica that never computed
it (a second app's, on the same cache service) imports it instead of computing it, with the same
tokens as a recompute; a request under another salt never imports it."""

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

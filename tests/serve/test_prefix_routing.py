"""The prefix index from the app's side, against a real cache service (no Ray): a request carries
the holders of its longest prefix; a cache service that is down or hung costs the request at
most PREFIX_LOOKUP_S and routes it by load; a worker announces what the engine checkpointed."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
import uuid

import pytest

from cache_service.client import CacheClient, ClientConfig, RetryPolicy
from cache_service.config import FsyncPolicy
from cache_service.embedded_redis import EmbeddedRedis, EmbeddedRedisConfig
from deployments.service.connection import cache_client_config
from deployments.turn.lease_keeper import LeaseKeeper
from deployments.routing.prefix_hints import LOOKUP_FAILURES, PREFIX_LOOKUP_S, Announcer, announcement
from deployments.routing.recent_prefixes import RECENT, RecentPrefixes, merged
from deployments.settings import AppSettings
from deployments.turn.request import TurnRequest
from deployments.turn.run import TurnRun
from proto.contract import ConversationRef, message_prefix_digests, tools_scope
from tests.cache_service.cs_helpers import ServiceProcess

pytestmark = pytest.mark.timeout(60)
SETTINGS = AppSettings()
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "how are you?"}]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-routing")
    redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=root / "redis", fsync=FsyncPolicy.ALWAYS))
    redis.start()
    proc = ServiceProcess(data_dir=root / "service", redis_url=redis.url)
    try:
        proc.start()
        yield proc
        assert proc.terminate() == 0
    finally:
        proc.close()
        redis.stop()


def app_client(target: str) -> CacheClient:
    """Configured as the app's processes are: many retries, a long deadline per call."""
    return CacheClient(target, cache_client_config("ingress", SETTINGS))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens on it once the socket is closed


async def start(cache: CacheClient, salt: str, *, conversation_id: str | None = None,
                keeper: LeaseKeeper | None = None) -> TurnRun:
    conversation = None if conversation_id is None else ConversationRef(conversation_id, salt)
    return await TurnRun.start(SETTINGS, None, cache, keeper, TurnRequest(CHAT, {}, salt, conversation))


async def start_with(cache: CacheClient, salt: str, messages: list[dict]) -> TurnRun:
    return await TurnRun.start(SETTINGS, None, cache, None, TurnRequest(messages, {}, salt, None))


async def test_a_stateless_request_carries_the_holders_of_its_prefixes(service):
    salt = f"salt-{uuid.uuid4().hex}"
    names = message_prefix_digests(salt, CHAT)
    async with app_client(service.target) as cache:
        run = await start(cache, salt)
        assert run.job.prefix_holders == () and run.job.scope == salt
        await cache.announce_prefixes("replica-a", [(names[0], 12)], scope=salt)
        await cache.announce_prefixes("replica-b", [(names[2], 30)], scope=salt)
        # every holder with its longest: the router weighs replica-a's 12 tokens against its queue too
        job = (await start(cache, salt)).job
        assert sorted(job.prefix_holders) == [("replica-a", 12), ("replica-b", 30)]
        # the longest held (messages[:3], 30 tokens as replica-b's engine counted them) calibrates
        # the router's estimates of every prefix's length: 30 tokens there, whatever characters said
        assert job.prefix_names[2] == (names[2], 30)
        assert (await start(cache, f"other-{salt}")).job.prefix_holders == ()  # another scope


async def test_a_new_conversation_carries_them_a_continued_one_does_not(service):
    salt, conversation_id = f"salt-{uuid.uuid4().hex}", f"conv-{uuid.uuid4().hex}"
    names = message_prefix_digests(salt, CHAT)
    async with app_client(service.target) as cache:
        keeper = LeaseKeeper(cache.target, cache.config)
        try:
            await cache.announce_prefixes("replica-a", [(names[1], 20)], scope=salt)
            run = await start(cache, salt, conversation_id=conversation_id, keeper=keeper)
            try:
                assert run.job.head is None and run.job.prefix_holders == (("replica-a", 20),)
            finally:
                await run.close()  # discards the lease
        finally:
            keeper.close()


@pytest.mark.parametrize("fault", ["unreachable", "hung"])
async def test_a_failed_lookup_routes_by_load_quickly(service, fault):
    salt = f"salt-{uuid.uuid4().hex}"
    failures = LOOKUP_FAILURES.count
    if fault == "unreachable":
        target = f"127.0.0.1:{closed_port()}"
    else:
        target = service.target
        os.kill(service.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        async with app_client(target) as cache:
            started = time.monotonic()
            run = await start(cache, salt)
            elapsed = time.monotonic() - started
    finally:
        if fault == "hung":
            os.kill(service.proc.pid, signal.SIGCONT)
    assert run.job.prefix_holders == ()
    # bounded by the lookup's own deadline (plus a loaded machine's slack), not retried for minutes
    assert elapsed < PREFIX_LOOKUP_S + 2.0, f"the hint held the request up for {elapsed:.2f} s"
    assert LOOKUP_FAILURES.count == failures + 1


def test_checkpoints_name_the_prefixes_they_cover():
    salt = "scope"
    messages = CHAT[:2]
    REPLY = {"role": "assistant", "content": "the reply"}
    chat = [*messages, REPLY]
    names = message_prefix_digests(salt, chat)
    assert announcement(salt, messages, REPLY, [(1, 7), (2, 15), (3, 24)]) == [
        (names[0], 7), (names[1], 15), (names[2], 24)]
    assert announcement(salt, messages, REPLY, []) == []
    # k outside 1..len(messages) + 1 names nothing (never the wrong prefix)
    assert announcement(salt, messages, REPLY, [(0, 3), (4, 30), (2, 0)]) == []
    # a reply with tool calls is named as the client sends it back (calls included), and
    # plain messages keep their names
    calls = {**REPLY, "tool_calls": [{"id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": "{}"}}]}
    with_calls = message_prefix_digests(salt, [*messages, calls])
    assert with_calls[:2] == names[:2] and with_calls[2] != names[2]
    assert announcement(salt, messages, calls, [(3, 24)]) == [(with_calls[2], 24)]
    # tools change the prompt: another tool list is another scope
    assert tools_scope(salt, ()) == salt
    assert tools_scope(salt, [{"a": 1}]) != tools_scope(salt, [{"a": 2}]) != salt


async def test_a_worker_withdraws_what_its_engine_no_longer_holds(service):
    salt = f"salt-{uuid.uuid4().hex}"
    tasks: set[asyncio.Task] = set()

    def spawn(coro) -> None:
        tasks.add(asyncio.create_task(coro))

    reply = {"role": "assistant", "content": "hello"}
    names = message_prefix_digests(salt, [*CHAT[:2], reply])
    async with app_client(service.target) as cache:
        async def live() -> CacheClient:
            return cache

        announcer = Announcer("replica-w", live, spawn)
        await cache.announce_prefixes("replica-x", [(names[0], 9)], scope=salt)  # another replica holds the first
        announcer.after_turn(salt, CHAT[:2], reply, [(1, 9), (3, 21)], keys=["system-key", "end-key"])
        await asyncio.gather(*tasks)
        assert sorted((await cache.find_prefix(names, scope=salt)).holders) == [("replica-w", 21), ("replica-x", 9)]
        announcer.withdraw(["end-key", "never-announced"])  # the engine evicted the request's end
        await asyncio.gather(*tasks)
        assert sorted((await cache.find_prefix(names, scope=salt)).holders) == [("replica-w", 9), ("replica-x", 9)]
        announcer.withdraw(["system-key", "end-key"])  # the end's again: nothing left to withdraw
        await asyncio.gather(*tasks)
        assert (await cache.find_prefix(names, scope=salt)).holders == (("replica-x", 9),)
        assert announcer.withdrawn == 2 and announcer.failures.count == 0


async def test_a_worker_announces_off_the_turn_and_survives_a_dead_service(service):
    salt = f"salt-{uuid.uuid4().hex}"
    tasks: set[asyncio.Task] = set()

    def spawn(coro) -> None:
        tasks.add(asyncio.create_task(coro))

    async with app_client(service.target) as cache:
        async def live() -> CacheClient:
            return cache

        announcer = Announcer("replica-w", live, spawn)
        announcer.after_turn(salt, CHAT[:2], {"role": "assistant", "content": "hello"}, [(1, 9), (3, 21)])
        assert len(tasks) == 1 and announcer.in_flight == 1  # spawned, not awaited
        await asyncio.gather(*tasks)
        names = message_prefix_digests(salt, [*CHAT[:2], {"role": "assistant", "content": "hello"}])
        match = await cache.find_prefix(names, scope=salt)
        assert (match.index, match.holders) == (2, (("replica-w", 21),))
        assert (await cache.find_prefix(names[:2], scope=salt)).index == 0
        assert announcer.announced == 2 and announcer.failures.count == 0
        # what it announces goes back with the answer: the ingress that forwards it routes the
        # loop's next step (its history, the reply, a tool result) by it before the index hears
        reply = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
        entries = announcer.after_turn(salt, CHAT[:3], reply, [(4, 40)])
        RECENT.record("replica-w", entries)
        run = await start_with(cache, salt, [*CHAT[:3], reply, {"role": "tool", "content": "r"}])
        assert run.job.prefix_holders == (("replica-w", 40),)
        await asyncio.gather(*tasks)
        names = message_prefix_digests(salt, [*CHAT[:3], reply, {"role": "tool", "content": "r"}])
        assert (await cache.find_prefix(names, scope=salt)).holders == (("replica-w", 40),)

    dead = CacheClient(f"127.0.0.1:{closed_port()}", ClientConfig(timeout_s=0.2, retry=RetryPolicy(attempts=2)))
    try:
        async def down() -> CacheClient:
            return dead

        announcer = Announcer("replica-w", down, spawn)
        tasks.clear()
        announcer.after_turn(salt, CHAT[:2], {"role": "assistant", "content": "hello"}, [(1, 9)])
        await asyncio.gather(*tasks)  # the announce's own failure is not raised anywhere
        assert announcer.failures.count == 1 and announcer.in_flight == 0
    finally:
        await dead.close()


def test_recent_ends_complete_the_index_each_replica_with_its_longest():
    recent = RecentPrefixes(kept=3)
    recent.record("replica-a", [("n1", 10), ("n2", 20)])
    recent.record("replica-b", [("n1", 10)])
    assert recent.holders(["n1", "n2", "n9"]) == {"replica-a": 20, "replica-b": 10}
    assert merged([("replica-b", 30), ("replica-c", 5)], recent.holders(["n1", "n2"])) == (
        ("replica-a", 20), ("replica-b", 30), ("replica-c", 5))
    assert merged([("replica-c", 5)], {}) == (("replica-c", 5),)
    recent.record("replica-a", [("n3", 1), ("n4", 2)])  # past `kept` names: the least recently recorded go
    assert recent.holders(["n2"]) == {} and recent.holders(["n1", "n4"]) == {"replica-a": 10, "replica-b": 10}
    assert RecentPrefixes(ttl_s=-1.0).holders(["n4"]) == {}

"""The prefix index: which replica holds which message prefix, found longest first, in one
Redis round trip; entries expire, another scope never matches, bad input is refused."""

import asyncio
import uuid

import grpc
import pytest
import redis
from cs_helpers import ServiceProcess, fast_client

from cache_service.client import PrefixMatch, Unauthenticated
from cache_service.keys import PrefixKeys
from proto import cache_pb2 as pb
from proto.contract import message_prefix_digests, prefix_scope_tag

pytestmark = pytest.mark.timeout(60)
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def chat(n: int, topic: str = "") -> list[dict[str, str]]:
    roles = ("system", "user", "assistant")
    return [{"role": roles[min(i, 1 + (i + 1) % 2)], "content": f"{topic} message {i}"} for i in range(n)]


def scope() -> str:
    return f"scope-{uuid.uuid4().hex}"


def held(match: PrefixMatch | None) -> tuple[int, list[tuple[str, int]]] | None:
    """A match with its holders in a fixed order (the service gives them in none)."""
    return None if match is None else (match.index, sorted(match.holders))


async def test_the_longest_held_prefix_is_found_with_its_holders(client):
    names = message_prefix_digests(scope(), chat(6))
    assert await client.find_prefix(names) is None
    await client.announce_prefixes("replica-a", [(names[0], 40), (names[2], 130)])
    await client.announce_prefixes("replica-b", [(names[2], 130), (names[3], 170)])
    # Each holder with its longest: replica-a's 130 tokens are worth having where replica-b is busy.
    assert held(await client.find_prefix(names)) == (3, [("replica-a", 130), ("replica-b", 170)])
    assert held(await client.find_prefix(names[:3])) == (2, [("replica-a", 130), ("replica-b", 130)])
    assert await client.find_prefix(names[:1]) == PrefixMatch(0, (("replica-a", 40),))
    assert await client.find_prefix(names[4:]) is None  # only prefixes nobody holds


async def test_forget_drops_only_that_replica(client):
    names = message_prefix_digests(scope(), chat(3))
    await client.announce_prefixes("replica-a", [(names[1], 50)])
    await client.announce_prefixes("replica-b", [(names[1], 50), (names[2], 90)])
    live = (await client.stats()).prefix_index_names
    await client.forget_prefixes("replica-b", [names[2], names[0]])  # names[0]: never announced, fine
    assert held(await client.find_prefix(names)) == (1, [("replica-a", 50), ("replica-b", 50)])
    assert (await client.stats()).prefix_index_names == live - 1  # names[2] has no holder left
    await client.forget_prefixes("replica-a", [names[1]])
    assert await client.find_prefix(names) == PrefixMatch(1, (("replica-b", 50),))
    await client.forget_prefixes("replica-b", [names[1]])
    await client.forget_prefixes("replica-b", [names[1]])  # again: best-effort, no error
    assert await client.find_prefix(names) is None
    assert (await client.stats()).prefix_index_names == live - 2


async def test_another_scope_never_matches(client):
    messages = chat(4, "shared system prompt")
    mine, theirs = message_prefix_digests(scope(), messages), message_prefix_digests(scope(), messages)
    await client.announce_prefixes("replica-a", [(name, 10 * (k + 1)) for k, name in enumerate(mine)])
    assert (await client.find_prefix(mine)).index == 3
    assert await client.find_prefix(theirs) is None


async def test_each_scope_has_keys_of_its_own_and_stats_count_them_all(client, redis_server):
    tenants = [scope() for _ in range(3)]
    chats = {t: message_prefix_digests(t, chat(2)) for t in tenants}
    unscoped = message_prefix_digests(scope(), chat(1))
    before = (await client.stats()).prefix_index_names
    r = redis.Redis.from_url(redis_server.url)
    try:
        for t in tenants:
            await client.announce_prefixes("replica-a", [(chats[t][0], 4), (chats[t][1], 8)], scope=t)
            keys = PrefixKeys(prefix_scope_tag(t))
            assert keys.name(chats[t][1]) == f"hs:v1:prefix:{{index:{prefix_scope_tag(t)}}}:name:{chats[t][1]}"
            assert r.hkeys(keys.name(chats[t][1])) == [b"replica-a"] and r.zcard(keys.live) == 2
            assert not r.exists(PrefixKeys().name(chats[t][1]))
        await client.announce_prefixes("replica-a", [(unscoped[0], 3)])  # a client without scopes: `{index}`
        assert r.exists(PrefixKeys().name(unscoped[0]))
        assert (await client.stats()).prefix_index_names == before + 7
        await client.forget_prefixes("replica-a", [chats[tenants[0]][1]], scope=tenants[0])
        assert (await client.find_prefix(chats[tenants[0]], scope=tenants[0])).index == 0
        assert (await client.stats()).prefix_index_names == before + 6
    finally:
        r.close()


async def test_an_announce_refreshes_the_ttl(client, redis_server):
    names = message_prefix_digests(scope(), chat(1))
    r = redis.Redis.from_url(redis_server.url)
    try:
        await client.announce_prefixes("replica-a", [(names[0], 7)])
        assert 1_790_000 < r.pttl(PrefixKeys().name(names[0])) <= 1_800_000  # the service's default TTL
        r.pexpire(PrefixKeys().name(names[0]), 60_000)
        await client.announce_prefixes("replica-b", [(names[0], 7)])
        assert r.pttl(PrefixKeys().name(names[0])) > 1_790_000
        assert r.zscore(PrefixKeys().live, names[0]) > r.time()[0] * 1000 + 1_790_000
    finally:
        r.close()


async def test_entries_expire_after_the_configured_ttl(redis_server, tmp_path):
    proc = ServiceProcess(data_dir=tmp_path, redis_url=redis_server.url, extra_env={"CACHE_PREFIX_TTL_S": "2"})
    proc.start()
    try:
        async with fast_client(proc.target) as c:
            names = message_prefix_digests(scope(), chat(2))
            live = (await c.stats()).prefix_index_names
            await c.announce_prefixes("replica-a", [(names[0], 5), (names[1], 9)])
            assert (await c.find_prefix(names)).index == 1
            assert (await c.stats()).prefix_index_names == live + 2
            await asyncio.sleep(2.1)  # a TTL of 2 s: the checks above have it all on a loaded machine
            assert await c.find_prefix(names) is None
            assert (await c.stats()).prefix_index_names == live
    finally:
        assert proc.terminate() == 0
        proc.close()


async def test_a_holder_of_a_long_prefix_does_not_hide_a_holder_of_a_shorter_one(client):
    # replica-a may have died holding the long one: the router, which knows the live replicas,
    # must still see replica-b.
    names = message_prefix_digests(scope(), chat(5))
    await client.announce_prefixes("replica-a", [(names[1], 20), (names[4], 90)])
    await client.announce_prefixes("replica-b", [(names[0], 10), (names[2], 45)])
    assert held(await client.find_prefix(names)) == (4, [("replica-a", 90), ("replica-b", 45)])


async def test_each_replica_s_entry_expires_whoever_else_announces_the_name(redis_server, tmp_path):
    proc = ServiceProcess(data_dir=tmp_path, redis_url=redis_server.url, extra_env={"CACHE_PREFIX_TTL_S": "4"})
    proc.start()
    r = redis.Redis.from_url(redis_server.url)
    try:
        async with fast_client(proc.target) as c:
            names = message_prefix_digests(scope(), chat(2))
            await c.announce_prefixes("replica-dead", [(names[1], 9)])  # expires at t + 4 s
            await asyncio.sleep(2.2)
            await c.announce_prefixes("replica-live", [(names[1], 9)])  # the name's key: to t + 6.2 s
            await asyncio.sleep(2.0)  # past replica-dead's expiry, 2 s within replica-live's
            assert await c.find_prefix(names) == PrefixMatch(1, (("replica-live", 9),))
            # and an announce drops the expired entries: the hash holds what replicas announced within the TTL
            await c.announce_prefixes("replica-live", [(names[1], 9)])
            assert r.hkeys(PrefixKeys().name(names[1])) == [b"replica-live"]
    finally:
        r.close()
        assert proc.terminate() == 0
        proc.close()


def commandstats(r: redis.Redis) -> dict[str, int]:
    return {name: stats["calls"] for name, stats in r.info("commandstats").items()}


async def test_find_is_one_script_call_reading_every_name_from_the_longest_down(client, redis_server):
    names = message_prefix_digests(scope(), chat(20))
    await client.announce_prefixes("replica-a", [(names[3], 33)])
    await client.find_prefix(names)  # the script is loaded now
    r = redis.Redis.from_url(redis_server.url)
    try:
        before = commandstats(r)
        assert await client.find_prefix(names) == PrefixMatch(3, (("replica-a", 33),))
        after = commandstats(r)
    finally:
        r.close()
    delta = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    delta.pop("cmdstat_ping", None)  # the service's health probe
    delta.pop("cmdstat_info", None)  # this test's own first read
    assert delta == {"cmdstat_evalsha": 1, "cmdstat_hgetall": 20}  # names[19] down to names[0]


async def test_an_empty_request_is_a_miss_without_a_write(client, stub):
    assert (await stub.FindPrefix(pb.FindPrefixRequest())).index == -1
    await stub.AnnouncePrefixes(pb.AnnouncePrefixesRequest(replica="replica-a"))
    await stub.ForgetPrefixes(pb.ForgetPrefixesRequest(replica="replica-a"))
    assert await client.find_prefix([]) is None


NAME = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize("request_, fragment", [
    (pb.AnnouncePrefixesRequest(replica="", entries=[pb.PrefixEntry(name=NAME, tokens=1)]),
     "replica must not be empty"),
    (pb.AnnouncePrefixesRequest(replica="r" * 257, entries=[pb.PrefixEntry(name=NAME, tokens=1)]),
     "replica is 257 bytes, over the limit of 256"),
    (pb.AnnouncePrefixesRequest(replica="r", entries=[pb.PrefixEntry(name=NAME.upper(), tokens=1)]),
     "entries[0] must be a prefix name: 32 lowercase hex digits"),
    (pb.AnnouncePrefixesRequest(replica="r", entries=[pb.PrefixEntry(name=NAME, tokens=1),
                                                      pb.PrefixEntry(name=NAME[:31], tokens=1)]),
     "entries[1] must be a prefix name"),
    (pb.AnnouncePrefixesRequest(replica="r", entries=[pb.PrefixEntry(name=NAME, tokens=0)]),
     "entries[0].tokens must be"),
    (pb.AnnouncePrefixesRequest(replica="r", entries=[pb.PrefixEntry(name=NAME, tokens=1)] * 257),
     "entries has 257 entries, over the limit of 256"),
    (pb.ForgetPrefixesRequest(replica="", names=[NAME]), "replica must not be empty"),
    (pb.ForgetPrefixesRequest(replica="r", names=[NAME + "0"]), "names[0] must be a prefix name"),
    (pb.ForgetPrefixesRequest(replica="r", names=[NAME] * 257), "names has 257 entries, over the limit of 256"),
    (pb.FindPrefixRequest(names=[NAME, "g" * 32]), "names[1] must be a prefix name"),
    (pb.FindPrefixRequest(names=[NAME] * 513), "names has 513 entries, over the limit of 512"),
    (pb.FindPrefixRequest(names=[NAME], scope="tenant"), "scope must be empty or a scope tag"),
    (pb.AnnouncePrefixesRequest(replica="r", scope=NAME, entries=[pb.PrefixEntry(name=NAME, tokens=1)]),
     "scope must be empty or a scope tag: 16 lowercase hex digits"),
    (pb.ForgetPrefixesRequest(replica="r", names=[NAME], scope=NAME[:16].upper()), "scope must be"),
])
async def test_bad_input_is_refused_and_writes_nothing(stub, client, request_, fragment):
    call = {pb.AnnouncePrefixesRequest: stub.AnnouncePrefixes, pb.ForgetPrefixesRequest: stub.ForgetPrefixes,
            pb.FindPrefixRequest: stub.FindPrefix}[type(request_)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(request_)
    assert info.value.code() == INVALID
    assert fragment in info.value.details()
    assert dict(info.value.trailing_metadata())["hs-reason"] == "invalid_argument"
    assert await client.find_prefix([NAME]) is None


async def test_the_shared_secret_guards_the_index(strict_service, strict_client):
    names = message_prefix_digests(scope(), chat(1))
    await strict_client.announce_prefixes("replica-a", [(names[0], 3)])
    assert await strict_client.find_prefix(names) == PrefixMatch(0, (("replica-a", 3),))
    async with fast_client(strict_service.target) as anonymous:
        with pytest.raises(Unauthenticated):
            await anonymous.find_prefix(names)
        with pytest.raises(Unauthenticated):
            await anonymous.announce_prefixes("replica-b", [(names[0], 3)])
    assert await strict_client.find_prefix(names) == PrefixMatch(0, (("replica-a", 3),))

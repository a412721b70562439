"""The cache service on a real 3-primary Redis Cluster (redis_cluster_set.py).

Every script runs on the one slot its keys share: a conversation's turns, leases, ledger, tier
marks, rewinds and deletes; a fork between two conversations on two slots; the prefix index,
one slot per scope, the scopes spread over the primaries.
"""

from __future__ import annotations

import uuid

import pytest
from cs_helpers import History, ServiceProcess, commit_turn, fast_client
from redis_cluster_set import RedisClusterSet

from cache_service.errors import AlreadyExists
from cache_service.keys import ConversationKeys, PrefixKeys
from proto.contract import ConversationRef, message_prefix_digests, prefix_scope_tag


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with RedisClusterSet(tmp_path_factory.mktemp("cluster")) as redis_cluster:
        yield redis_cluster


@pytest.fixture(scope="module")
def service(cluster, tmp_path_factory):
    proc = ServiceProcess(data_dir=tmp_path_factory.mktemp("service"), redis_url=None,
                          extra_env={"REDIS_CLUSTER": cluster.addresses})
    proc.start()
    yield proc
    proc.close()


async def test_turns_ledger_tier_fork_and_delete_run_on_the_cluster(cluster, service):
    r = cluster.client()
    async with fast_client(service.target) as client:
        convs = cluster.spread((ConversationRef(f"cluster-{i}-{uuid.uuid4().hex}") for i in range(300)),
                               lambda c: r.keyslot(ConversationKeys.of(c).head), per_primary=2)  # every primary
        histories = {c: History() for c in convs}
        for turn in range(3):
            for conv in convs:
                await commit_turn(client, conv, histories[conv], [turn + 1, 7], f"turn {turn}")
        for conv in convs:
            ledger = await client.read_ledger(conv)
            assert [t.turn for t in ledger.turns] == [1, 2, 3]
            assert ledger.head.committed_tokens == len(histories[conv].tokens)
            head_key = ConversationKeys.of(conv).head  # stored on the primary of its slot
            assert cluster.node_of_slot(r.keyslot(head_key)).client().hget(head_key, "version") == b"3"
        source = convs[0]
        await client.put_state(source, 3, b"state at turn 3")
        assert (await client.get_state(source)) == (3, b"state at turn 3")
        # A fork to a conversation on another slot: read there, written here, all turns copied.
        target_id = next(f"fork-{i}" for i in range(1000) if r.keyslot(
            ConversationKeys.of(source.fork(f"fork-{i}")).head) != r.keyslot(ConversationKeys.of(source).head))
        head = await client.fork_conversation(source, target_id, turn=2, expected_version=3)
        assert (head.version, head.turn) == (1, 2)
        forked = await client.read_ledger(source.fork(target_id))
        original = await client.read_ledger(source)
        assert [t.SerializeToString() for t in forked.turns] == [t.SerializeToString() for t in original.turns[:2]]
        assert forked.head.committed_tokens == 4  # two turns of 2 tokens each
        with pytest.raises(AlreadyExists):
            await client.fork_conversation(source, target_id, turn=1)
        assert await client.delete_conversation(source)
        assert await client.get_head_or_none(source) is None
    r.close()


async def test_prefix_index_scopes_land_on_different_primaries(cluster, service):
    r = cluster.client()
    # Four scopes on each primary: found only if the index's keys hash by scope (one shared tag: one primary).
    scopes = cluster.spread((f"tenant-{i}-{uuid.uuid4().hex[:6]}" for i in range(300)),
                            lambda s: r.keyslot(PrefixKeys(prefix_scope_tag(s)).live), per_primary=4)
    async with fast_client(service.target) as client:
        before = (await client.stats()).prefix_index_names
        for i, scope in enumerate(scopes):
            names = message_prefix_digests(scope, [{"role": "user", "content": f"hello {k}"} for k in range(3)])
            await client.announce_prefixes("replica-a", [(names[0], 5), (names[2], 15)], scope=scope)
            await client.announce_prefixes("replica-b", [(names[1], 10)], scope=scope)
            match = await client.find_prefix(names, scope=scope)
            assert (match.index, sorted(match.holders)) == (2, [("replica-a", 15), ("replica-b", 10)])
            assert await client.find_prefix(names) is None  # without its scope: another slot, nothing
            keys = PrefixKeys(prefix_scope_tag(scope))
            slot = r.keyslot(keys.live)
            assert {r.keyslot(keys.name(n)) for n in names} == {slot}  # one scope: one slot
            assert cluster.node_of_slot(slot).client().exists(keys.name(names[2])) == 1  # stored there
            if i % 2:
                await client.forget_prefixes("replica-a", [names[2]], scope=scope)
                match = await client.find_prefix(names, scope=scope)
                assert (match.index, sorted(match.holders)) == (1, [("replica-a", 5), ("replica-b", 10)])
        # Stats count every scope's live names: 3 per scope, one fewer where a name lost its only holder.
        assert (await client.stats()).prefix_index_names == before + 3 * len(scopes) - len(scopes) // 2
    r.close()

"""Leases as an attacker sees them: borrowed or guessed tokens, takeover by name,
publishes dressed up as retries, and the fence keys left behind."""

import os

import grpc
import pytest
import redis

from cache_service.client import LeaseHeld, LeaseLost, StaleFence, VersionConflict, key_message
from cache_service.keys import ConversationKeys
from proto.contract import ConversationRef, tokens_digest
from proto import cache_pb2 as pb

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def publish_request(conv, token, proof, *, tokens=(1, 2), content="hi", publish_id="p", version=0,
                    release=True):
    return pb.PublishTurnRequest(
        key=key_message(conv), lease_token=token, lease_proof=proof, expected_version=version,
        turn=pb.LedgerTurn(messages=[pb.Message(role="user", content=content)], token_ids=list(tokens)),
        committed_tokens=len(tokens), tokens_sha256=tokens_digest(tokens), publish_id=publish_id,
        release_lease=release)


async def refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


async def test_a_lease_is_usable_only_on_its_own_conversation(client, stub, conv):
    other = ConversationRef(conv.id + "-b", conv.salt)        # another conversation
    same_id = ConversationRef(conv.id, conv.salt + "-other")  # the same id under another salt
    mine = await client.acquire_lease(conv, ttl_ms=10_000)
    theirs = await client.acquire_lease(other, ttl_ms=10_000)
    await client.acquire_lease(same_id, ttl_ms=10_000)

    # Holding conv's lease, try to publish into and release the others with it, and
    # with every small token number: all get one and the same answer.
    answers = set()
    for target in (other, same_id):
        for token in (mine.token, 1, 2, 3, 1000):
            for call in (stub.PublishTurn(publish_request(target, token, mine.proof)),
                         stub.ReleaseLease(pb.ReleaseLeaseRequest(key=key_message(target), token=token,
                                                                  lease_proof=mine.proof))):
                error = await refused(call)
                answers.add((error.code(), error.details(), tuple(error.trailing_metadata())))
    assert answers == {(FAILED_PRECONDITION,
                        "the lease token and proof are not a live lease of this conversation",
                        (("hs-reason", "lease_lost"),))}
    # A made-up proof is no better.
    error = await refused(stub.PublishTurn(publish_request(other, theirs.token, os.urandom(24))))
    assert dict(error.trailing_metadata())["hs-reason"] == "lease_lost"

    # Nothing was written, nothing released: the real holder of `other` commits.
    head = await stub.PublishTurn(publish_request(other, theirs.token, theirs.proof))
    assert (head.version, head.turn) == (1, 1)
    with pytest.raises(LeaseHeld):
        await client.acquire_lease(same_id, ttl_ms=10_000)


async def test_a_live_lease_cannot_be_taken_over_by_name(client, stub, conv):
    lease = await client.acquire_lease(conv, ttl_ms=10_000, holder="router:req-7")
    # Busy: the holder's name is not disclosed...
    error = await refused(stub.AcquireLease(pb.AcquireLeaseRequest(
        key=key_message(conv), holder="someone", ttl_ms=10_000)))
    assert "router:req-7" not in error.details() + repr(error.trailing_metadata())
    # ...and knowing it is not enough: acquiring under that name, with or without an
    # attempt key of one's own, does not hand out the live lease or extend it.
    for attempt_key in (b"", os.urandom(16)):
        error = await refused(stub.AcquireLease(pb.AcquireLeaseRequest(
            key=key_message(conv), holder="router:req-7", ttl_ms=10_000, attempt_key=attempt_key)))
        assert dict(error.trailing_metadata())["hs-reason"] == "lease_held"
        assert int(dict(error.trailing_metadata())["hs-expires-in-ms"]) <= 10_000
    # Lease TTLs are capped by configuration (an hour is not a lease).
    error = await refused(stub.AcquireLease(pb.AcquireLeaseRequest(
        key=key_message(ConversationRef(conv.id + "-long", conv.salt)), holder="h", ttl_ms=3_600_000)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The real holder's turn goes through.
    head = await stub.PublishTurn(publish_request(conv, lease.token, lease.proof))
    assert head.version == 1


async def test_a_publish_is_a_retry_only_with_the_same_content_and_lease(client, stub, conv):
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    first = await stub.PublishTurn(publish_request(conv, lease.token, lease.proof, publish_id="p1",
                                                   release=False))
    assert first.version == 1
    # Another turn reusing the publish id at head - 1: not a retry, a conflict.
    error = await refused(stub.PublishTurn(publish_request(
        conv, lease.token, lease.proof, publish_id="p1", tokens=(9, 9, 9), content="other turn",
        release=False)))
    assert error.code() == grpc.StatusCode.ABORTED
    # The same content under someone else's lease is not answered either.
    intruder = await client.acquire_lease(ConversationRef(conv.id + "-x", conv.salt), ttl_ms=10_000)
    error = await refused(stub.PublishTurn(publish_request(conv, intruder.token, intruder.proof,
                                                           publish_id="p1", release=False)))
    assert dict(error.trailing_metadata())["hs-reason"] == "lease_lost"
    # The genuine retry is answered with the head it made, and nothing is redone.
    again = await stub.PublishTurn(publish_request(conv, lease.token, lease.proof, publish_id="p1",
                                                   release=False))
    assert again == first
    ledger = await client.read_ledger(conv)
    assert [list(t.token_ids) for t in ledger.turns] == [[1, 2]]
    assert [m.content for m in ledger.turns[0].messages] == ["hi"]


async def test_fence_keys_expire_and_go_with_the_conversation(client, conv, redis_server):
    keys = ConversationKeys.of(conv)
    r = redis.Redis.from_url(redis_server.url)
    try:
        lease = await client.acquire_lease(conv, ttl_ms=10_000)
        # Bounded: the fence outlives the lease (so late holders learn they are
        # stale) but carries a TTL, even for a conversation that never commits.
        assert 10_000 < r.pttl(keys.fence) <= 10_000 + 3_600_000
        await client.publish_turn(conv, lease_token=lease, expected_version=0, messages=[],
                                  token_ids=[1], committed_tokens=1, tokens_sha256=tokens_digest([1]))
        assert await client.delete_conversation(conv)
        assert r.exists(keys.fence, keys.head, keys.ledger, keys.lease, keys.marks) == 0
        # A stale holder of the deleted conversation cannot touch the new one.
        new = await client.acquire_lease(conv, ttl_ms=10_000)
        with pytest.raises(LeaseLost) as info:
            await client.publish_turn(conv, lease_token=lease, expected_version=0, messages=[],
                                      token_ids=[1], committed_tokens=1, tokens_sha256=tokens_digest([1]))
        assert not isinstance(info.value, StaleFence)
        with pytest.raises(VersionConflict):  # and the new holder is unaffected
            await client.publish_turn(conv, lease_token=new, expected_version=1, messages=[],
                                      token_ids=[1], committed_tokens=1, tokens_sha256=tokens_digest([1]))
    finally:
        r.close()

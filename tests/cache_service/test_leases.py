"""Leases: one holder at a time, TTL expiry, fencing tokens that refuse stale holders."""

import asyncio

import pytest

from cache_service.client import LeaseHeld, LeaseLost, NotFound, StaleFence, key_message
from proto.contract import ConversationRef, tokens_digest
from proto import cache_pb2 as pb


async def publish_first_turn(client, conv, token, tokens=(1, 2, 3)):
    return await client.publish_turn(
        conv, lease_token=token, expected_version=0, messages=[{"role": "user", "content": "hi"}],
        token_ids=list(tokens), committed_tokens=len(tokens), tokens_sha256=tokens_digest(tokens))


async def test_fifty_concurrent_acquirers_one_winner_then_takeover_and_stale_fence(client, conv):
    # The TTL must outlast 50 round trips on a loaded machine, or a second acquirer
    # would rightly win after the first lease expired.
    results = await asyncio.gather(*(client.acquire_lease(conv, ttl_ms=1500, holder=f"h{i}")
                                     for i in range(50)), return_exceptions=True)
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1
    assert len(losers) == 49 and all(isinstance(e, LeaseHeld) for e in losers)
    first = winners[0]
    # Busy says for how long, never who holds it (a name was enough to take it over).
    assert all("holder" not in e.details and int(e.details["expires_in_ms"]) > 0 for e in losers)

    # Someone else waits for the expiry and takes over with a larger token.
    second = await client.acquire_lease(conv, ttl_ms=10_000, holder="late", wait_s=10.0)
    assert second.holder == "late" and second.token > first.token

    # The first holder wakes up and tries to commit: refused, nothing written.
    with pytest.raises(StaleFence):
        await publish_first_turn(client, conv, first.token)
    with pytest.raises(NotFound):
        await client.get_head(conv)

    # The current holder can commit.
    head = await publish_first_turn(client, conv, second.token)
    assert head.version == 1


async def test_expired_lease_nobody_took_is_lost_not_stale(client, conv):
    lease = await client.acquire_lease(conv, ttl_ms=50)
    # Wait for the expiry the way a real caller would: by acquiring again.
    other = await client.acquire_lease(conv, ttl_ms=10_000, wait_s=5.0)
    await client.release_lease(conv, other.token)
    with pytest.raises(LeaseLost) as info:
        await publish_first_turn(client, conv, lease.token)
    assert not isinstance(info.value, StaleFence)
    with pytest.raises(NotFound):
        await client.get_head(conv)


async def test_a_retried_acquire_is_the_same_lease(client, conv, stub):
    # A retry of one acquire (same holder, same attempt key: its reply was lost) gets
    # the same lease back; another call, even under the same holder name, does not.
    request = pb.AcquireLeaseRequest(key=key_message(conv), holder="router:req-1", ttl_ms=5_000,
                                     attempt_key=b"k" * 16)
    a = await stub.AcquireLease(request)
    b = await stub.AcquireLease(request)
    assert (a.token, a.proof) == (b.token, b.proof)
    with pytest.raises(LeaseHeld):
        await client.acquire_lease(conv, ttl_ms=5_000, holder="router:req-1")
    with pytest.raises(LeaseHeld):
        await client.acquire_lease(conv, ttl_ms=5_000, holder="router:req-2")


async def test_renew_release_and_tokens_only_grow(client, conv):
    lease = await client.acquire_lease(conv, ttl_ms=5_000)
    renewed = await client.renew_lease(conv, lease.token, ttl_ms=60_000)
    assert renewed.token == lease.token and renewed.expires_at_ms > lease.expires_at_ms
    await client.release_lease(conv, lease.token)
    await client.release_lease(conv, lease.token)  # a retried release is not an error
    with pytest.raises(LeaseLost):
        await client.renew_lease(conv, lease.token, ttl_ms=5_000)

    nxt = await client.acquire_lease(conv, ttl_ms=5_000)
    assert nxt.token > lease.token
    with pytest.raises(StaleFence):
        await client.renew_lease(conv, lease.token, ttl_ms=5_000)
    with pytest.raises(StaleFence):
        await client.release_lease(conv, lease.token)  # must not free someone else's lease
    with pytest.raises(LeaseHeld):
        await client.acquire_lease(conv, ttl_ms=5_000)

    # Deleting the conversation starts a new incarnation: whatever number the new
    # lease gets, the proofs of the old incarnation are worthless (not even stale).
    await publish_first_turn(client, conv, nxt)
    assert await client.delete_conversation(conv)
    after = await client.acquire_lease(conv, ttl_ms=5_000)
    assert after.proof[:8] != nxt.proof[:8]
    for old in (lease, nxt):
        with pytest.raises(LeaseLost) as info:
            await client.renew_lease(conv, old, ttl_ms=5_000)
        assert not isinstance(info.value, StaleFence)
    assert (await client.renew_lease(conv, after, ttl_ms=5_000)).token == after.token


async def test_wrong_salt_is_another_conversation(client, conv):
    lease = await client.acquire_lease(conv, ttl_ms=5_000)
    await publish_first_turn(client, conv, lease.token)
    wrong = ConversationRef(conv.id, salt=conv.salt + "x")
    with pytest.raises(NotFound):
        await client.get_head(wrong)
    with pytest.raises(NotFound):
        await client.read_ledger(wrong)
    # Its lease is independent too: the right salt's lease does not block it.
    other = await client.acquire_lease(wrong, ttl_ms=5_000)
    assert other.token >= 1
    assert (await client.get_head(conv)).version == 1

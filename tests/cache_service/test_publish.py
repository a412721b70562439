"""Publishing turns: compare-and-set heads, the ledger, discard, transfer, delete."""

import asyncio

import pytest
from cs_helpers import History, commit_turn

from cache_service.client import InvalidArgument, LeaseHeld, LeaseLost, NotFound, VersionConflict
from proto.contract import tokens_digest


async def test_two_publishers_at_the_same_version_one_wins(client, conv):
    history = History()
    await commit_turn(client, conv, history, [10, 11], "first")
    lease = await client.acquire_lease(conv, ttl_ms=10_000)

    def attempt(name, new_tokens):
        tokens = history.tokens + new_tokens
        return client.publish_turn(
            conv, lease_token=lease.token, expected_version=1,
            messages=[{"role": "assistant", "content": name}], token_ids=new_tokens,
            committed_tokens=len(tokens), tokens_sha256=tokens_digest(tokens),
            owner_replica=name, release_lease=False)

    results = await asyncio.gather(attempt("A", [20, 21, 22]), attempt("B", [30]),
                                   return_exceptions=True)
    wins = [r for r in results if not isinstance(r, BaseException)]
    conflicts = [r for r in results if isinstance(r, VersionConflict)]
    assert len(wins) == 1 and len(conflicts) == 1
    assert conflicts[0].details["current_version"] == "2"
    winner = wins[0].owner_replica
    expected_new = [20, 21, 22] if winner == "A" else [30]

    ledger = await client.read_ledger(conv)
    assert [t.turn for t in ledger.turns] == [1, 2]
    assert list(ledger.turns[1].token_ids) == expected_new
    assert [m.content for m in ledger.turns[1].messages] == [winner]
    head = ledger.head
    assert head.version == 2 and head.turn == 2 and head.owner_replica == winner
    assert head.committed_tokens == 2 + len(expected_new)
    assert head.tokens_sha256 == tokens_digest(history.tokens + expected_new)


async def test_turns_accumulate_and_ledger_pages(client, conv):
    history = History()
    for i in range(5):
        await commit_turn(client, conv, history, [i] * (i + 1), f"turn {i}")
    head = await client.get_head(conv)
    assert (head.version, head.turn, head.committed_tokens) == (5, 5, 15)
    assert head.tokens_sha256 == tokens_digest(history.tokens)
    page = await client.read_ledger(conv, from_turn=2, max_turns=2)
    assert [t.turn for t in page.turns] == [2, 3]
    assert [list(t.token_ids) for t in page.turns] == [[1, 1], [2, 2, 2]]
    assert page.turns[0].messages[0].content == "turn 1"
    everything = await client.read_ledger(conv)
    assert sum(len(t.token_ids) for t in everything.turns) == head.committed_tokens


async def test_publish_checks_the_committed_token_count(client, conv):
    history = History()
    await commit_turn(client, conv, history, [1, 2, 3], "a")
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    with pytest.raises(InvalidArgument, match="committed_tokens"):
        await client.publish_turn(conv, lease_token=lease.token, expected_version=1,
                                  messages=[], token_ids=[4], committed_tokens=10,
                                  tokens_sha256=tokens_digest([1, 2, 3, 4]))
    ledger = await client.read_ledger(conv)
    assert len(ledger.turns) == 1 and ledger.head.version == 1


async def test_retried_publish_is_answered_not_redone(client, conv):
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    kwargs = dict(lease_token=lease.token, expected_version=0, messages=[{"role": "user", "content": "x"}],
                  token_ids=[7, 8], committed_tokens=2, tokens_sha256=tokens_digest([7, 8]),
                  publish_id="pub-1", release_lease=True)
    first = await client.publish_turn(conv, **kwargs)
    # The reply was "lost"; the retry comes after the lease was already released.
    again = await client.publish_turn(conv, **kwargs)
    assert again == first
    assert len((await client.read_ledger(conv)).turns) == 1
    # A different publish with the released lease is refused.
    with pytest.raises(LeaseLost):
        await client.publish_turn(conv, **{**kwargs, "publish_id": "pub-2"})


async def test_discard_keeps_the_head_and_frees_the_lease(client, conv):
    history = History()
    await commit_turn(client, conv, history, [5, 6], "kept")
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    before = await client.get_head(conv)
    head = await client.discard(conv, lease.token)
    assert head == before
    nxt = await client.acquire_lease(conv, ttl_ms=10_000)  # immediately free
    assert nxt.token > lease.token
    # Discarding with a lost lease is harmless and still reports the head.
    assert await client.discard(conv, lease.token) == before
    assert len((await client.read_ledger(conv)).turns) == 1


async def test_transfer_ownership_is_fenced(client, conv):
    history = History()
    await commit_turn(client, conv, history, [1], "a", owner="replica-a")
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    with pytest.raises(VersionConflict):
        await client.transfer_ownership(conv, lease_token=lease.token, expected_version=7,
                                        new_owner="replica-b")
    head = await client.transfer_ownership(conv, lease_token=lease.token, expected_version=1,
                                           new_owner="replica-b")
    assert head.owner_replica == "replica-b" and head.version == 1
    await client.release_lease(conv, lease.token)
    with pytest.raises(LeaseLost):
        await client.transfer_ownership(conv, lease_token=lease.token, expected_version=1,
                                        new_owner="replica-c")
    assert (await client.get_head(conv)).owner_replica == "replica-b"


async def test_delete_drops_head_ledger_and_lease(client, conv):
    history = History()
    await commit_turn(client, conv, history, [1, 2], "a")
    held = await client.acquire_lease(conv, ttl_ms=60_000)
    assert await client.delete_conversation(conv) is True
    with pytest.raises(NotFound):
        await client.get_head(conv)
    with pytest.raises(NotFound):
        await client.read_ledger(conv)
    with pytest.raises(LeaseLost):  # the in-flight turn cannot resurrect it
        await client.publish_turn(conv, lease_token=held.token, expected_version=1, messages=[],
                                  token_ids=[3], committed_tokens=3, tokens_sha256=tokens_digest([1, 2, 3]))
    assert await client.delete_conversation(conv) is False


async def test_busy_conversation_reports_when_not_who(client, conv):
    await client.acquire_lease(conv, ttl_ms=10_000, holder="router:req-9")
    with pytest.raises(LeaseHeld) as info:
        await client.acquire_lease(conv, ttl_ms=10_000, wait_s=0.05)
    assert "holder" not in info.value.details and "router:req-9" not in str(info.value)
    assert 0 < int(info.value.details["expires_in_ms"]) <= 10_000

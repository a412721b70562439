"""The ledger always reads back: serialized-size limits, paging by bytes, rewind, fork."""

import pytest
from cs_helpers import History, commit_turn

from cache_service.client import (AlreadyExists, InvalidArgument, LeaseLost, NotFound,
                                  VersionConflict, key_message)
from cache_service.scripts import EMPTY_TOKENS_SHA256
from proto.contract import ConversationRef, tokens_digest
from proto import cache_pb2 as pb


def with_unknown_field(message: pb.Message, field_number: int, payload: bytes) -> pb.Message:
    """The message plus a length-delimited field its schema does not know."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
            n >>= 7
            if not n:
                return bytes(out)
    raw = message.SerializeToString() + varint(field_number << 3 | 2) + varint(len(payload)) + payload
    return pb.Message.FromString(raw)


async def test_unknown_fields_are_not_stored(client, stub, conv):
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    smuggled = with_unknown_field(pb.Message(role="user", content="hi"), 15, b"\0" * (9 << 20))
    assert smuggled.ByteSize() > 9 << 20
    await stub.PublishTurn(pb.PublishTurnRequest(
        key=key_message(conv), lease_token=lease.token, lease_proof=lease.proof, expected_version=0,
        turn=pb.LedgerTurn(messages=[smuggled], token_ids=[1, 2]), committed_tokens=2,
        tokens_sha256=tokens_digest([1, 2]), publish_id="p"))
    page = await stub.ReadLedger(pb.ReadLedgerRequest(key=key_message(conv)))
    (turn,) = page.turns
    assert [(m.role, m.content) for m in turn.messages] == [("user", "hi")]
    # What was stored is what the schema declares: a small turn that any reply can carry.
    assert page.ByteSize() < 1024


def big_turn(seed: int) -> tuple[list[dict], list[int]]:
    """~6 MiB serialized: 3.5 MiB of text and 512 Ki token ids of 5 varint bytes each."""
    text = chr(ord("a") + seed) * (7 << 19)
    return [{"role": "user", "content": text}], [(1 << 28) + seed] * (1 << 19)


async def test_a_default_read_pages_by_bytes(client, stub, conv):
    history = History()
    for seed in range(2):
        messages, tokens = big_turn(seed)
        lease = await client.acquire_lease(conv, ttl_ms=10_000)
        history.tokens += tokens
        await client.publish_turn(conv, lease_token=lease, expected_version=seed, messages=messages,
                                  token_ids=tokens, committed_tokens=len(history.tokens),
                                  tokens_sha256=tokens_digest(history.tokens))
    await commit_turn(client, conv, History(tokens=history.tokens, version=2), [7], "small")
    # Together the turns are larger than one reply may be; each page holds what fits.
    first = await stub.ReadLedger(pb.ReadLedgerRequest(key=key_message(conv)))
    assert [t.turn for t in first.turns] == [1] and first.next_turn == 2
    second = await stub.ReadLedger(pb.ReadLedgerRequest(key=key_message(conv), from_turn=2))
    assert [t.turn for t in second.turns] == [2] and second.next_turn == 3
    third = await stub.ReadLedger(pb.ReadLedgerRequest(key=key_message(conv), from_turn=3))
    assert [t.turn for t in third.turns] == [3] and third.next_turn == 0
    # The client walks the pages.
    ledger = await client.read_ledger(conv)
    assert [t.turn for t in ledger.turns] == [1, 2, 3] and ledger.next_turn == 0
    assert [t.token_ids[0] for t in ledger.turns] == [1 << 28, (1 << 28) + 1, 7]
    assert ledger.head.committed_tokens == sum(len(t.token_ids) for t in ledger.turns)
    limited = await client.read_ledger(conv, max_turns=2)
    assert [t.turn for t in limited.turns] == [1, 2] and limited.next_turn == 3


async def three_turns(client, conv) -> History:
    history = History()
    for i, tokens in enumerate(([1, 2], [3], [4, 5, 6])):
        await commit_turn(client, conv, history, tokens, f"turn {i + 1}")
    return history


async def test_rewind_truncates_as_a_new_version_and_regenerates(client, conv):
    await three_turns(client, conv)
    await client.put_state(conv, 3, b"state at turn 3")
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    assert lease.head.version == 3 and lease.head.tier_version == 3

    with pytest.raises(VersionConflict):
        await client.rewind_conversation(conv, lease_token=lease, expected_version=2, turn=1)
    with pytest.raises(InvalidArgument):
        await client.rewind_conversation(conv, lease_token=lease, expected_version=3, turn=4)
    intruder = await client.acquire_lease(ConversationRef(conv.id + "-x", conv.salt), ttl_ms=10_000)
    with pytest.raises(LeaseLost):
        await client.rewind_conversation(conv, lease_token=intruder, expected_version=3, turn=1)

    head = await client.rewind_conversation(conv, lease_token=lease, expected_version=3, turn=1,
                                            owner_replica="replica-2")
    assert (head.version, head.turn, head.committed_tokens) == (4, 1, 2)
    assert head.tokens_sha256 == tokens_digest([1, 2]) and head.owner_replica == "replica-2"
    assert head.tier_version == 0  # the tier's state was turn 3's: unreachable now
    with pytest.raises(NotFound):
        await client.get_state(conv)
    # Regenerate turn 2 under the same lease: a new turn on top of turn 1.
    new = await client.publish_turn(conv, lease_token=lease, expected_version=4,
                                    messages=[{"role": "assistant", "content": "again"}], token_ids=[8],
                                    committed_tokens=3, tokens_sha256=tokens_digest([1, 2, 8]))
    assert (new.version, new.turn) == (5, 2)
    ledger = await client.read_ledger(conv)
    assert [list(t.token_ids) for t in ledger.turns] == [[1, 2], [8]]

    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    empty = await client.rewind_conversation(conv, lease_token=lease, expected_version=5, turn=0)
    assert (empty.version, empty.turn, empty.committed_tokens, empty.tokens_sha256) == \
        (6, 0, 0, EMPTY_TOKENS_SHA256)
    assert list((await client.read_ledger(conv)).turns) == []


async def test_fork_copies_a_prefix_into_a_new_conversation(client, conv):
    await three_turns(client, conv)
    before = await client.read_ledger(conv)
    fork = ConversationRef(conv.id + "-fork", conv.salt)
    head = await client.fork_conversation(conv, fork.id, turn=2, expected_version=3)
    assert (head.version, head.turn, head.committed_tokens) == (1, 2, 3)
    assert head.tokens_sha256 == tokens_digest([1, 2, 3]) and head.incarnation
    copied = await client.read_ledger(fork)
    assert list(copied.turns) == list(before.turns[:2])
    assert await client.read_ledger(conv) == before  # the source is untouched
    with pytest.raises(AlreadyExists):
        await client.fork_conversation(conv, fork.id, turn=1)
    with pytest.raises(VersionConflict):
        await client.fork_conversation(conv, fork.id + "2", turn=1, expected_version=2)
    with pytest.raises(NotFound):  # the salt scopes the source too
        await client.fork_conversation(ConversationRef(conv.id, conv.salt + "x"), fork.id + "3", turn=1)
    # The fork lives on its own.
    await commit_turn(client, fork, History(tokens=[1, 2, 3], version=1), [9], "forked turn")
    assert [list(t.token_ids) for t in (await client.read_ledger(fork)).turns] == [[1, 2], [3], [9]]
    assert (await client.get_head(conv)).version == 3

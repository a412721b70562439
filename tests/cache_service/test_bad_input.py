"""Bad input gets the right status code and a message, and writes nothing.

These talk to the raw stub so that the wire-level status code is what is checked,
not the client's interpretation of it.
"""

import hashlib

import grpc
import pytest
from cs_helpers import History, commit_turn

from cache_service.client import NotFound
from proto.contract import tokens_digest
from proto import cache_pb2 as pb

INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def expect(code, call):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    assert info.value.details()  # a message saying what was wrong
    return info.value


def key(conv, **override):
    return pb.ConversationKey(**{"conversation_id": conv.id, "cache_salt": conv.salt, **override})


def publish_request(conv, lease=None, **override):
    fields = dict(key=key(conv), lease_token=lease.token if lease else 1,
                  lease_proof=lease.proof if lease else b"", expected_version=0,
                  turn=pb.LedgerTurn(messages=[pb.Message(role="user", content="hi")], token_ids=[1, 2]),
                  committed_tokens=2, tokens_sha256=tokens_digest([1, 2]), publish_id="p")
    fields.update(override)
    return pb.PublishTurnRequest(**fields)


async def assert_nothing_written(client, conv):
    with pytest.raises(NotFound):
        await client.get_head(conv)
    with pytest.raises(NotFound):
        await client.read_ledger(conv)


@pytest.mark.parametrize("override, fragment", [
    ({"conversation_id": ""}, "conversation_id must not be empty"),
    ({"conversation_id": "x" * 257}, "over the limit"),
    ({"conversation_id": "é" * 129}, "over the limit"),   # 258 bytes in UTF-8
    ({"cache_salt": "s" * 300}, "cache_salt"),
])
async def test_bad_ids_are_refused_everywhere(stub, conv, override, fragment):
    bad = key(conv, **override)
    for call in (stub.GetHead(pb.GetHeadRequest(key=bad)),
                 stub.AcquireLease(pb.AcquireLeaseRequest(key=bad, holder="h", ttl_ms=1000)),
                 stub.ReadLedger(pb.ReadLedgerRequest(key=bad)),
                 stub.DeleteConversation(pb.DeleteConversationRequest(key=bad))):
        error = await expect(INVALID, call)
        assert fragment in error.details()
        assert dict(error.trailing_metadata())["hs-reason"] == "invalid_argument"


async def test_bad_lease_requests(stub, conv):
    await expect(INVALID, stub.AcquireLease(pb.AcquireLeaseRequest(key=key(conv), holder="", ttl_ms=1000)))
    await expect(INVALID, stub.AcquireLease(pb.AcquireLeaseRequest(key=key(conv), holder="h", ttl_ms=0)))
    await expect(INVALID, stub.AcquireLease(pb.AcquireLeaseRequest(key=key(conv), holder="h", ttl_ms=10**8)))
    await expect(INVALID, stub.RenewLease(pb.RenewLeaseRequest(key=key(conv), token=0, ttl_ms=1000)))
    # None of those took the lease.
    lease = await stub.AcquireLease(pb.AcquireLeaseRequest(key=key(conv), holder="h", ttl_ms=1000))
    assert lease.token >= 1


@pytest.mark.parametrize("override, fragment", [
    ({"turn": pb.LedgerTurn(messages=[pb.Message(role="user", content="x" * (4 << 20))], token_ids=[1, 2])},
     "over the limit"),
    ({"turn": pb.LedgerTurn(messages=[pb.Message(role="", content="x")], token_ids=[1, 2])}, "role"),
    ({"turn": pb.LedgerTurn(messages=[pb.Message(role="user", content="x")] * 2000, token_ids=[1, 2])},
     "messages"),
    ({"turn": pb.LedgerTurn(messages=[], token_ids=[])}, "token_ids must not be empty"),
    ({"turn": pb.LedgerTurn(token_ids=[1] * ((1 << 20) + 1)), "committed_tokens": (1 << 20) + 1},
     "token ids"),
    ({"tokens_sha256": "abc"}, "tokens_sha256"),
    ({"tokens_sha256": "A" * 64}, "tokens_sha256"),
    ({"publish_id": ""}, "publish_id"),
    ({"lease_token": 0}, "lease_token"),
    ({"committed_tokens": 1}, "committed_tokens"),
])
async def test_bad_publish_writes_nothing(stub, client, conv, override, fragment):
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    request = publish_request(conv, lease)
    for name, value in override.items():
        if name == "turn":
            request.turn.CopyFrom(value)
        else:
            setattr(request, name, value)
    error = await expect(INVALID, stub.PublishTurn(request))
    assert fragment in error.details()
    await assert_nothing_written(client, conv)
    # The lease survived the refused publish: the holder can still commit properly.
    head = await stub.PublishTurn(publish_request(conv, lease))
    assert head.version == 1


async def test_oversized_message_over_the_transport_limit(stub, client, conv):
    lease = await client.acquire_lease(conv, ttl_ms=10_000)
    huge = publish_request(conv, lease,
                           turn=pb.LedgerTurn(messages=[pb.Message(role="user", content="x" * (40 << 20))],
                                              token_ids=[1, 2]))
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, stub.PublishTurn(huge))
    await assert_nothing_written(client, conv)


async def test_unknown_conversation(stub, conv):
    await expect(grpc.StatusCode.NOT_FOUND, stub.GetHead(pb.GetHeadRequest(key=key(conv))))
    await expect(grpc.StatusCode.NOT_FOUND, stub.ReadLedger(pb.ReadLedgerRequest(key=key(conv))))
    await expect(grpc.StatusCode.NOT_FOUND, stub.GetState(pb.GetStateRequest(key=key(conv))).read())
    # No lease on an unknown conversation: transfer is refused before anything else.
    error = await expect(grpc.StatusCode.FAILED_PRECONDITION, stub.TransferOwnership(
        pb.TransferOwnershipRequest(key=key(conv), lease_token=1, expected_version=1, new_owner="r")))
    assert dict(error.trailing_metadata())["hs-reason"] == "lease_lost"


def manifest_request(conv, chunks, version=1, incarnation="0" * 16, **size_override):
    return pb.PutStateRequest(manifest=pb.StateManifest(
        key=key(conv), version=version, incarnation=incarnation, chunks=[
            pb.ChunkRef(digest=hashlib.sha256(c).digest(), size=size_override.get("size", len(c)))
            for c in chunks]))


def chunk_request(data, digest=None):
    return pb.PutStateRequest(chunk=pb.Chunk(digest=digest or hashlib.sha256(data).digest(), data=data))


async def stream(*messages):
    for m in messages:
        yield m


@pytest.mark.parametrize("case", ["no_manifest", "digest_mismatch", "unknown_digest", "short_digest",
                                  "size_mismatch", "oversized_chunk", "empty_manifest", "version_zero",
                                  "second_manifest", "no_incarnation"])
async def test_malformed_state_streams_store_nothing(stub, client, conv, case):
    await commit_turn(client, conv, History(), [1], "t")
    inc = (await client.get_head(conv)).incarnation
    good = b"state bytes" * 100
    m = manifest_request(conv, [good], incarnation=inc)
    streams = {
        "no_manifest": [chunk_request(good)],
        "digest_mismatch": [m, chunk_request(good[:-1] + b"!", digest=hashlib.sha256(good).digest())],
        "unknown_digest": [m, chunk_request(b"other")],
        "short_digest": [pb.PutStateRequest(manifest=pb.StateManifest(
            key=key(conv), version=1, incarnation=inc, chunks=[pb.ChunkRef(digest=b"\1" * 31, size=3)]))],
        "size_mismatch": [manifest_request(conv, [good], size=len(good) + 1, incarnation=inc),
                          chunk_request(good)],
        "oversized_chunk": [manifest_request(conv, [good], size=(4 << 20) + 1, incarnation=inc)],
        "empty_manifest": [pb.PutStateRequest(manifest=pb.StateManifest(key=key(conv), version=1,
                                                                        incarnation=inc))],
        "version_zero": [manifest_request(conv, [good], version=0, incarnation=inc), chunk_request(good)],
        "second_manifest": [m, m],
        "no_incarnation": [manifest_request(conv, [good], incarnation=""), chunk_request(good)],
    }
    await expect(INVALID, stub.PutState(stream(*streams[case])))
    await expect(grpc.StatusCode.NOT_FOUND, stub.GetState(pb.GetStateRequest(key=key(conv))).read())
    assert (await client.get_head(conv)).tier_version == 0


async def test_put_referencing_chunks_nobody_sent(stub, client, conv):
    await commit_turn(client, conv, History(), [1], "t")
    inc = (await client.get_head(conv)).incarnation
    error = await expect(grpc.StatusCode.FAILED_PRECONDITION,
                         stub.PutState(stream(manifest_request(conv, [b"never sent"], incarnation=inc))))
    assert dict(error.trailing_metadata())["hs-reason"] == "missing_chunks"
    assert (await client.get_head(conv)).tier_version == 0


async def test_put_for_an_unknown_conversation(stub, conv):
    data = b"x" * 10
    await expect(grpc.StatusCode.NOT_FOUND, stub.PutState(stream(manifest_request(conv, [data]),
                                                                 chunk_request(data))))
    await expect(grpc.StatusCode.NOT_FOUND, stub.GetState(pb.GetStateRequest(key=key(conv))).read())

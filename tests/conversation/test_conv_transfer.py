"""Export of a committed head as a checksummed byte stream, import into another engine.

    stream = MAGIC | header length | header | included KV blocks | Mamba states | sha256

Import into a fresh engine gives the same ledger and byte-identical state, so the next turn
is identical (tokens and logprobs, exactly) to the exporter's. A damaged stream is rejected
with CorruptStateError and changes nothing. An incremental export leaves out the full blocks
the receiver already holds; it is smaller and imports to the same state.
"""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from tests.conversation.helpers import (
    BLOCK,
    check_turn_against_reference,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    run_turn,
    snapshot,
    user,
)
from workers.checkpoint import Arch
from workers.conversation.transfer import MAGIC, HeadTransfer
from workers.errors import ConversationBusyError, ConversationNotFoundError, CorruptStateError

ARCHS = pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)


def conversation_on_new_engine(models, reference_engines, arch, turns: int = 2):
    eng = new_engine(models[arch])
    cc = new_cache(eng)
    for turn in range(1, turns + 1):
        check_turn_against_reference(cc, reference_engines[arch], "c1", "s", user(f"say {turn}"), greedy(7), f"t{turn}")
    return cc, HeadTransfer(cc)


def receiver(models, arch):
    cc = new_cache(new_engine(models[arch]))
    return cc, HeadTransfer(cc)


def assert_same_head_state(a_cc, b_cc):
    a, b = head_of(a_cc, "c1", "s"), head_of(b_cc, "c1", "s")
    assert (a.turn, a.state_len, a.aligned_len) == (b.turn, b.state_len, b.aligned_len)
    sa, sb = snapshot(a_cc.engine, a.holder), snapshot(b_cc.engine, b.holder)
    for name in ("kv", "conv", "ssm"):
        for x, y in zip(getattr(sa, name), getattr(sb, name)):
            assert torch.equal(x, y), name


def assert_nothing_imported(cc):
    assert not cc.conversations and len(cc.heads) == 0
    kv, slots = cc.engine.caches.kv.usage(), cc.engine.caches.states.usage()
    assert kv.free == kv.total and slots.free == slots.total


def reseal(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def split(stream: bytes) -> tuple[dict, int]:
    """(header, offset of the first payload byte)."""
    (length,) = struct.unpack_from("<I", stream, len(MAGIC))
    start = len(MAGIC) + 4
    return json.loads(stream[start : start + length]), start + length


@ARCHS
def test_export_import_next_turn_identical(models, reference_engines, arch):
    a_cc, a_tr = conversation_on_new_engine(models, reference_engines, arch)
    stream = a_tr.export_head("c1", "s")
    b_cc, b_tr = receiver(models, arch)
    assert b_tr.import_head(stream, "s") == "c1"
    assert b_cc.describe("c1", "s") == a_cc.describe("c1", "s")
    assert_same_head_state(a_cc, b_cc)

    head = head_of(b_cc, "c1", "s")
    a_next = run_turn(a_cc, "c1", "s", user("go on"), greedy(9), "a3")
    b_next = check_turn_against_reference(b_cc, reference_engines[arch], "c1", "s", user("go on"), greedy(9), "b3")
    assert b_next.num_cached_tokens == head.state_len, "the imported head is reused"
    assert (b_next.tokens, b_next.logprobs) == (a_next.tokens, a_next.logprobs), "same state, same bits"
    assert b_cc.describe("c1", "s") == a_cc.describe("c1", "s")


def test_corrupted_streams_are_rejected(models, reference_engines):
    arch = Arch.BAMBA
    a_cc, a_tr = conversation_on_new_engine(models, reference_engines, arch)
    stream = a_tr.export_head("c1", "s")
    _, payload = split(stream)
    state_start = len(stream) - 32 - len(a_tr._state_bytes(a_cc.states.slots[head_of(a_cc, "c1", "s").holder]))

    def flip(data: bytes, at: int) -> bytes:
        return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]

    damaged = {
        "header byte": flip(stream, len(MAGIC) + 10),
        "block byte": flip(stream, payload + 5),
        "state byte": flip(stream, state_start + 7),
        "trailer byte": flip(stream, len(stream) - 1),
        "truncated": stream[:-100],
        "magic": b"X" + stream[1:],
        "empty": b"",
        # Re-sealed: the trailer is right, the per-block and state checksums are not.
        "block byte, re-sealed": reseal(flip(stream[:-32], payload + 5)),
        "state byte, re-sealed": reseal(flip(stream[:-32], state_start + 7)),
    }
    b_cc, b_tr = receiver(models, arch)
    for what, data in damaged.items():
        try:
            b_tr.import_head(data, "s")
        except CorruptStateError:
            pass
        else:
            pytest.fail(f"a stream with a damaged {what} was imported")
        assert_nothing_imported(b_cc)
    with pytest.raises(CorruptStateError):
        b_tr.import_head(stream, "another salt")  # never someone else's state
    assert_nothing_imported(b_cc)
    other_cc, other_tr = receiver(models, Arch.NEMOTRON_H)
    with pytest.raises(CorruptStateError):
        other_tr.import_head(stream, "s")  # another model
    assert_nothing_imported(other_cc)
    b_tr.import_head(stream, "s")  # the intact stream still imports
    assert_same_head_state(a_cc, b_cc)


def test_resealed_stream_with_inconsistent_head_is_rejected(models, reference_engines):
    """A stream whose checksums are right but whose head does not match its own content (a
    committed length the blocks or the ledger do not cover) must not become a head."""
    a_cc, a_tr = conversation_on_new_engine(models, reference_engines, Arch.BAMBA)
    stream = a_tr.export_head("c1", "s")
    header, payload = split(stream)
    b_cc, b_tr = receiver(models, Arch.BAMBA)
    for field, value in [("state_len", header["head"]["state_len"] + 3 * BLOCK), ("turn", 7)]:
        bad = json.loads(json.dumps(header))
        bad["head"][field] = value
        raw = json.dumps(bad, separators=(",", ":")).encode()
        tampered = reseal(MAGIC + struct.pack("<I", len(raw)) + raw + stream[payload:-32])
        with pytest.raises(CorruptStateError):
            b_tr.import_head(tampered, "s")
        assert_nothing_imported(b_cc)


def test_incremental_export_leaves_out_known_blocks(models, reference_engines):
    arch = Arch.GRANITEMOEHYBRID
    ref = reference_engines[arch]
    a_cc, a_tr = conversation_on_new_engine(models, reference_engines, arch)
    b_cc, b_tr = receiver(models, arch)
    b_tr.import_head(a_tr.export_head("c1", "s"), "s")
    shared_len = head_of(b_cc, "c1", "s").state_len

    check_turn_against_reference(a_cc, ref, "c1", "s", user("one more"), greedy(7), "a3")
    full = a_tr.export_head("c1", "s")
    have = set(b_tr.known_block_digests())
    incremental = a_tr.export_head("c1", "s", have=have)
    left_out = sum(not b["included"] for b in split(incremental)[0]["blocks"])
    assert left_out >= shared_len // BLOCK, "the blocks of the previous head are not resent"
    block_bytes = a_cc.engine.kv_layout.block_bytes
    assert len(full) - len(incremental) >= left_out * (block_bytes - len("false")), (len(full), len(incremental))

    fresh_cc, fresh_tr = receiver(models, arch)
    with pytest.raises(CorruptStateError):
        fresh_tr.import_head(incremental, "s")  # lacks the blocks it leaves out
    assert_nothing_imported(fresh_cc)

    b_tr.import_head(incremental, "s")
    assert b_cc.describe("c1", "s") == a_cc.describe("c1", "s")
    assert_same_head_state(a_cc, b_cc)
    a_next = run_turn(a_cc, "c1", "s", user("and then"), greedy(8), "a4")
    b_next = check_turn_against_reference(b_cc, ref, "c1", "s", user("and then"), greedy(8), "b4")
    assert (b_next.tokens, b_next.logprobs) == (a_next.tokens, a_next.logprobs)
    assert b_next.num_cached_tokens == a_next.num_cached_tokens > 0


def test_import_into_busy_conversation_and_export_without_head(models, reference_engines):
    arch = Arch.NEMOTRON_H
    a_cc, a_tr = conversation_on_new_engine(models, reference_engines, arch)
    stream = a_tr.export_head("c1", "s")
    b_cc, b_tr = receiver(models, arch)
    b_tr.import_head(stream, "s")
    b_cc.begin_turn("c1", "s", user("in flight"), greedy(4), "busy")
    ledger = b_cc.describe("c1", "s")
    with pytest.raises(ConversationBusyError):
        b_tr.import_head(stream, "s")
    assert b_cc.describe("c1", "s") == ledger and set(b_cc.pending) == {"busy"}
    drive(b_cc.engine)

    with pytest.raises(ConversationNotFoundError):
        a_tr.export_head("nobody", "s")
    with pytest.raises(ConversationNotFoundError):
        a_tr.export_head("c1", "wrong salt")
    a_cc.rewind("c1", "s", 1)  # turn 1's head is not retained
    with pytest.raises(ConversationNotFoundError):
        a_tr.export_head("c1", "s")

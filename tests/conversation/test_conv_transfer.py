"""Exports as content-addressed chunks, imports into another engine.

Import into a fresh engine (ledger adopted from "the service", here the exporter's
`describe()["ledger"]`) gives byte-identical state, so the next turn is identical (tokens and
logprobs, exactly). Consecutive exports share their unchanged full-block chunks by name, and
an importer that holds them receives only the new ones. Any damaged chunk or header is
rejected with CorruptStateError and changes nothing; so is an import that does not fit.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from proto.contract import ConversationRef
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
from tests.conversation.test_conv_eviction import sizes
from tests.families import ARCHS
from workers.checkpoint import Arch
from workers.conversation.export import ChunkKind, ExportedHead, build_export, verify_export
from workers.errors import ConversationBusyError, ConversationNotFoundError, CorruptStateError, OutOfCacheError

C1 = ConversationRef("c1", "s")  # the conversation most tests here use


def conversation(models, reference_engines, arch, turns: int = 2, **limits):
    cc = new_cache(new_engine(models[arch], **limits))
    for turn in range(1, turns + 1):
        check_turn_against_reference(cc, reference_engines[arch], "c1", "s", user(f"say {turn}"), greedy(7), f"t{turn}")
    return cc


def export_from(cc, cid: str = "c1") -> ExportedHead:
    snap = cc.snapshot_head(ConversationRef(cid, "s"))  # engine thread: copies only
    exported = build_export(snap)  # anywhere: hashing and serialization
    cc.remember_chunks(snap, exported)
    return exported


def adopt_from(src, dst, cid: str = "c1") -> None:
    ledger = src.describe(ConversationRef(cid, "s"))
    dst.adopt_ledger(ConversationRef(cid, "s"), version=ledger["version"], turns=ledger["ledger"])


def import_into(dst, exported: ExportedHead, chunks: dict[str, bytes] | None = None, cid: str = "c1"):
    """What the worker does: send only what the importer lacks, verify, install."""
    held = dst.held_chunk_digests()
    if chunks is None:
        chunks = {d: data for d, data in exported.chunks if d not in held}
    identity, layout = dst.export_identity()
    verified = verify_export(exported.header, chunks, identity, layout, held)
    return dst.install_head(ConversationRef(cid, "s"), verified), chunks


def assert_same_head_state(a_cc, b_cc):
    a, b = head_of(a_cc, "c1", "s"), head_of(b_cc, "c1", "s")
    assert (a.turn, a.state_len, a.aligned_len, a.version) == (b.turn, b.state_len, b.aligned_len, b.version)
    sa, sb = snapshot(a_cc.engine, a.holder), snapshot(b_cc.engine, b.holder)
    full = a.state_len // BLOCK  # the tail block past state_len is not part of the state
    for x, y in zip(sa.kv, sb.kv):
        assert x[:, :full].equal(y[:, :full]) and x.flatten(1, 2)[:, : a.state_len].equal(y.flatten(1, 2)[:, : a.state_len])
    for x, y in zip(sa.conv + sa.ssm, sb.conv + sb.ssm):
        assert x.equal(y)


def assert_nothing_installed(cc):
    assert cc.head_count() == 0
    kv, slots = cc.engine.caches.kv.usage(), cc.engine.caches.states.usage()
    assert kv.free == kv.total and slots.free == slots.total


@ARCHS
def test_export_import_next_turn_identical(models, reference_engines, arch):
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    header = json.loads(exported.header[:-32])
    text = exported.header[:-32].decode()
    assert '"c1"' not in text and "say 1" not in text, "ids and message text travel only as hashes"
    assert {c["kind"] for c in header["chunks"]} >= {ChunkKind.KV, ChunkKind.STATE}
    b_cc = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, b_cc)
    info, _ = import_into(b_cc, exported)
    assert (info.turn, info.version) == (2, 2)
    assert b_cc.describe(C1) == a_cc.describe(C1)
    assert_same_head_state(a_cc, b_cc)

    head = head_of(b_cc, "c1", "s")
    a_next = run_turn(a_cc, "c1", "s", user("go on"), greedy(9), "a3")
    b_next = check_turn_against_reference(b_cc, reference_engines[arch], "c1", "s", user("go on"), greedy(9), "b3")
    assert b_next.num_cached_tokens == head.state_len, "the imported head is reused"
    assert (b_next.tokens, b_next.logprobs) == (a_next.tokens, a_next.logprobs), "same state, same bits"


def test_consecutive_exports_share_blocks_and_imports_are_incremental(models, reference_engines):
    arch = Arch.GRANITEMOEHYBRID
    a_cc = conversation(models, reference_engines, arch, turns=1)
    first = export_from(a_cc)
    b_cc = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, b_cc)
    import_into(b_cc, first)

    check_turn_against_reference(a_cc, reference_engines[arch], "c1", "s", user("one more"), greedy(7), "t2")
    second = export_from(a_cc)
    kinds = lambda e: [c["kind"] for c in json.loads(e.header[:-32])["chunks"]]  # noqa: E731
    first_blocks = [d for (d, _), k in zip(first.chunks, kinds(first)) if k == ChunkKind.KV]
    assert first_blocks and second.digests[: len(first_blocks)] == first_blocks, "unchanged blocks, same names"

    adopt_from(a_cc, b_cc)
    _, sent = import_into(b_cc, second)
    assert set(sent) == set(second.digests) - set(first_blocks), "only the new chunks travel"
    assert b_cc.describe(C1) == a_cc.describe(C1)
    assert_same_head_state(a_cc, b_cc)
    a_next = run_turn(a_cc, "c1", "s", user("and then"), greedy(8), "a3")
    b_next = run_turn(b_cc, "c1", "s", user("and then"), greedy(8), "b3")
    assert (b_next.tokens, b_next.logprobs) == (a_next.tokens, a_next.logprobs)

    fresh = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, fresh)
    with pytest.raises(CorruptStateError, match="neither in the export nor held"):
        import_into(fresh, second, chunks=sent)  # lacks the blocks the other importer held
    assert_nothing_installed(fresh)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def test_corruption_of_any_chunk_or_the_header_is_detected(models, reference_engines):
    arch = Arch.BAMBA
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    b_cc = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, b_cc)
    intact = dict(exported.chunks)
    for i, (digest, data) in enumerate(exported.chunks):
        damaged = dict(intact)
        damaged[digest] = _flip(data, (7 * i + 3) % len(data))
        with pytest.raises(CorruptStateError, match="checksum"):
            import_into(b_cc, exported, chunks=damaged)
        assert_nothing_installed(b_cc)
    for at in (0, 10, len(exported.header) - 1):
        with pytest.raises(CorruptStateError):
            import_into(b_cc, ExportedHead(_flip(exported.header, at), exported.chunks))
    # Re-sealed header whose head does not match its own chunks.
    header = json.loads(exported.header[:-32])
    header["state_len"] += 3 * BLOCK
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptStateError, match="inconsistent"):
        import_into(b_cc, ExportedHead(raw + hashlib.sha256(raw).digest(), exported.chunks))
    with pytest.raises(CorruptStateError, match="another conversation"):
        identity, layout = b_cc.export_identity()
        b_cc.install_head(ConversationRef("c1", "another salt"),
                          verify_export(exported.header, intact, identity, layout))
    other = new_cache(new_engine(models[Arch.NEMOTRON_H]))
    adopt_from(a_cc, other)
    with pytest.raises(CorruptStateError):
        import_into(other, exported)  # another model
    assert_nothing_installed(b_cc)
    import_into(b_cc, exported)  # the intact export still installs
    assert_same_head_state(a_cc, b_cc)


def test_an_import_that_does_not_fit_changes_nothing(models, reference_engines):
    arch = Arch.BAMBA
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    blocks = len(a_cc.engine.caches.kv.table(head_of(a_cc, "c1", "s").holder))
    block_bytes, _ = sizes(models[arch])
    b_cc = new_cache(new_engine(models[arch], kv_cache_bytes=(blocks - 1) * block_bytes))
    adopt_from(a_cc, b_cc)
    with pytest.raises(OutOfCacheError):
        import_into(b_cc, exported)
    assert_nothing_installed(b_cc)  # and the per-test check finds no head holder nobody knows


def test_an_import_never_evicts_the_blocks_it_shares(models, reference_engines):
    """The importer holds turn 1's head; turn 2's new blocks only fit once turn 1's head is
    evicted: the blocks turn 2 shares with it must survive that eviction."""
    arch = Arch.BAMBA
    a_cc = conversation(models, reference_engines, arch, turns=1)
    first = export_from(a_cc)
    check_turn_against_reference(a_cc, reference_engines[arch], "c1", "s", user("more"), greedy(7), "t2")
    second = export_from(a_cc)
    head1_len = json.loads(first.header[:-32])["state_len"]
    n2 = -(-json.loads(second.header[:-32])["state_len"] // BLOCK)
    assert head1_len % BLOCK, "turn 1's head must have a tail block for this pool size to be tight"
    block_bytes, _ = sizes(models[arch])
    b_cc = new_cache(new_engine(models[arch], kv_cache_bytes=n2 * block_bytes))
    b_cc.adopt_ledger(C1, version=1, turns=a_cc.describe(C1)["ledger"][:1])
    import_into(b_cc, first)
    adopt_from(a_cc, b_cc)  # the ledger at turn 2: turn 1's head stays valid
    assert head_of(b_cc, "c1", "s", turn=1) is not None
    import_into(b_cc, second)
    assert b_cc.stats()["evictions"] == 1
    assert_same_head_state(a_cc, b_cc)


def test_busy_and_unknown_conversations(models, reference_engines):
    arch = Arch.NEMOTRON_H
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    b_cc = new_cache(new_engine(models[arch]))
    with pytest.raises(ConversationNotFoundError, match="adopt"):
        import_into(b_cc, exported)  # no ledger adopted
    adopt_from(a_cc, b_cc)
    import_into(b_cc, exported)
    b_cc.begin_turn(C1, user("in flight"), greedy(4), "busy")
    with pytest.raises(ConversationBusyError):
        import_into(b_cc, exported)
    with pytest.raises(ConversationBusyError):
        adopt_from(a_cc, b_cc)
    drive(b_cc.engine)
    with pytest.raises(ConversationNotFoundError):
        a_cc.snapshot_head(ConversationRef("nobody", "s"))
    with pytest.raises(ConversationNotFoundError):
        a_cc.snapshot_head(ConversationRef("c1", "wrong salt"))
    a_cc.rewind(C1, 1)  # turn 1's head is not retained
    with pytest.raises(ConversationNotFoundError):
        a_cc.snapshot_head(C1)


def test_an_import_that_resends_a_block_never_frees_the_ones_it_shares(models, reference_engines):
    """The importer's pool is full (conversation c1 at turn 1, then x). Turn 2 of c1 arrives
    with its block 0 resent and its other full blocks shared: making room for block 0 evicts
    c1's turn-1 head (the LRU), which owns the blocks about to be shared. They must survive."""
    arch = Arch.BAMBA
    a_cc = new_cache(new_engine(models[arch]), retain_turns=2)
    run_turn(a_cc, "c1", "s", user("say 1 and more"), greedy(9), "t1")
    run_turn(a_cc, "x", "s", user("other"), greedy(9), "x1")
    first, other = export_from(a_cc), export_from(a_cc, "x")
    n1 = -(-json.loads(first.header[:-32])["state_len"] // BLOCK)
    nx = -(-json.loads(other.header[:-32])["state_len"] // BLOCK)
    run_turn(a_cc, "c1", "s", user("more"), greedy(7), "t2")
    second = export_from(a_cc)
    block_bytes, _ = sizes(models[arch])
    b_cc = new_cache(new_engine(models[arch], kv_cache_bytes=(n1 + nx) * block_bytes))
    b_cc.adopt_ledger(C1, version=1, turns=a_cc.describe(C1)["ledger"][:1])
    import_into(b_cc, first)
    adopt_from(a_cc, b_cc, "x")
    import_into(b_cc, other, cid="x")
    adopt_from(a_cc, b_cc)
    held = b_cc.held_chunk_digests()
    resend = {d: data for i, (d, data) in enumerate(second.chunks) if i == 0 or d not in held}
    assert len(resend) < len(second.chunks), "some blocks are shared"
    evictions = b_cc.stats()["evictions"]
    import_into(b_cc, second, chunks=resend)
    assert b_cc.stats()["evictions"] > evictions, "the pool was full: room came from evicting a head"
    assert_same_head_state(a_cc, b_cc)


def test_a_header_whose_length_disagrees_with_the_ledger_is_refused(models, reference_engines):
    """A sealed, self-consistent header whose committed length is not the ledger's: its
    tokens_digest matches the ledger, so only comparing the lengths catches it (it used to
    install a head whose state_len the next turn would trust)."""
    arch = Arch.BAMBA
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    b_cc = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, b_cc)
    header = json.loads(exported.header[:-32])
    n = header["state_len"]
    # A shift that keeps the chunk list consistent (same full blocks, a tail either way).
    shift = next(d for d in (1, -1) if (n + d) // BLOCK == n // BLOCK and (n + d) % BLOCK and n % BLOCK)
    header["state_len"] += shift
    header["committed_tokens"] += shift
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptStateError, match="ledger"):
        import_into(b_cc, ExportedHead(raw + hashlib.sha256(raw).digest(), exported.chunks))
    assert_nothing_installed(b_cc)
    import_into(b_cc, exported)
    assert_same_head_state(a_cc, b_cc)


def test_an_export_without_the_aligned_state_is_refused(models, reference_engines):
    """Every head holds a terminal and an aligned state. An export without the aligned one
    used to install a one-slot head; a turn continuing it then took its aligned_len from the
    header while its aligned slot held whatever an earlier owner left there."""
    arch = Arch.BAMBA
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    b_cc = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, b_cc)
    header = json.loads(exported.header[:-32])
    header["chunks"] = [c for c in header["chunks"] if c.get("role") != "aligned"]
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(CorruptStateError, match="slot roles"):
        import_into(b_cc, ExportedHead(raw + hashlib.sha256(raw).digest(), exported.chunks))
    assert_nothing_installed(b_cc)


def test_an_export_whose_messages_are_not_the_ledgers_is_refused(models, reference_engines):
    """The header carries the digest of the messages it was made for. A ledger with the same
    token ids but other message text (a later edit of the record, a mix-up of conversations)
    used to accept the head; the messages digest is now checked like the tokens digest."""
    arch = Arch.BAMBA
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    b_cc = new_cache(new_engine(models[arch]))
    ledger = a_cc.describe(C1)
    first, *rest = ledger["ledger"]
    edited = type(first)(({**first.messages[0], "content": "something else"}, *first.messages[1:]), first.token_ids)
    b_cc.adopt_ledger(C1, version=ledger["version"], turns=[edited, *rest])
    with pytest.raises(CorruptStateError, match="ledger"):
        import_into(b_cc, exported)
    assert_nothing_installed(b_cc)
    adopt_from(a_cc, b_cc)
    import_into(b_cc, exported)
    assert_same_head_state(a_cc, b_cc)


def test_a_tier_copy_older_than_the_ledger_spares_the_turns_it_covers(models, reference_engines):
    """The owner died before exporting turn 2: the tier still holds turn 1's head. Imported
    under the ledger at turn 2, it is continued by turn 3, which runs turn 2's tokens and its own
    and nothing before them; its output is the stateless one."""
    arch = Arch.NEMOTRON_H
    a_cc = conversation(models, reference_engines, arch, turns=1)
    first = export_from(a_cc)
    check_turn_against_reference(a_cc, reference_engines[arch], "c1", "s", user("say 2"), greedy(7), "t2")
    b_cc = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, b_cc)  # the service's ledger: turn 2
    import_into(b_cc, first)
    older = head_of(b_cc, "c1", "s", turn=1)
    assert older is not None and head_of(b_cc, "c1", "s") is None
    third = check_turn_against_reference(b_cc, reference_engines[arch], "c1", "s", user("say 3"), greedy(7), "t3")
    assert third.num_cached_tokens == older.state_len > 0
    assert head_of(b_cc, "c1", "s").turn == 3 and b_cc.stats()["hits"] == 1
    # The same old copy arriving again, now that turn 3's head is held: nothing is installed.
    kv_free = b_cc.engine.caches.kv.usage().free
    assert import_into(b_cc, first)[0].turn == 3
    assert head_of(b_cc, "c1", "s", turn=1) is None and b_cc.engine.caches.kv.usage().free == kv_free


def test_a_head_whose_conversation_went_on_elsewhere_is_continued_when_it_comes_back(models, reference_engines):
    """Replica A served turn 1, replica B turn 2; turn 3 comes back to A, which adopts the ledger
    at turn 2: its turn-1 head still matches it and spares turn 1's tokens."""
    arch = Arch.BAMBA
    a_cc = conversation(models, reference_engines, arch, turns=1)
    b_cc = new_cache(new_engine(models[arch]))
    adopt_from(a_cc, b_cc)
    import_into(b_cc, export_from(a_cc))
    check_turn_against_reference(b_cc, reference_engines[arch], "c1", "s", user("say 2"), greedy(7), "t2")
    adopt_from(b_cc, a_cc)
    kept = head_of(a_cc, "c1", "s", turn=1)
    assert kept is not None and head_of(a_cc, "c1", "s") is None
    third = check_turn_against_reference(a_cc, reference_engines[arch], "c1", "s", user("say 3"), greedy(7), "t3")
    assert third.num_cached_tokens == kept.state_len > 0


def test_an_imported_head_is_not_evicted_by_its_own_import_when_the_heads_held_wait_for_tools(
        models, reference_engines):
    """A conversation moves to a replica whose head budget is full of agent loops' heads waiting
    for their tools' results (evicted after every other head). The head it imports for the turn
    about to run must not be the one that goes to make room: the turn would recompute the whole
    history, though it was routed there for the import."""
    arch = Arch.GRANITEMOEHYBRID

    def loops_waiting_for_tools(cc):
        for cid in ("loop1", "loop2"):
            run_turn(cc, cid, "s", user(f"call a tool, {cid}"), greedy(7), f"{cid}-t1")
            head_of(cc, cid, "s").awaiting_tool = True  # its reply was a tool call (the tiny model's are not)

    probe = new_cache(new_engine(models[arch]))
    loops_waiting_for_tools(probe)
    a_cc = conversation(models, reference_engines, arch)
    exported = export_from(a_cc)
    # Room for the two loops' heads and less than the imported one besides.
    b_cc = new_cache(new_engine(models[arch], head_cache_bytes=probe.engine.caches.heads.bytes_used() + BLOCK))
    loops_waiting_for_tools(b_cc)
    adopt_from(a_cc, b_cc)
    info, _ = import_into(b_cc, exported)
    assert head_of(b_cc, "c1", "s") is not None, "the import evicted the head it installed"
    a_next = run_turn(a_cc, "c1", "s", user("go on"), greedy(9), "a3")
    b_next = run_turn(b_cc, "c1", "s", user("go on"), greedy(9), "b3")
    assert b_next.num_cached_tokens == info.state_len > 0, "the imported head is reused"
    assert (b_next.tokens, b_next.logprobs) == (a_next.tokens, a_next.logprobs)
    assert b_cc.engine.caches.heads.bytes_used() <= b_cc.engine.caches.heads.budget_bytes

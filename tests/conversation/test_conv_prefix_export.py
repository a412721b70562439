"""Prefix checkpoints travel: one engine's checkpoint (a system prompt's mark, a stateless
request's end), exported and installed in another engine, is attached there by a request whose
tokens begin with it, with the same tokens as a recompute; only under the scope it was made in,
and all-or-nothing."""

from __future__ import annotations

import pytest

from tests.conversation.helpers import MiB, assert_same_output, drive, greedy, new_cache, new_engine, run_stateless, user
from workers.checkpoint import Arch
from workers.conversation.export import build_export, verify_export
from workers.conversation.export_format import pack_export, unpack_export
from workers.conversation.prefix_export import held_prefix_length, install_checkpoint, snapshot_checkpoint
from workers.errors import CorruptStateError, OutOfCacheError
from workers.request import KeepState, ReuseSource

SYSTEM = [{"role": "system", "content": "You are a travel agent's assistant. Answer briefly and cite the tool you used."}]
SALT = "tenant-a"


def prefix_engine(models):
    return new_cache(new_engine(models[Arch.BAMBA], prefix_cache_bytes=8 * MiB))


def stateless(cc, rid: str, messages, salt: str = SALT):
    request = cc.begin_stateless(messages, greedy(6), rid, salt)
    result = drive(cc.engine)[rid]
    result.request = request
    return result


def exported_blob(cc, key) -> bytes:
    snap = snapshot_checkpoint(cc.engine, key)
    assert snap is not None
    return b"".join(pack_export(build_export(snap)))


def verified(cc, blob: bytes):
    header, chunks = unpack_export(blob)
    identity, layout = cc.export_identity()
    return verify_export(header, chunks, identity, layout, cc.held_chunk_digests())


def test_a_system_prompts_checkpoint_imported_elsewhere_serves_new_chats_there(models, reference_engines):
    a, b = prefix_engine(models), prefix_engine(models)
    made = stateless(a, "a1", SYSTEM + user("hello"))
    system = next(k for (label, _), k in zip(made.request.checkpoints_made, made.request.checkpoint_keys) if label == 1)
    blob = exported_blob(a, system)
    assert SALT.encode() not in blob, "the scope travels only as a digest"

    key = install_checkpoint(b.engine, SALT, verified(b, blob))
    assert key == system
    chat = SYSTEM + user("good morning")
    prompt = b.engine.tokenizer.encode(b.engine.tokenizer.render_chat(chat))
    assert held_prefix_length(b.engine, SALT, prompt) == system.length
    there = stateless(b, "b1", chat)
    assert there.num_cached_tokens == system.length and there.request.reused_from is ReuseSource.PREFIX
    ref = reference_engines[Arch.BAMBA]
    assert_same_output(there, run_stateless(ref, {"ref-b1": prompt}, greedy(6))["ref-b1"], "imported system prompt")


def test_a_requests_end_imported_elsewhere_serves_its_next_step_with_the_same_tokens(models, reference_engines):
    a, b = prefix_engine(models), prefix_engine(models)
    made = stateless(a, "a1", SYSTEM + user("book me a train"))
    end = made.request.checkpoint_keys[-1]
    covered = made.request.token_ids[: end.length]
    install_checkpoint(b.engine, SALT, verified(b, exported_blob(a, end)))
    prompt = covered + b.engine.tokenizer.encode("<tool>two seats left</tool>")
    b.engine.add_request("b2", prompt, greedy(6), prefix_scope=SALT, keep=KeepState.CHECKPOINT)
    there = drive(b.engine)["b2"]
    assert there.num_cached_tokens == end.length
    ref = reference_engines[Arch.BAMBA]
    assert_same_output(there, run_stateless(ref, {"ref-b2": prompt}, greedy(6))["ref-b2"], "imported end")


def test_another_scope_never_installs_it_and_a_refused_import_changes_nothing(models):
    a, b = prefix_engine(models), prefix_engine(models)
    made = stateless(a, "a1", SYSTEM + user("hello"))
    blob = exported_blob(a, made.request.checkpoint_keys[0])
    before = (b.engine.caches.kv.usage(), b.engine.caches.states.usage(), b.stats()["checkpoints"])
    with pytest.raises(CorruptStateError, match="another cache scope"):
        install_checkpoint(b.engine, "tenant-b", verified(b, blob))
    assert (b.engine.caches.kv.usage(), b.engine.caches.states.usage(), b.stats()["checkpoints"]) == before


def test_an_import_past_the_checkpoint_budget_is_refused_whole(models):
    a = prefix_engine(models)
    made = stateless(a, "a1", SYSTEM + user("hello"))
    blob = exported_blob(a, made.request.checkpoint_keys[-1])
    tiny = new_cache(new_engine(models[Arch.BAMBA], prefix_cache_bytes=1))  # under one state: none kept
    before = (tiny.engine.caches.kv.usage(), tiny.engine.caches.states.usage())
    with pytest.raises(OutOfCacheError):
        install_checkpoint(tiny.engine, SALT, verified(tiny, blob))
    assert (tiny.engine.caches.kv.usage(), tiny.engine.caches.states.usage()) == before


def test_an_evicted_checkpoint_has_nothing_to_export(models):
    a = prefix_engine(models)
    made = stateless(a, "a1", SYSTEM + user("hello"))
    key = made.request.checkpoint_keys[-1]
    checkpoint = a.engine.caches.heads.index.holding(key)[0]
    a.engine.caches.heads.drop(checkpoint)
    assert snapshot_checkpoint(a.engine, key) is None


def test_a_second_import_shares_the_blocks_an_earlier_one_brought(models):
    """The tier sends every chunk of an entry; blocks this engine holds by the same digest (an
    earlier import of the system prompt) are shared, not allocated again."""
    a, b = prefix_engine(models), prefix_engine(models)
    made = stateless(a, "a1", SYSTEM + user("hello"))
    system, end = made.request.checkpoint_keys[0], made.request.checkpoint_keys[-1]
    install_checkpoint(b.engine, SALT, verified(b, exported_blob(a, system)))
    kv = b.engine.caches.kv
    free = kv.usage().free
    install_checkpoint(b.engine, SALT, verified(b, exported_blob(a, end)))
    full_shared = system.length // kv.block_size
    assert full_shared > 0
    assert free - kv.usage().free == -(-end.length // kv.block_size) - full_shared

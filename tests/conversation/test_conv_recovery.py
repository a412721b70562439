"""Recovery from the ledger of record: a fresh engine adopts the service's ledger, rebuilds the
head with a prefill-only request, and continues exactly where the lost engine would have.

The rebuilt head is computed by one prefill where the original was prefill + decode, so its
bytes agree within the chunked-vs-one-shot tolerance (STATE_ATOL), and the next turn's tokens
are equal and its logprobs within LOGPROB_TOL. Heads deterministic turns made are rebuilt
bit for bit through the tiles: tests/determinism/test_det_conversation.py.
"""

from __future__ import annotations

import pytest

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    LOGPROB_TOL,
    STATE_ATOL,
    assert_same_output,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    run_turn,
    snapshot,
    user,
)
from tests.families import ARCHS
from workers.checkpoint import Arch
from workers.conversation.export import build_export, verify_export
from workers.conversation.records import LedgerTurn
from workers.errors import ConversationBusyError, ConversationNotFoundError, InvalidRequestError

C = ConversationRef("c", "s")  # the conversation most tests here use


def adopt(src, dst, cid="c"):
    ledger = src.describe(ConversationRef(cid, "s"))
    dst.adopt_ledger(ConversationRef(cid, "s"), version=ledger["version"], turns=ledger["ledger"])


@ARCHS
def test_adopted_ledger_and_materialized_head_equal_the_original(models, arch):
    original = new_cache(new_engine(models[arch]))
    for turn in range(1, 4):
        run_turn(original, "c", "s", user(f"turn {turn}"), greedy(6 + turn), f"t{turn}")
    lost = head_of(original, "c", "s")

    rebuilt = new_cache(new_engine(models[arch]))
    adopt(original, rebuilt)
    assert rebuilt.describe(C) == {**original.describe(C), "retained_turns": []}
    request = rebuilt.materialize_head(C, "rebuild")
    outputs = drive(rebuilt.engine)
    assert outputs["rebuild"].error is None and outputs["rebuild"].tokens == [], "nothing is sampled"
    assert request.num_computed_tokens == lost.state_len
    head = head_of(rebuilt, "c", "s")
    assert (head.turn, head.state_len, head.aligned_len, head.version) == (
        lost.turn, lost.state_len, lost.aligned_len, lost.version)
    a, b = snapshot(original.engine, lost.holder), snapshot(rebuilt.engine, head.holder)
    for x, y in zip(a.kv, b.kv):
        x, y = x.flatten(1, 2)[:, : lost.state_len], y.flatten(1, 2)[:, : lost.state_len]
        assert (x - y).abs().max() <= STATE_ATOL
    for x, y in zip(a.conv + a.ssm, b.conv + b.ssm):
        assert (x - y).abs().max() <= STATE_ATOL

    after_original = run_turn(original, "c", "s", user("next"), greedy(10), "n1")
    after_rebuilt = run_turn(rebuilt, "c", "s", user("next"), greedy(10), "n2")
    assert after_rebuilt.num_cached_tokens == lost.state_len, "the rebuilt head is reused"
    assert_same_output(after_rebuilt, after_original, "after recovery")
    assert rebuilt.describe(C)["token_ids"] == original.describe(C)["token_ids"]
    assert rebuilt.stats()["materialized"] == 1 and LOGPROB_TOL > 0


def test_adopting_the_same_version_is_a_no_op_and_a_new_ledger_drops_stale_heads(models):
    cc = new_cache(new_engine(models[Arch.BAMBA]))
    run_turn(cc, "c", "s", user("one"), greedy(6), "t1")
    head = head_of(cc, "c", "s")
    adopt(cc, cc)
    assert head_of(cc, "c", "s") is head, "the engine already caches that version"

    ledger = cc.describe(C)["ledger"]
    other = LedgerTurn(ledger[0].messages, ledger[0].token_ids[:-1] + (ledger[0].token_ids[-1] ^ 1,))
    cc.adopt_ledger(C, version=7, turns=[other])
    assert head_of(cc, "c", "s") is None, "a head of other tokens is not this ledger's"
    assert cc.describe(C)["version"] == 7
    cc.adopt_ledger(C, version=8, turns=[])
    with pytest.raises(ConversationNotFoundError):
        cc.describe(C)


def test_a_head_that_appears_while_a_rebuild_runs_is_never_overwritten(models):
    """A rebuild replaces only the head it saw when it started (a fast-path head a canonical
    rebuild supersedes), never one that appeared meanwhile. Every public path refuses a busy
    conversation, so the busy mark is lifted by hand to install a head mid-rebuild: the
    rebuild then fails alone and frees its state, and the installed head stays."""
    original = new_cache(new_engine(models[Arch.BAMBA]))
    run_turn(original, "c", "s", user("one"), greedy(6), "t1")
    exported = build_export(original.snapshot_head(C))
    rebuilt = new_cache(new_engine(models[Arch.BAMBA]))
    adopt(original, rebuilt)
    assert rebuilt.materialize_head(C, "rebuild") is not None
    conv = rebuilt.conversation_of(C)
    conv.in_flight = None
    identity, layout = rebuilt.export_identity()
    rebuilt.install_head(C, verify_export(exported.header, dict(exported.chunks), identity, layout, set()))
    conv.in_flight = "rebuild"
    installed = head_of(rebuilt, "c", "s")
    assert installed is not None
    outputs = drive(rebuilt.engine)
    assert outputs["rebuild"].error is not None and "already has a head" in outputs["rebuild"].error
    assert head_of(rebuilt, "c", "s") is installed and rebuilt.head_count() == 1
    assert rebuilt.stats()["materialized"] == 0


def test_adopt_and_materialize_refuse_bad_input_and_busy_conversations(models):
    cc = new_cache(new_engine(models[Arch.NEMOTRON_H]))
    with pytest.raises(ConversationNotFoundError):
        cc.materialize_head(ConversationRef("nobody", "s"), "m0")
    for turns in ([LedgerTurn((), ())], [LedgerTurn((), (1, -1))], [LedgerTurn((), (1, 10**6))]):
        with pytest.raises(InvalidRequestError):
            cc.adopt_ledger(C, version=1, turns=turns)
    with pytest.raises(InvalidRequestError):
        cc.adopt_ledger(C, version=-1, turns=[])
    run_turn(cc, "c", "s", user("one"), greedy(6), "t1")
    assert cc.materialize_head(C, "m1") is None, "the head is held already"
    cc.begin_turn(C, user("two"), greedy(6), "t2")
    with pytest.raises(ConversationBusyError):
        cc.materialize_head(C, "m2")
    with pytest.raises(ConversationBusyError):
        adopt(cc, cc)
    drive(cc.engine)


def test_a_template_that_cannot_append_is_refused_not_rewriting_history(models, tmp_path):
    """The ledger of record is never rewritten: a chat template whose rendering of the history
    changes with new messages (here: the message count up front) refuses the next turn."""
    import shutil

    from workers.errors import HistoryRewriteError

    model = tmp_path / "counting-template"
    shutil.copytree(models[Arch.BAMBA], model)
    template = model / "chat_template.jinja"
    template.write_text("{{ messages | length }}" + template.read_text())
    cc = new_cache(new_engine(model))
    run_turn(cc, "c", "s", user("one"), greedy(5), "t1")
    ledger, head = cc.describe(C), head_of(cc, "c", "s")
    with pytest.raises(HistoryRewriteError):
        cc.begin_turn(C, user("two"), greedy(5), "t2")
    assert cc.describe(C) == ledger and head_of(cc, "c", "s") is head
    assert not cc.engine.has_unfinished() and not cc.pending_turns()

"""A turn that fails (aborted mid-decode or while waiting, or a model step that raises) is
discarded: the committed head stays byte-identical (its KV blocks and both Mamba slots),
the ledger is unchanged, and the next turn equals the stateless reference.

The conversation's head has an unaligned length, so the failed turn had copied and then
written the tail block: a turn that wrote into the head's own tail block would show here.
"""

from __future__ import annotations

import pytest

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    BLOCK,
    check_turn_against_reference,
    conversation,
    drive,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    snapshot,
    user,
)
from tests.families import ARCHS
from workers.checkpoint import Arch
from workers.request import FinishReason

C1 = ConversationRef("c1", "s")  # the conversation most tests here use

LONG = greedy(24, ignore_eos=True)  # the failed turn must still be decoding when it fails


def unaligned_max_tokens(engine, cc, cid: str, messages) -> int:
    history = cc.describe(ConversationRef(cid, "s"))["messages"] if conversation(cc, cid, "s") else []
    n = len(reference_prompt(engine, history, messages))
    return next(m for m in range(3, 3 + BLOCK) if (n + m - 1) % BLOCK == 3)


def conversation_with_head(models, reference_engines, arch, cids=("c1",)):
    """An engine whose conversations have two committed turns and an unaligned head."""
    eng = new_engine(models[arch])
    cc = new_cache(eng)
    ref = reference_engines[arch]
    for cid in cids:
        for turn, text in enumerate(["hello there", "and then?"], start=1):
            m = unaligned_max_tokens(eng, cc, cid, user(text)) if turn == 2 else 6
            check_turn_against_reference(cc, ref, cid, "s", user(text), greedy(m), f"{cid}-t{turn}")
        head = head_of(cc, cid, "s")
        assert head.state_len % BLOCK, "the head must have a tail block for this test"
    return eng, cc, ref


def assert_untouched(cc, cid, head, state, ledger):
    assert head_of(cc, cid, "s") is head and head.pins == 0
    snapshot(cc.engine, head.holder).assert_equal(state)
    assert cc.describe(ConversationRef(cid, "s")) == ledger


@ARCHS
def test_abort_mid_decode_leaves_head_intact(models, reference_engines, arch):
    eng, cc, ref = conversation_with_head(models, reference_engines, arch)
    head = head_of(cc, "c1", "s")
    state, ledger, stats = snapshot(eng, head.holder), cc.describe(C1), cc.stats()

    request = cc.begin_turn(C1, user("go on, please"), LONG, "doomed")
    outputs = [out for _ in range(4) for out in eng.step()]
    assert len(request.output) == 4 and not request.is_finished, "aborted mid-decode"
    assert request.num_cached_tokens == head.state_len
    eng.abort("doomed")
    assert request.finish_reason is FinishReason.ABORT and outputs

    assert_untouched(cc, "c1", head, state, ledger)
    after = cc.stats()
    assert after["discarded"] == stats.get("discarded", 0) + 1
    assert (after["published"], after["tokens_reused"]) == (stats["published"], stats["tokens_reused"])
    result = check_turn_against_reference(cc, ref, "c1", "s", user("go on, please"), greedy(8), "next")
    assert result.num_cached_tokens == head.state_len, "the next turn still reuses the head"


def test_abort_while_waiting(models, reference_engines):
    eng, cc, ref = conversation_with_head(models, reference_engines, Arch.BAMBA)
    head = head_of(cc, "c1", "s")
    state, ledger = snapshot(eng, head.holder), cc.describe(C1)
    request = cc.begin_turn(C1, user("never runs"), LONG, "queued")
    assert head.pins == 1
    eng.abort("queued")
    assert request.finish_reason is FinishReason.ABORT and not eng.has_unfinished()
    assert_untouched(cc, "c1", head, state, ledger)
    check_turn_against_reference(cc, ref, "c1", "s", user("runs"), greedy(6), "next")


@ARCHS
@pytest.mark.parametrize("failing_call", [1, 4], ids=["prefill", "decode"])
def test_model_step_error_leaves_heads_intact(models, reference_engines, arch, failing_call, monkeypatch):
    """The forward pass runs (writing whatever it writes) and then raises; both turns of the
    batch fail, both heads stay as they were."""
    eng, cc, ref = conversation_with_head(models, reference_engines, arch, cids=("c1", "c2"))
    heads = {cid: head_of(cc, cid, "s") for cid in ("c1", "c2")}
    states = {cid: snapshot(eng, h.holder) for cid, h in heads.items()}
    ledgers = {cid: cc.describe(ConversationRef(cid, "s")) for cid in heads}

    model = eng.runner.model
    forward = model.forward
    calls = []

    def failing_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("injected failure")
        return out

    monkeypatch.setattr(model, "forward", failing_forward)
    for cid in heads:
        cc.begin_turn(ConversationRef(cid, "s"), user("fail me"), LONG, f"{cid}-bad")
    results = drive(eng)
    monkeypatch.undo()
    for cid in heads:
        r = results[f"{cid}-bad"]
        assert r.finish_reason is FinishReason.ERROR and "injected failure" in r.error
        assert len(r.tokens) == failing_call - 1
        assert_untouched(cc, cid, heads[cid], states[cid], ledgers[cid])
    assert cc.stats()["discarded"] == 2
    for cid in heads:
        result = check_turn_against_reference(cc, ref, cid, "s", user("try again"), greedy(8), f"{cid}-next")
        assert result.num_cached_tokens == heads[cid].state_len


def test_busy_conversation_rejects_everything_and_changes_nothing(models, reference_engines):
    from workers.errors import ConversationBusyError

    eng, cc, ref = conversation_with_head(models, reference_engines, Arch.NEMOTRON_H)
    head = head_of(cc, "c1", "s")
    cc.begin_turn(C1, user("first"), greedy(5), "inflight")
    state, ledger, stats = snapshot(eng, head.holder), cc.describe(C1), cc.stats()
    requests = set(eng.scheduler.requests)
    attempts = [
        lambda: cc.begin_turn(C1, user("second"), greedy(5), "second"),
        lambda: cc.regenerate(C1, greedy(5), "second"),
        lambda: cc.rewind(C1, 1),
        lambda: cc.fork(C1, 1, "c1-fork"),
        lambda: cc.delete(C1),
    ]
    for attempt in attempts:
        with pytest.raises(ConversationBusyError):
            attempt()
        assert set(eng.scheduler.requests) == requests and cc.pending_turns() == {"inflight"}
        assert head.pins == 1 and cc.stats() == stats
        assert cc.describe(C1) == ledger
        snapshot(eng, head.holder).assert_equal(state)
    assert cc.ledger(ConversationRef("c1-fork", C1.salt)) is None

    results = drive(eng)
    expected = ref.generate([reference_prompt(ref, ledger["messages"], user("first"))], greedy(5))[0]
    assert results["inflight"].tokens == [t.token_id for t in expected]
    assert cc.describe(C1)["turn"] == ledger["turn"] + 1
    # The rejected request id was never registered: it can be used now.
    check_turn_against_reference(cc, ref, "c1", "s", user("second"), greedy(5), "second")

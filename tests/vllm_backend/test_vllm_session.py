"""The vLLM backend's engine session: exact heads inside vLLM, two-phase, exported and imported.

Every check runs a real vLLM-CPU engine with our KV connector. "Same tokens as vLLM's own
stateless run" compares with the very prompt ids run without any head (vLLM's prefix caching is
off), and `cached` is vLLM's own count of the tokens it did not compute: a connector that loaded
nothing would show 0 there (and a wrong load, other tokens: see test_a_wrong_state_changes_the_reply).
"""

from __future__ import annotations

import asyncio

import pytest

from proto.contract import ConversationRef
from workers.conversation.export_format import unpack_export
from workers.errors import CorruptStateError, InvalidRequestError
from workers.sampling import SamplingParams

from .conftest import pytestmark  # noqa: F401  (skips without the vLLM venv)

GREEDY = dict(temperature=0.0, max_tokens=12)
QUESTIONS = [
    "Tell me about the sea and the ships that sail on it.",
    "And what about the mountains?",
    "Summarise both in one line.",
    "Now write it backwards, please.",
    "Thanks. One more word?",
]


async def run_turn(session, ref, text, request_id, **sampling):
    return await run_turn_with(session, ref, [{"role": "user", "content": text}], request_id, **sampling)


async def run_turn_with(session, ref, messages, request_id, **sampling):
    outs = [o async for o in session.stream_turn(ref, messages, SamplingParams(**(sampling or GREEDY)), request_id)]
    return outs, outs[-1].turn_commit


async def stateless_tokens(session, prompt_ids, request_id, **sampling):
    """vLLM's own run of the prompt ids: no head loaded, nothing captured."""
    from workers.vllm_backend.requests import vllm_sampling

    tokens = []
    params = vllm_sampling(SamplingParams(**(sampling or GREEDY)), session.allowed_ids)
    async for frame in session.host.stream(request_id, prompt_ids, params, None, capture=False):
        tokens += frame["tokens"]
        assert frame["cached"] == 0
    return tokens


@pytest.mark.parametrize("kind", ["dense", "moe"])
async def test_five_turns_reuse_the_head_and_equal_vllms_stateless_run(kind, sessions):
    session = sessions[kind]
    ref = ConversationRef(f"five-{kind}", "salt-a")
    for turn, text in enumerate(QUESTIONS, start=1):
        base = list(session.conversations.ledgers[ref.key].token_ids) if turn > 1 else []
        outs, record = await run_turn(session, ref, text, f"{kind}-t{turn}")
        assert record is not None and record.base_turn == turn - 1
        prompt = base + list(record.token_ids[: outs[-1].num_prompt_tokens - len(base)])
        reply = [t for o in outs for t in o.new_token_ids]
        assert reply == await stateless_tokens(session, prompt, f"{kind}-ref{turn}"), f"turn {turn}"
        if turn == 1:
            assert outs[-1].num_cached_tokens == 0
        else:  # vLLM computed only [last token] + the new messages
            assert outs[-1].num_cached_tokens == len(base) - 1
        head = await session.commit(record)
        assert head.turn == turn and head.state_len == head.committed_tokens - 1
    assert await session.held_heads(ref) == 1
    other_salt = ConversationRef(f"five-{kind}", "salt-b")
    outs, record = await run_turn(session, other_salt, QUESTIONS[0], f"{kind}-other-salt")
    assert outs[-1].num_cached_tokens == 0  # a different salt is another conversation
    await session.abandon(record)


@pytest.mark.parametrize("spoil", ["kv", "mamba"])
async def test_a_wrong_state_changes_the_reply(dense_session, spoil):
    """What vLLM continues from is the loaded state: the same head with its KV blocks or its
    Mamba state pages zeroed scores the reply otherwise (so equal replies above are not vLLM
    recomputing, and both kinds of state are loaded)."""
    session = dense_session
    ref = ConversationRef(f"spoil-{spoil}", "s")
    _, record = await run_turn(session, ref, QUESTIONS[0], f"spoil-{spoil}-1")
    await session.commit(record)
    scored = dict(GREEDY, logprobs=0)
    right_outs, right = await run_turn(session, ref, QUESTIONS[1], f"spoil-{spoil}-right", **scored)
    await session.abandon(right)
    held = session.conversations.heads.get(ref.key)
    state_len, blocks, state = await session.host.export_head(held.head_id)
    if spoil == "kv":
        blocks = [bytes(len(b)) for b in blocks]
    else:
        state = bytes(len(state))
    await session.host.call("install", head="spoiled", tokens=state_len, blocks=blocks, state=state)
    real, held.head_id = held.head_id, "spoiled"
    try:
        wrong_outs, wrong = await run_turn(session, ref, QUESTIONS[1], f"spoil-{spoil}-wrong", **scored)
        first_right, first_wrong = right_outs[0].new_tokens[0], wrong_outs[0].new_tokens[0]
        # The first reply token is drawn from the loaded state alone (plus the new messages):
        # its log-probability moves (the tiny model's Mamba state moves it by ~1e-2).
        assert abs(first_right.logprob - first_wrong.logprob) > 1e-3
        if spoil == "kv":
            assert wrong.token_ids != right.token_ids
        await session.abandon(wrong)
    finally:
        held.head_id = real
        await session.host.call("drop", heads=["spoiled"])


async def test_abandon_leaves_the_head_byte_identical(dense_session):
    session = dense_session
    ref = ConversationRef("abandon", "s")
    _, record = await run_turn(session, ref, QUESTIONS[0], "abandon-1")
    await session.commit(record)
    version, before = await session.export_state(ref)
    _, record = await run_turn(session, ref, QUESTIONS[1], "abandon-2")
    await session.abandon(record)
    assert await session.export_state(ref) == (version, before)  # KV blocks and Mamba pages, byte for byte
    _, again = await run_turn(session, ref, QUESTIONS[1], "abandon-2-again")
    assert again.messages == record.messages and again.token_ids == record.token_ids
    await session.commit(again)


async def test_a_head_exported_by_one_worker_continues_on_another(dense_session, second_dense_session):
    from deployments.messages import HeadRef
    from workers.conversation.records import LedgerTurn

    ref = ConversationRef("migrate", "s")
    for turn, text in enumerate(QUESTIONS[:2], start=1):
        _, record = await run_turn(dense_session, ref, text, f"migrate-{turn}")
        head = await dense_session.commit(record)
    version, parts = await dense_session.export_state(ref)
    conv = dense_session.conversations.ledgers[ref.key]
    turns = [LedgerTurn(tuple(t.messages), tuple(conv.token_ids[t.start: t.end])) for t in conv.turns]
    head_ref = HeadRef(version, head.turn, head.committed_tokens, head.tokens_digest, "", version)
    await second_dense_session.adopt_ledger(ref, head_ref, turns)
    assert await second_dense_session.holds(ref, head_ref) is False
    await second_dense_session.import_state(ref, b"".join(parts))
    assert await second_dense_session.holds(ref, head_ref)
    outs_there, there = await run_turn(second_dense_session, ref, QUESTIONS[2], "migrate-3-there")
    outs_here, here = await run_turn(dense_session, ref, QUESTIONS[2], "migrate-3-here")
    assert outs_there[-1].num_cached_tokens == outs_here[-1].num_cached_tokens > 0
    assert there.token_ids == here.token_ids and there.messages == here.messages
    await second_dense_session.commit(there)
    await dense_session.abandon(here)


async def test_a_head_exports_while_the_engine_streams(dense_session):
    """The host sends a head's export from a thread of its own, a frame per block, while its
    engine loop goes on sending other requests' tokens: both arrive whole (frames from the two
    threads never interleave inside one another), the stream's tokens are those of the same
    request alone, and every export of the head has the same bytes (that it continues exactly on
another worker: test_a_head_exported_by_one_worker_continues_on_another)."""
    session = dense_session
    ref = ConversationRef("export-while-streaming", "s")
    _, record = await run_turn(session, ref, QUESTIONS[0] * 20, "ews-1")  # several blocks' worth
    await session.commit(record)
    held = session.conversations.heads.get(ref.key)
    alone = await stateless_tokens(session, list(range(5, 400)), "ews-alone", temperature=0.0, max_tokens=48)
    exports = []

    async def export_repeatedly():
        for _ in range(6):
            exports.append(await session.host.export_head(held.head_id))

    beside, _ = await asyncio.gather(
        stateless_tokens(session, list(range(5, 400)), "ews-beside", temperature=0.0, max_tokens=48),
        export_repeatedly())
    assert beside == alone
    state_len, blocks, state = exports[0]
    assert len(blocks) == -(-state_len // session.host.info["block_size"]) >= 1
    assert all(e == exports[0] for e in exports)  # the same bytes every time (a committed head is never written)


async def test_exports_never_cross_backends_or_conversations(dense_session, tmp_path):
    from workers.conversation.export_verify import verify_export as verify_ours

    ref = ConversationRef("crossing", "s")
    _, record = await run_turn(dense_session, ref, QUESTIONS[0], "crossing-1")
    await dense_session.commit(record)
    _, parts = await dense_session.export_state(ref)
    header, chunks = unpack_export(b"".join(parts))
    with pytest.raises(CorruptStateError, match="unknown export format"):  # our engine refuses it
        verify_ours(header, chunks, dense_session.identity, {})
    other = ConversationRef("crossing-other", "s")
    from deployments.messages import HeadRef
    from workers.conversation.records import LedgerTurn
    conv = dense_session.conversations.ledgers[ref.key]
    turns = [LedgerTurn(tuple(t.messages), tuple(conv.token_ids[t.start: t.end])) for t in conv.turns]
    head = HeadRef(1, 1, len(conv.token_ids), record.tokens_digest, "", 1)
    await dense_session.adopt_ledger(other, head, turns)
    with pytest.raises(CorruptStateError, match="not a head of this conversation"):
        await dense_session.import_state(other, b"".join(parts))
    tampered = bytearray(b"".join(parts))
    tampered[-5] ^= 1  # a Mamba state byte
    with pytest.raises(CorruptStateError, match="checksum"):
        await dense_session.import_state(ref, bytes(tampered))


async def test_what_the_backend_does_not_do_is_refused(dense_session):
    for params in (SamplingParams(max_tokens=4, deterministic=True), SamplingParams(max_tokens=4, priority=1)):
        with pytest.raises(InvalidRequestError, match="vllm backend"):
            await dense_session.prepare_grammar(params)


async def test_a_ledger_is_kept_only_while_its_head_or_a_turn_of_it_is(dense_session):
    """Ledgers are a cache of the service's: one whose head went (head_cache_mb) goes at the next
    verdict unless a turn of it runs here; they do not pile up for every conversation seen."""
    session, heads = dense_session, dense_session.conversations.heads
    first, second, running = (ConversationRef(f"bound-{n}", "s") for n in ("first", "second", "running"))
    for ref in (first, running):
        _, record = await run_turn(session, ref, QUESTIONS[0], f"{ref.id}-1")
        await session.commit(record)
    session.turn_started(running)  # its next turn is being recovered here (e.g. a ledger adopted)
    budget = heads.budget_bytes
    heads.budget_bytes = 1  # every idle head goes at the next commit
    try:
        _, record = await run_turn(session, second, QUESTIONS[0], "bound-second-1")
        await session.commit(record)
    finally:
        heads.budget_bytes = budget
        session.turn_ended(running)
    assert first.key not in heads and first.key not in session.conversations.ledgers
    assert second.key not in heads and second.key not in session.conversations.ledgers
    assert running.key not in heads and running.key in session.conversations.ledgers


async def test_a_worker_without_the_head_recomputes_from_the_ledger_with_the_same_tokens(
        dense_session, second_dense_session):
    """The recovery ladder's last rung on this backend: the ledger adopted, no state imported;
    the next turn runs the whole history and continues exactly as the owner would have."""
    from deployments.messages import HeadRef
    from workers.conversation.records import LedgerTurn

    ref = ConversationRef("recompute", "s")
    for turn, text in enumerate(QUESTIONS[:2], start=1):
        _, record = await run_turn(dense_session, ref, text, f"recompute-{turn}")
        head = await dense_session.commit(record)
    conv = dense_session.conversations.ledgers[ref.key]
    turns = [LedgerTurn(tuple(t.messages), tuple(conv.token_ids[t.start: t.end])) for t in conv.turns]
    await second_dense_session.adopt_ledger(ref, HeadRef(head.version, head.turn, head.committed_tokens,
                                                         head.tokens_digest, "", 0), turns)
    outs_there, there = await run_turn(second_dense_session, ref, QUESTIONS[2], "recompute-3-there")
    outs_here, here = await run_turn(dense_session, ref, QUESTIONS[2], "recompute-3-here")
    assert outs_there[-1].num_cached_tokens == 0 and outs_here[-1].num_cached_tokens > 0
    assert there.token_ids == here.token_ids and there.messages == here.messages
    await second_dense_session.commit(there)
    await dense_session.abandon(here)


async def test_an_engine_host_that_cannot_start_says_why(tmp_path, vllm_models):
    """A missing interpreter and a model vLLM cannot load both fail the session's start with
    EngineShutdownError naming the cause, and leave it unhealthy."""
    from pathlib import Path

    from deployments.worker.vllm_session import VllmSession
    from workers.checkpoint import Arch, Preset, make_model
    from workers.errors import EngineShutdownError

    from .conftest import vllm_settings

    missing = VllmSession(vllm_models["dense"], vllm_settings(vllm_python=str(tmp_path / "no-python")))
    with pytest.raises(EngineShutdownError, match="cannot start the vLLM engine host"):
        await missing.start()
    with pytest.raises(EngineShutdownError):
        missing.check_health()
    broken = Path(make_model(tmp_path / "broken", Arch.GRANITEMOEHYBRID, Preset.TINY, seed=0,
                             attention_head_dim=32))
    (broken / "model.safetensors").write_bytes(b"not weights")
    refused = VllmSession(str(broken), vllm_settings())
    with pytest.raises(EngineShutdownError, match="did not start"):
        await refused.start()
    with pytest.raises(EngineShutdownError):
        refused.check_health()
    with pytest.raises(EngineShutdownError):  # routing stats of a replica whose engine never came up
        await refused.load()
    await refused.aclose()
    # A checkpoint vLLM-CPU builds an engine for but cannot run (its attention takes no 16-wide
    # heads): refused at start-up with vLLM's reason, not healthy until every turn's 503.
    narrow = make_model(tmp_path / "narrow", Arch.GRANITEMOEHYBRID, Preset.TINY, seed=0, attention_head_dim=16)
    unrunnable = VllmSession(str(narrow), vllm_settings())
    with pytest.raises(EngineShutdownError, match=r"cannot run .*first forward failed: \w+Error: .*16") as refusal:
        await unrunnable.start()
    assert "Traceback" not in str(refusal.value)  # the reason, not a stack (that goes to the host's stderr)
    await unrunnable.aclose()



async def host_is_clean(session, within_s: float = 10.0) -> None:
    """Nothing running and no prepared state left behind in the engine host (an abort's last
    frame and an abandon come back between engine steps: the host's stats are polled)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        stats = await session.host.call("stats")
        held = len(session.conversations.heads) + len(session.prefixes.index)  # every head there is one we know of
        if (stats["running"] == 0 and stats["prepared"] == len(session.conversations.prepared) and not session.host._orphans
                and stats["heads"] == held):
            return
        assert asyncio.get_running_loop().time() < deadline, stats
        await asyncio.sleep(0.05)


async def test_a_turn_ended_by_a_stop_string_is_captured_and_continued_exactly(dense_session):
    """vLLM ends a stop string's request by aborting it in its core: the state is captured all
    the same, the text stops before the stop string, and the next turn equals a fresh run."""
    session = dense_session
    probe_ref = ConversationRef("stop-probe", "s")
    sampling = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    _, probe = await run_turn(session, probe_ref, QUESTIONS[0], "stop-probe-1", **sampling)
    await session.abandon(probe)
    reply = probe.messages[-1]["content"]
    # A piece of the greedy reply past its start, seen there first: the same run meets it.
    stop = next(reply[i: i + 2] for i in range(3, len(reply) - 1)
                if reply[i: i + 2].strip() and reply[i: i + 2] not in reply[: i + 1])
    ref = ConversationRef("stop", "s")
    outs, record = await run_turn(session, ref, QUESTIONS[0], "stop-1", stop=[stop], **sampling)
    assert record is not None and outs[-1].finish_reason.value == "stop"
    assert "".join(o.text_delta for o in outs) == reply[: reply.index(stop)]
    await session.commit(record)
    base = list(session.conversations.ledgers[ref.key].token_ids)
    outs, record = await run_turn(session, ref, QUESTIONS[1], "stop-2")
    assert outs[-1].num_cached_tokens == len(base) - 1
    prompt = base + list(record.token_ids[: outs[-1].num_prompt_tokens - len(base)])
    assert [t for o in outs for t in o.new_token_ids] == await stateless_tokens(session, prompt, "stop-ref")
    await session.commit(record)
    await host_is_clean(session)


async def test_a_stream_left_midway_or_at_its_end_leaves_nothing_behind(dense_session):
    """A client gone mid-stream aborts the request; one gone as the turn finished abandons the
    captured state: the host runs nothing and holds no orphan, and the conversation is free."""
    session = dense_session
    for cut in (1, None):  # after the first output, or after the last one arrived unread
        ref = ConversationRef(f"left-{cut}", "s")
        stream = session.stream_turn(ref, [user_message(QUESTIONS[0])], SamplingParams(temperature=0.0, max_tokens=40,
                                                                                       ignore_eos=True), f"left-{cut}")
        if cut == 1:
            await stream.__anext__()
        else:
            await stream.__anext__()
            while not session.host._streams[f"left-{cut}"].qsize() or not any(
                    f.get("finished") for f in list(session.host._streams[f"left-{cut}"]._queue)):
                await asyncio.sleep(0.01)  # the last frame is queued, not read
        await stream.aclose()
        await host_is_clean(session)
        assert session.conversations.ledgers.get(ref.key) is None  # a first turn left: nothing kept
        _, record = await run_turn(session, ref, QUESTIONS[0], f"left-{cut}-again")
        await session.commit(record)


async def test_a_prompt_too_long_is_refused_and_the_engine_goes_on(dense_session):
    from workers.errors import PromptTooLongError

    session = dense_session
    ref = ConversationRef("too-long", "s")
    with pytest.raises(PromptTooLongError):
        await run_turn(session, ref, "x " * 3000, "too-long-1")
    assert session.conversations.ledgers.get(ref.key) is None
    _, record = await run_turn(session, ref, QUESTIONS[0], "too-long-2")  # the host is alive
    await session.commit(record)
    await host_is_clean(session)


async def test_vllm_refuses_our_engines_exports_and_other_layouts(dense_session):
    from proto.contract import ModelIdentity
    from workers.conversation.export_format import seal_header
    from workers.vllm_backend import export as vllm_export

    ours = seal_header({"format": 2, "identity": dense_session.identity.to_dict(), "layout": {}})
    with pytest.raises(CorruptStateError, match="unknown export format"):
        vllm_export.verify_export(ours, {}, dense_session.identity, dense_session.layout)
    ref = ConversationRef("layouts", "s")
    _, record = await run_turn(dense_session, ref, QUESTIONS[0], "layouts-1")
    await dense_session.commit(record)
    _, parts = await dense_session.export_state(ref)
    header, chunks = unpack_export(b"".join(parts))
    for changed in ({"conv_state_layout": "DS"}, {"block_size": 16}, {"vllm": "0.33.0"}):
        with pytest.raises(CorruptStateError, match="cache layout differs"):
            vllm_export.verify_export(header, chunks, dense_session.identity, {**dense_session.layout, **changed})
    other_cpu = ModelIdentity(**{**dense_session.identity.to_dict(), "device_kind": "cpu:x86_64:another"})
    with pytest.raises(CorruptStateError, match="another model or machine"):
        vllm_export.verify_export(header, chunks, other_cpu, dense_session.layout)
    meta, parts_back = vllm_export.verify_export(header, chunks, dense_session.identity, dense_session.layout)
    assert meta["turn"] == 1 and parts_back.state_len == record.committed_tokens - 1


def user_message(text: str) -> dict:
    return {"role": "user", "content": text}


async def test_a_chat_resent_in_full_runs_only_its_new_messages(dense_session, monkeypatch):
    """A stateless request (an ordinary OpenAI client's: the whole chat each time) loads the
    checkpoint the previous request left at its end and computes only the rest; its reply is
    vLLM's own run of the whole prompt. A checkpoint is exact: another salt, or a history whose
    reply was edited, attaches nothing of it. (No message boundary is primed here, so that what is
    loaded is only ever an earlier request's end: boundaries are the next tests'.)"""
    from workers.vllm_backend.prefixes import state_bytes
    from workers.request import ReuseSource

    session = dense_session
    monkeypatch.setattr(session.prefixes, "prime_min_tokens", 10**9)
    stored = len(session.prefixes.index)
    history: list[dict] = []
    ends = [0]  # tokens of each request's checkpoint
    for turn, text in enumerate(QUESTIONS[:3], start=1):
        history.append(user_message(text))
        outs = [o async for o in session.stream_stateless(list(history), SamplingParams(**GREEDY), f"full-{turn}",
                                                          "salt-f")]
        last = outs[-1]
        reply = [t for o in outs for t in o.new_token_ids]
        prompt = session.tokenizer.encode(session.tokenizer.render_chat(history, add_generation_prompt=True))
        assert reply == await stateless_tokens(session, prompt, f"full-ref-{turn}"), f"turn {turn}"
        assert last.num_cached_tokens == ends[-1]  # 0 on the first request
        assert last.reused_from is (ReuseSource.PREFIX if turn > 1 else ReuseSource.NONE)
        assert last.checkpoints == ((len(history) + 1, len(prompt) + len(reply) - 1),)
        ends.append(last.checkpoints[0][1])
        history.append({"role": "assistant", "content": "".join(o.text_delta for o in outs)})
    assert len(session.prefixes.index) == stored + 3
    assert session.prefixes.index.nbytes <= session.prefixes.index.budget_bytes
    for held in session.prefixes.index:  # what the budget counts before capturing is what the host holds
        assert held.nbytes == state_bytes(session.layout, len(held.tokens))
    edited = [*history[:-1], {"role": "assistant", "content": "(edited) " + history[-1]["content"]},
              user_message("again")]
    for salt, messages, attached in (("salt-g", history + [user_message("again")], 0), ("salt-f", edited, ends[2])):
        outs = [o async for o in session.stream_stateless(messages, SamplingParams(**GREEDY), f"miss-{salt}", salt)]
        assert outs[-1].num_cached_tokens == attached  # the edited reply's chat: up to the request before it
    await host_is_clean(session)


SYSTEM = {"role": "system", "content": "You are a patient guide to the sea, the ships on it and the ports they "
                                       "call at. Answer briefly and kindly."}


async def test_a_system_prompt_is_computed_once_for_the_chats_that_open_with_it(dense_session):
    """New chats opening with the same system prompt (stateless ones, and a conversation's first
    turn) load its checkpoint, computed once on its own; replies equal vLLM's run of the whole
    prompt. A system prompt under another salt, or a short one, is computed with its prompt. (The
    user messages are too short past it for the end of the last message to be primed too.)"""
    from workers.vllm_backend.prefixes import PRIME_MIN_TOKENS
    from workers.request import ReuseSource

    session = dense_session
    system_end = len(session.tokenizer.encode(session.tokenizer.render_chat([SYSTEM], add_generation_prompt=False)))
    assert system_end >= PRIME_MIN_TOKENS
    for i, text in enumerate(["Hi", "Hello there"]):
        messages = [SYSTEM, user_message(text)]
        outs = [o async for o in session.stream_stateless(messages, SamplingParams(**GREEDY), f"system-{i}",
                                                          "salt-s")]
        prompt = session.tokenizer.encode(session.tokenizer.render_chat(messages, add_generation_prompt=True))
        assert [t for o in outs for t in o.new_token_ids] == await stateless_tokens(session, prompt, f"system-ref-{i}")
        assert outs[-1].num_cached_tokens == system_end and outs[-1].reused_from is ReuseSource.SYSTEM
        assert (1, system_end) in outs[-1].checkpoints  # announced: new chats opening with it come here
    outs, record = await run_turn_with(session, ConversationRef("system-conv", "salt-s"), [SYSTEM, user_message("Hi")],
                                       "system-conv-1")
    assert outs[-1].num_cached_tokens == system_end and outs[-1].reused_from is ReuseSource.SYSTEM
    assert [t for o in outs for t in o.new_token_ids] == await stateless_tokens(
        session, list(record.token_ids[: outs[-1].num_prompt_tokens]), "system-conv-ref")
    await session.commit(record)
    system_ids = session.tokenizer.encode(session.tokenizer.render_chat([SYSTEM], add_generation_prompt=False))
    assert session.prefixes.index.holds("salt-s", system_ids) and not session.prefixes.index.holds("salt-t", system_ids)
    outs = [o async for o in session.stream_stateless([SYSTEM, user_message("Hi")], SamplingParams(**GREEDY),
                                                      "system-other-salt", "salt-t")]
    assert outs[-1].num_cached_tokens == system_end  # primed again, for this salt
    assert session.prefixes.index.holds("salt-t", system_ids)
    short = [{"role": "system", "content": "Be brief."}, user_message("Hi")]
    outs = [o async for o in session.stream_stateless(short, SamplingParams(**GREEDY), "system-short", "salt-s")]
    assert outs[-1].num_cached_tokens == 0
    assert outs[-1].checkpoints == ((3, outs[-1].num_prompt_tokens + sum(len(o.new_tokens) for o in outs) - 1),)
    await host_is_clean(session)



async def test_a_history_rendered_otherwise_loads_the_end_of_its_last_message(dense_session):
    """A stateless request also keeps the end of its last message (the whole history before the
    generation prompt), labelled as our engine labels it: new here and long enough, it is computed
    first by a request of its own. The next request of a client that renders the reply otherwise
    (drops its reasoning; an agent loop) loads it and computes only the rest; replies equal vLLM's
    run of the whole prompt. A history already held is not computed again."""
    from workers.request import ReuseSource
    from workers.vllm_backend.prefixes import PRIME_MIN_TOKENS

    session = dense_session
    tokenizer = session.tokenizer
    history = [user_message(QUESTIONS[0]), {"role": "assistant", "content": "Wide and deep."},
               user_message(QUESTIONS[1])]
    history_ids = tokenizer.encode(tokenizer.render_chat(history, add_generation_prompt=False))
    assert len(history_ids) >= PRIME_MIN_TOKENS
    prompt = tokenizer.encode(tokenizer.render_chat(history, add_generation_prompt=True))
    stored = len(session.prefixes.index)
    outs = [o async for o in session.stream_stateless(history, SamplingParams(**GREEDY), "render-1", "salt-r")]
    reply = [t for o in outs for t in o.new_token_ids]
    assert reply == await stateless_tokens(session, prompt, "render-ref-1")
    assert outs[-1].num_cached_tokens == len(history_ids) and outs[-1].reused_from is ReuseSource.PREFIX
    # Announced as the prefix index names them: messages[:3], and messages[:3] + the reply.
    assert outs[-1].checkpoints == ((3, len(history_ids)), (4, len(prompt) + len(reply) - 1))
    assert len(session.prefixes.index) == stored + 2
    boundary = next(c for c in session.prefixes.index if c.salt == "salt-r" and list(c.tokens) == history_ids)

    # The reply rendered otherwise, and a message short enough that nothing more is primed for it.
    following = [*history, {"role": "assistant", "content": "Ok."}, user_message("Why?")]
    following_prompt = tokenizer.encode(tokenizer.render_chat(following, add_generation_prompt=True))
    assert following_prompt[:len(history_ids)] == history_ids
    following_end = len(tokenizer.encode(tokenizer.render_chat(following, add_generation_prompt=False)))
    assert following_end - len(history_ids) < PRIME_MIN_TOKENS
    outs = [o async for o in session.stream_stateless(following, SamplingParams(**GREEDY), "render-2", "salt-r")]
    assert [t for o in outs for t in o.new_token_ids] == await stateless_tokens(session, following_prompt,
                                                                                "render-ref-2")
    assert outs[-1].num_cached_tokens == len(history_ids) and outs[-1].reused_from is ReuseSource.PREFIX

    outs = [o async for o in session.stream_stateless(history, SamplingParams(**GREEDY), "render-3", "salt-r")]
    assert [t for o in outs for t in o.new_token_ids] == reply
    assert outs[-1].num_cached_tokens == len(history_ids)
    assert (3, len(history_ids)) in outs[-1].checkpoints
    assert boundary.head_id in {c.head_id for c in session.prefixes.index}  # loaded, not computed again
    await host_is_clean(session)


async def test_a_client_resending_its_history_as_it_got_it_is_primed_nothing(dense_session):
    """A client resending the chat as it got it loads the previous request's end: the end of its
    last message would be loaded by nobody (its next request loads this one's end), so no request
    of its own computes it (one per turn) and no second copy of the state is kept."""
    from workers.vllm_backend.prefixes import PRIME_MIN_TOKENS

    session = dense_session
    history = [user_message(QUESTIONS[0])]
    outs = [o async for o in session.stream_stateless(list(history), SamplingParams(**GREEDY), "as-got-1", "salt-a")]
    end = outs[-1].checkpoints[-1][1]
    history += [{"role": "assistant", "content": "".join(o.text_delta for o in outs)}, user_message(QUESTIONS[1])]
    rendered = session.tokenizer.encode(session.tokenizer.render_chat(history, add_generation_prompt=False))
    assert len(rendered) - end >= PRIME_MIN_TOKENS  # long enough that a new chat's would be primed
    stored = len(session.prefixes.index)
    outs = [o async for o in session.stream_stateless(list(history), SamplingParams(**GREEDY), "as-got-2", "salt-a")]
    assert outs[-1].num_cached_tokens == end
    assert [k for k, _ in outs[-1].checkpoints] == [len(history) + 1]  # its end only
    assert len(session.prefixes.index) == stored + 1
    await host_is_clean(session)


STALL_S = 1.0


async def test_a_stuck_engine_host_is_killed_and_its_turns_fail(vllm_models):
    """A host that hangs without dying (stopped here by SIGSTOP) is killed once it has sent
    nothing for the stall timeout with work in hand: its turn and a pending call fail with
    EngineShutdownError (a 503 to the client), nothing is committed, and the session reports
    unhealthy. A turn far longer than the timeout, sending a frame every step, is not stuck."""
    import os
    import signal

    from deployments.worker.vllm_session import VllmSession
    from workers.errors import EngineShutdownError

    from .conftest import vllm_settings

    session = VllmSession(vllm_models["dense"], vllm_settings(engine_stall_timeout_s=STALL_S))
    await session.start()
    loop = asyncio.get_running_loop()
    try:
        ref = ConversationRef("stuck", "s")
        started = loop.time()
        _, record = await run_turn(session, ref, QUESTIONS[0], "stuck-1", temperature=0.0, max_tokens=1900,
                                   ignore_eos=True)  # about 3.5 s here
        took = loop.time() - started
        # A silent host would have been killed by 1.5x the timeout (silent at two checks a quarter apart).
        assert took > 2 * STALL_S, f"the long turn took {took:.1f} s: too short to outlive the stall timeout"
        await session.commit(record)
        session.check_health()

        stream = session.stream_turn(ref, [user_message(QUESTIONS[1])],
                                     SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), "stuck-2")
        await stream.__anext__()
        os.kill(session.host._process.pid, signal.SIGSTOP)  # alive, silent
        call = asyncio.ensure_future(session.host.call("stats"))
        async with asyncio.timeout(20 * STALL_S):  # a hang guard, not a timing claim
            with pytest.raises(EngineShutdownError, match="stuck"):
                async for _ in stream:
                    pass
            with pytest.raises(EngineShutdownError, match="stuck"):
                await call
            assert await session.host._process.wait() == -signal.SIGKILL
        with pytest.raises(EngineShutdownError, match="stuck"):
            session.check_health()
        assert len(session.conversations.ledgers[ref.key].turns) == 1 and not session.conversations.prepared
    finally:
        await session.aclose()


async def test_completions_max_tokens_past_the_context_min_p_and_kv_usage(dense_session):
    """Issue 41's surface on this backend: a completion's raw prompt is vLLM's own run of it; a
    max_tokens past the context is clamped to what it leaves (vLLM would refuse it); min_p 1 is
    greedy; the KV usage routing stats report is a fraction."""
    session = dense_session
    ids = session.tokenizer.encode(QUESTIONS[0])
    outs = [o async for o in session.stream_completion(QUESTIONS[0], SamplingParams(**GREEDY), "cmpl-1", "salt-c")]
    reply = [t for o in outs for t in o.new_token_ids]
    assert reply == await stateless_tokens(session, ids, "cmpl-ref-1")
    sampled = SamplingParams(temperature=1.0, seed=5, min_p=1.0, max_tokens=12)
    outs = [o async for o in session.stream_completion(tuple(ids), sampled, "cmpl-2", "salt-c2")]
    assert [t for o in outs for t in o.new_token_ids] == reply
    limit = await session.max_model_len()
    long = ids * ((limit - 8) // len(ids))
    outs = [o async for o in session.stream_completion(tuple(long), SamplingParams(temperature=0.0, max_tokens=10**6),
                                                       "cmpl-3", "salt-c3")]
    assert outs[-1].finish_reason.value == "length"
    assert len(long) + sum(len(o.new_token_ids) for o in outs) == limit
    assert 0.0 <= await session.kv_cache_usage() <= 1.0
    await host_is_clean(session)

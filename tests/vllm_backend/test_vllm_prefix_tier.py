"""The vLLM backend's prefix checkpoints as state tier entries: a system prompt's checkpoint one
worker computed is exported, installed by another worker's engine host and loaded there, with
vLLM's own tokens for the whole prompt; what is not a prefix of the request, or is another
salt's or a conversation's head, is refused and changes nothing; a link of a request chain the
next step superseded is not exported. (Through the app, the router and the cache service:
tests/serve/test_vllm_backend.py.)"""

from __future__ import annotations

import pytest

from proto.contract import ConversationRef
from workers.errors import CorruptStateError, PrefixMismatchError
from workers.request import ReuseSource
from workers.sampling import SamplingParams
from workers.template_options import DEFAULT_TEMPLATE

from .conftest import pytestmark  # noqa: F401  (skips without the vLLM venv)
from .test_vllm_session import GREEDY, QUESTIONS, SYSTEM, host_is_clean, run_turn, stateless_tokens, user_message


async def stateless(session, messages, request_id, salt):
    return [o async for o in session.stream_stateless(messages, SamplingParams(**GREEDY), request_id, salt)]


async def test_a_system_prompt_computed_on_one_worker_is_loaded_on_another_with_vllms_tokens(
        dense_session, second_dense_session):
    here, there, salt = dense_session, second_dense_session, "tier-salt"
    outs = await stateless(here, [SYSTEM, user_message("Hi")], "tier-1", salt)
    last = outs[-1]
    assert len(last.checkpoint_keys) == len(last.checkpoints)  # each checkpoint left is named
    system = dict(zip((label for label, _ in last.checkpoints), last.checkpoint_keys, strict=True))[1]
    system_end = len(here.tokenizer.encode(here.tokenizer.render_chat([SYSTEM], add_generation_prompt=False)))
    assert system.scope == salt and system.length == system_end
    blob = b"".join(await here.export_prefix(system))

    messages = [SYSTEM, user_message("Good morning")]
    prompt, held = await there.held_prefix(salt, messages, None, DEFAULT_TEMPLATE)
    assert held == 0 and prompt == there.tokenizer.encode(there.tokenizer.render_chat(messages,
                                                                                      add_generation_prompt=True))
    stored = len(there.prefixes.index)
    with pytest.raises(CorruptStateError, match="another cache scope"):
        await there.import_prefix("another-salt", blob, prompt)
    otherwise = [{"role": "system", "content": "Briefly. " + SYSTEM["content"]}, user_message("Good morning")]
    other_prompt, _ = await there.held_prefix(salt, otherwise, None, DEFAULT_TEMPLATE)
    with pytest.raises(PrefixMismatchError) as mismatch:
        await there.import_prefix(salt, blob, other_prompt)
    assert mismatch.value.length == system_end  # what the worker remembers not to fetch again for it
    with pytest.raises(PrefixMismatchError):  # the whole prompt is never a checkpoint: one token is left to run
        await there.import_prefix(salt, blob, prompt[:system_end])
    assert len(there.prefixes.index) == stored  # refused: nothing installed

    assert await there.import_prefix(salt, blob, prompt) == system_end
    assert (await there.held_prefix(salt, messages, None, DEFAULT_TEMPLATE))[1] == system_end
    assert await there.import_prefix(salt, blob, prompt) == system_end  # held already: kept once
    assert len(there.prefixes.index) == stored + 1
    outs = await stateless(there, messages, "tier-2", salt)
    assert outs[-1].num_cached_tokens == system_end and outs[-1].reused_from is ReuseSource.PREFIX
    assert [t for o in outs for t in o.new_token_ids] == await stateless_tokens(there, prompt, "tier-ref")
    await host_is_clean(there)
    await host_is_clean(here)


async def test_a_conversations_head_is_no_prefix_and_a_prefix_no_conversations_head(dense_session,
                                                                                  second_dense_session):
    here, there = dense_session, second_dense_session
    ref = ConversationRef("tier-head", "tier-salt-h")
    _, record = await run_turn(here, ref, QUESTIONS[0], "tier-head-1")
    await here.commit(record)
    _, parts = await here.export_state(ref)
    prompt = list(record.token_ids) + [1, 2, 3]
    with pytest.raises(CorruptStateError, match="not a prefix checkpoint"):
        await there.import_prefix("tier-salt-h", b"".join(parts), prompt)

    outs = await stateless(here, [SYSTEM, user_message("Hi")], "tier-head-2", "tier-salt-h")
    system = outs[-1].checkpoint_keys[0]
    blob = b"".join(await here.export_prefix(system))
    with pytest.raises(CorruptStateError, match="not a head of this conversation"):
        await here.import_state(ref, blob)  # its ledger is here: the export names no conversation
    assert await here.held_heads(ref) == 1


async def test_an_agent_loops_step_end_the_next_step_went_on_from_is_not_exported(dense_session):
    session, salt = dense_session, "tier-salt-chain"
    history = [user_message(QUESTIONS[0])]
    first = await stateless(session, list(history), "chain-1", salt)
    end = first[-1].checkpoint_keys[-1]  # where the request ended: the messages and the reply
    assert first[-1].checkpoints[-1] == (len(history) + 1, end.length)
    assert await session.export_prefix(end) is not None  # the chain's latest link
    history += [{"role": "assistant", "content": "".join(o.text_delta for o in first)}, user_message(QUESTIONS[1])]
    second = await stateless(session, list(history), "chain-2", salt)
    assert second[-1].num_cached_tokens == end.length  # the next step loaded it...
    assert await session.export_prefix(end) is None  # ...so the longer link is the one worth sending
    assert await session.export_prefix(second[-1].checkpoint_keys[-1]) is not None
    await host_is_clean(session)

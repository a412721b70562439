"""The logits processors' fields on the vLLM backend: passed through to vLLM's SamplingParams
(which applies them natively), logit_bias ids checked against the vocabulary first, min_tokens
clamped with max_tokens where the context ends, and stop strings deferred by min_tokens in the
text we make as in vLLM's."""

from __future__ import annotations

import pytest

from workers.errors import InvalidRequestError
from workers.sampling import SamplingParams

from .conftest import pytestmark  # noqa: F401  (skips without the vLLM venv)

PROMPT = "Tell me about the sea and the ships that sail on it."


async def _completion(session, request_id, **sampling):
    outs = [o async for o in session.stream_completion(PROMPT, SamplingParams(temperature=0.0, **sampling),
                                                       request_id, f"salt-{request_id}")]
    return [t for o in outs for t in o.new_token_ids], "".join(o.text_delta for o in outs), outs[-1]


async def test_penalties_logit_bias_and_min_tokens_reach_vllm(dense_session):
    session = dense_session
    greedy, text, _ = await _completion(session, "p-greedy", max_tokens=32, ignore_eos=True)
    assert len(set(greedy)) < 32  # the tiny model repeats itself
    biased, _, _ = await _completion(session, "p-bias", max_tokens=4, ignore_eos=True, logit_bias={greedy[0]: -100.0})
    assert biased[0] != greedy[0]
    forced, _, _ = await _completion(session, "p-force", max_tokens=3, logit_bias={17: 100.0})
    assert forced == [17, 17, 17]
    penalized, _, _ = await _completion(session, "p-freq", max_tokens=32, ignore_eos=True, frequency_penalty=2.0)
    assert penalized != greedy and penalized[0] == greedy[0]  # nothing generated yet: the first token is the same
    stop = greedy[1]
    stopped, stopped_text, last = await _completion(session, "p-stop", max_tokens=12, stop_token_ids=(stop,))
    assert stopped == greedy[: greedy.index(stop) + 1] and last.finish_reason.value == "stop"
    # the stop token's text is left out, unless include_stop_str_in_output (as vLLM's server does)
    _, included_text, _ = await _completion(session, "p-stop-in", max_tokens=12, stop_token_ids=(stop,),
                                            include_stop_str_in_output=True)
    assert stopped_text == session.tokenizer.decode(stopped[:-1]) and included_text == session.tokenizer.decode(stopped)
    held, _, _ = await _completion(session, "p-min", max_tokens=12, stop_token_ids=(stop,), min_tokens=6)
    assert len(held) >= 6 and stop not in held[:6]
    # a stop string completing in the first tokens' text ends the reply only after min_tokens
    first = session.tokenizer.decode(greedy[:2])[-1:]
    early, _, _ = await _completion(session, "p-early", max_tokens=32, ignore_eos=True, stop=(first,))
    late, late_text, _ = await _completion(session, "p-late", max_tokens=32, ignore_eos=True, stop=(first,),
                                           min_tokens=8)
    assert len(early) <= 2 < 8 < len(late) and late == greedy[: len(late)] and text.startswith(late_text)


async def test_logit_bias_outside_the_vocabulary_is_refused(dense_session):
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        await dense_session.prepare_grammar(SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}))


async def test_min_tokens_past_the_context_is_clamped_with_max_tokens(dense_session):
    session = dense_session
    limit = await session.max_model_len()
    ids = session.tokenizer.encode(PROMPT)
    long = tuple(ids * ((limit - 8) // len(ids)))
    params = SamplingParams(temperature=0.0, max_tokens=64, min_tokens=64, ignore_eos=True)
    outs = [o async for o in session.stream_completion(long, params, "p-clamp", "salt-clamp")]
    assert outs[-1].error is None and outs[-1].finish_reason.value == "length"
    assert len(long) + sum(len(o.new_token_ids) for o in outs) == limit

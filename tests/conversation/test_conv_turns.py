"""Six-turn conversations through the cache == each turn sent stateless with the whole history.

For each family, every turn is planned to end in a given way (max_tokens with the committed
state length block-aligned or not, <|end_of_turn|>, a stop string). The user message of a
turn is picked among candidates by running them stateless first (batched): the first one
that ends the planned way is sent through the cache, and that stateless run is the turn's
reference (same ledger history, same sampling parameters). Greedy tokens must be equal and
the sampled tokens' logprobs within LOGPROB_TOL.

    committed state length = prompt + generated - 1     (the last token is sampled, not fed)
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from proto.contract import ConversationRef
from tests.conversation.helpers import (
    BLOCK,
    Result,
    assert_same_output,
    greedy,
    head_of,
    new_cache,
    new_engine,
    reference_prompt,
    run_stateless,
    run_turn,
    user,
)
from workers.checkpoint import EOS_TOKEN_ID, Arch
from workers.request import FinishReason
from workers.sampling import SamplingParams

TEXTS = [
    "hi", "Tell me more.", "Why?", "ok then", "What is 2+2?", "abc def", "Go on", "Hmm.",
    "no", "And?", "Sure", "x", "Is it so?", "Thanks!", "zzz", "Again",
]  # fmt: skip
PLAN = ["eos", "length_aligned", "stop_string", "length_unaligned", "stop_string", "length_aligned"]


@dataclass
class Planned:
    messages: list[dict]
    params: SamplingParams
    expected: Result
    stop: str | None = None


def _aligned_max_tokens(prompt_len: int) -> int:
    """max_tokens in [5, 5 + BLOCK) with prompt_len + max_tokens - 1 a multiple of BLOCK."""
    return 5 + (-(prompt_len + 4)) % BLOCK


def _first_stop(tokens: list[int], text: str) -> tuple[str, int] | None:
    """A 2-character stop string whose first occurrence ends at k in [4, 12], and k."""
    if EOS_TOKEN_ID in tokens or len(text) != len(tokens):
        return None
    for k in range(4, 13):
        s = text[k - 2 : k]
        if text.find(s) == k - 2:
            return s, k
    return None


def plan_turn(ref, history, kind: str, turn: int) -> Planned:
    """Run candidate messages stateless; keep the first whose turn ends the planned way."""
    tok = ref.tokenizer
    n = len(TEXTS) if kind == "eos" else 4  # <|end_of_turn|> is the rarer ending
    candidates = [user(TEXTS[(turn * 3 + i) % len(TEXTS)] + f" #{turn}") for i in range(n)]
    prompts = {f"probe{turn}-{i}": reference_prompt(ref, history, m) for i, m in enumerate(candidates)}
    params = {}
    for rid, prompt in prompts.items():
        aligned = _aligned_max_tokens(len(prompt))
        params[rid] = {
            "length_aligned": greedy(aligned),
            "length_unaligned": greedy(aligned + 3),
            "eos": greedy(24),
            "stop_string": greedy(13),
        }[kind]
    results = run_stateless(ref, prompts, params)
    for (rid, r), messages in zip(results.items(), candidates):
        if kind.startswith("length") and r.finish_reason is FinishReason.LENGTH:
            return Planned(messages, params[rid], r)
        if kind == "eos" and r.ended_by_eos:
            return Planned(messages, params[rid], r)
        if kind == "stop_string" and (found := _first_stop(r.tokens, tok.decode(r.tokens))):
            stop, k = found
            expected = Result(rid, r.tokens[:k], r.logprobs[:k], FinishReason.STOP)
            return Planned(messages, greedy(13, stop=(stop,)), expected, stop)
    pytest.fail(f"no candidate turn {turn} ended by {kind}: {[(r.tokens, r.finish_reason) for r in results.values()]}")


@pytest.mark.parametrize("arch", list(Arch), ids=lambda a: a.value)
def test_six_turns_equal_stateless(models, reference_engines, arch):
    eng = new_engine(models[arch])
    cc = new_cache(eng)
    ref = reference_engines[arch]
    seen_kinds, seen_alignment = set(), set()
    prev_state_len, reused, cow = 0, 0, 0
    for turn, kind in enumerate(PLAN, start=1):
        before = cc.describe(ConversationRef("c1", "salt")) if turn > 1 else {"messages": [], "token_ids": []}
        planned = plan_turn(ref, before["messages"], kind, turn)
        result = run_turn(cc, "c1", "salt", planned.messages, planned.params, f"r{turn}")
        assert_same_output(result, planned.expected, f"{arch.value} turn {turn} ({kind})")

        request = result.request
        prompt_len = request.num_prompt_tokens
        assert prompt_len == len(reference_prompt(ref, before["messages"], planned.messages))
        assert request.token_ids[: len(before["token_ids"])] == before["token_ids"], "history was re-tokenized"
        assert result.num_cached_tokens == prev_state_len
        if turn > 1:
            assert prev_state_len > 0, "turns after the first reuse the committed head"
        cow += prev_state_len % BLOCK != 0  # only an unaligned head has a tail block to copy
        reused += prev_state_len
        stats = cc.stats()
        assert (stats.get("hits", 0), stats.get("misses", 0)) == (turn - 1, 0)
        assert stats["tokens_reused"] == reused
        assert stats["cow_block_copies"] == cow

        # The ledger: exactly what the model saw and produced; the head: one token fewer.
        after = cc.describe(ConversationRef("c1", "salt"))
        assert after["turn"] == turn and after["token_ids"] == request.token_ids
        reply = after["messages"][-1]
        assert reply == {"role": "assistant", "content": eng.tokenizer.decode(result.tokens)}
        assert after["messages"][:-1] == before["messages"] + planned.messages
        if planned.stop is not None:
            assert reply["content"].endswith(planned.stop), "the ledger keeps the stop string"
        head = head_of(cc, "c1", "salt")
        assert head.state_len == prompt_len + len(result.tokens) - 1 == len(request.token_ids) - 1
        assert head.aligned_len == head.state_len // BLOCK * BLOCK
        seen_alignment.add(head.state_len % BLOCK == 0)
        seen_kinds.add("eos" if result.ended_by_eos else "stop_string" if planned.stop else result.finish_reason)
        prev_state_len = head.state_len
    assert seen_kinds == {"eos", "stop_string", FinishReason.LENGTH}
    assert seen_alignment == {True, False}, "both block-aligned and unaligned committed lengths"

"""The router's token estimates (routing/token_estimate.py) are in the replicas' tokens: a
holder's count of a prefix calibrates them. Characters over four was 4.35 times short of the bench
checkpoint's count of a tool catalogue, and the router then took a stateless step's prefill on
its holder as nothing (its estimated prompt minus a held prefix counted in real tokens)."""

from __future__ import annotations

import pytest

from deployments.routing.token_estimate import MAX_SCALE, TokenScale, estimated_tokens, prefix_estimates, raw_estimates
from proto.contract import message_prefix_digests

CATALOGUE = {"role": "system", "content": "x" * 1866}  # 467 tokens at four characters each (with 2 for no calls)
STEP = [CATALOGUE, {"role": "user", "content": "y" * 398}, {"role": "tool", "content": "z" * 798}]


def test_a_held_prefix_calibrates_its_request_and_teaches_the_scale():
    scale = TokenScale()
    assert raw_estimates(STEP) == [467, 567, 767]  # each message also counts '""' for its absent tool calls
    # a replica's engine counted the catalogue (messages[:1]) as 2,033 tokens
    names = prefix_estimates("tenant", STEP, longest=(1, 2033), scale=scale)
    assert [tokens for _, tokens in names] == [2033, round(567 * 2033 / 467), round(767 * 2033 / 467)]
    assert scale.value == pytest.approx(2033 / 467)
    # a request nobody holds anything of, and a conversation's new messages, at the learned scale
    alone = prefix_estimates("other", STEP[:2], scale=scale)
    assert [tokens for _, tokens in alone] == [2033, round(567 * 2033 / 467)]
    assert estimated_tokens(STEP[1:2], scale=scale) == round(100 * 2033 / 467)
    # the names are the prefix index's, whatever the lengths
    assert [name for name, _ in names] == message_prefix_digests("tenant", STEP)


def test_a_ratio_no_tokenizer_gives_is_not_learned():
    scale = TokenScale()
    names = prefix_estimates("tenant", STEP, longest=(1, int(467 * MAX_SCALE * 2)), scale=scale)
    assert [tokens for _, tokens in names] == [467, 567, 767] and scale.value == 1.0
    scale.observe(1000, 500)
    scale.observe(3000, 1000)
    assert scale.value == pytest.approx(0.9 * 2 + 0.1 * 3)  # a running mean, not the last ratio

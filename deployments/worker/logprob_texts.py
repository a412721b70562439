"""The engine's logprobs as the wire carries them (messages.py): token ids with their texts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from deployments.messages import PromptLogprob, TokenLogprob
from workers.prompt_logprobs import PromptTokenLogprob
from workers.sampling import SampledToken, SamplingParams


def reply_logprobs(tokens: Iterable[SampledToken], params: SamplingParams,
                   text: Callable[[int], str]) -> tuple[TokenLogprob, ...] | None:
    if params.logprobs is None:
        return None
    return tuple(
        TokenLogprob(text(t.token_id), t.token_id, float(t.logprob),
                     tuple((text(i), float(lp)) for i, lp in (t.top_logprobs or ())))
        for t in tokens)


def prompt_logprobs(entries: Iterable[PromptTokenLogprob] | None,
                    text: Callable[[int], str]) -> tuple[PromptLogprob, ...] | None:
    if entries is None:
        return None
    text = functools.lru_cache(maxsize=None)(text)  # a prompt repeats its tokens, and its top k more so
    return tuple(PromptLogprob(text(e.token_id), e.token_id, e.logprob, e.rank,
                               tuple((i, text(i), lp) for i, lp in e.top)) for e in entries)

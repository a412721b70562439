"""A prompt's logprobs in the two shapes clients read (the worker's PromptLogprob entries, one per
prompt token, the first without a logprob).

    vLLM's `prompt_logprobs` (completions: in the choice; chat: top level):
        [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...]   the prompt token, then the top k
    OpenAI's legacy `logprobs` of completions with `echo` (what lm-eval's log-likelihood reads):
        tokens, token_logprobs [null, ...], top_logprobs [null, {text: logprob}, ...], text_offset
        (each top_logprobs dict holds the prompt token and the top k, as vLLM's does)

Logprobs below -9999 are written as -9999 (JSON has no -inf; OpenAI's and vLLM's floor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deployments.messages import PromptLogprob

FLOOR = -9999.0


def _floor(logprob: float) -> float:
    return max(logprob, FLOOR)


def vllm_prompt_logprobs(entries: Sequence[PromptLogprob], k: int) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        step = {str(e.token_id): {"logprob": _floor(e.logprob), "rank": e.rank, "decoded_token": e.token}}
        for rank, (token_id, text, logprob) in enumerate(e.top[:k], start=1):
            step.setdefault(str(token_id), {"logprob": _floor(logprob), "rank": rank, "decoded_token": text})
        out.append(step)
    return out


def legacy_prompt_logprobs(entries: Sequence[PromptLogprob], k: int) -> dict[str, list]:
    """The legacy parallel lists over the prompt (offsets from 0: the echoed prompt opens the text)."""
    tokens, logprobs, tops, offsets, offset = [], [], [], [], 0
    for e in entries:
        tokens.append(e.token)
        offsets.append(offset)
        offset += len(e.token)
        if e.logprob is None:
            logprobs.append(None)
            tops.append(None)
            continue
        logprobs.append(_floor(e.logprob))
        top = {e.token: _floor(e.logprob)}
        for _, text, logprob in e.top[:k]:
            top.setdefault(text, _floor(logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}

"""How long a request's messages are in tokens, for routing, without a tokenizer (the ingress
loads none): characters / CHARS_PER_TOKEN, calibrated by what the replicas counted.

The router adds these estimates to queues the replicas report in real tokens (cost.py,
sent_log.py), and subtracts real held prefixes from them, so they must be in the same unit.
Characters over four is the English rule; other text and vocabularies differ by several times
(bench.agent's checkpoint counts a tenant's system prompt and tool catalogue as 2,033 tokens
where characters over four said 467). So every prefix lookup that finds a holder teaches the
scale: the holder's engine counted messages[:k] as T tokens, the estimate said E, and T / E is
how this deployment's text tokenizes (TokenScale, a running mean).
The request's own ratio is used where it has one; a request nobody holds anything of uses the
learned scale.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from proto.contract import message_prefix_digests

# A rough length of text in tokens (English and JSON) before any calibration.
CHARS_PER_TOKEN = 4
# A ratio outside these bounds is a mismatch (another rendering, a template adding much), not a scale.
MIN_SCALE, MAX_SCALE = 0.125, 8.0
# Weight of the newest ratio in the learned scale.
SCALE_WEIGHT = 0.1


class TokenScale:
    """Real tokens per raw estimated token, a running mean over the ratios observed (1 until then)."""

    def __init__(self) -> None:
        self.value = 1.0
        self._seen = False

    def observe(self, real: int, estimated: int) -> float | None:
        """Learn from one prefix; its ratio, or None if it says nothing (or nothing sensible)."""
        if real <= 0 or estimated <= 0:
            return None
        ratio = real / estimated
        if not MIN_SCALE <= ratio <= MAX_SCALE:
            return None
        self.value = ratio if not self._seen else (1 - SCALE_WEIGHT) * self.value + SCALE_WEIGHT * ratio
        self._seen = True
        return ratio


SCALE = TokenScale()  # this ingress process's


def raw_estimates(messages: Sequence[dict], tools: Sequence[dict] = ()) -> list[int]:
    """Uncalibrated tokens of each prefix messages[:k] (k = 1..n), the tools included (the
    template renders them into the prompt's start)."""
    chars = len(json.dumps(list(tools))) if tools else 0
    out = []
    for message in messages:
        chars += _chars(message)
        out.append(chars // CHARS_PER_TOKEN)
    return out


def prefix_estimates(scope: str, messages: Sequence[dict], tools: Sequence[dict] = (),
                     longest: tuple[int, int] | None = None,
                     scale: TokenScale = SCALE) -> tuple[tuple[str, int], ...]:
    """(name, estimated tokens) of each prefix messages[:k]: the names the prefix index uses, and
    lengths in the replicas' tokens. `longest`: (k, tokens) of the longest prefix a replica holds
    (PrefixHints.longest), which calibrates this request and teaches the scale."""
    raw = raw_estimates(messages, tools)
    ratio = None
    if longest is not None and 0 < longest[0] <= len(raw):
        ratio = scale.observe(longest[1], raw[longest[0] - 1])
    factor = ratio if ratio is not None else scale.value
    names = message_prefix_digests(scope, list(messages))
    return tuple((name, round(tokens * factor)) for name, tokens in zip(names, raw))


def estimated_tokens(messages: Sequence[dict], scale: TokenScale = SCALE) -> int:
    """The messages' length in the replicas' tokens (a conversation's new messages), at the learned scale."""
    return round(sum(_chars(m) for m in messages) / CHARS_PER_TOKEN * scale.value)


def _chars(message: dict) -> int:
    return len(str(message.get("content") or "")) + len(json.dumps(message.get("tool_calls") or ""))

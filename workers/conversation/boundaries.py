"""Where a chat's prompt may be checkpointed: the token positions at which messages end.

Conversations diverge only at message boundaries, so that is where a prefix's state is worth
keeping. Two are marked per prompt: the end of the first message (a system prompt, shared by
every conversation that opens with it) and the end of the last one (the whole history before
the generation prompt: what the next request of a client that re-renders history differently,
e.g. without the reply's reasoning, still shares). The end of the reply is the request's own
final state (keep=CHECKPOINT), labelled len(messages) + 1.

A boundary is marked only where the template's rendering of messages[:k] encodes to a prefix
of the prompt's own token ids: the engine attaches states by token ids, never by text, so a
template or tokenizer that does not split there simply gets no mark.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workers.request import CheckpointMark, ReuseSource
from workers.tokenizer import ChatTokenizer


def message_marks(
    tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], prompt_ids: Sequence[int],
    tools: Sequence[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None,
) -> tuple[CheckpointMark, ...]:
    """`kwargs`: the request's chat_template_kwargs (its messages rendered as its prompt was)."""
    marks: dict[int, CheckpointMark] = {}
    for k in sorted({1, len(messages)}):
        n = _boundary(tokenizer, messages[:k], prompt_ids, tools, kwargs)
        if n and n not in marks:
            system = k == 1 and messages[0].get("role") == "system"
            marks[n] = CheckpointMark(n, label=k, source=ReuseSource.SYSTEM if system else ReuseSource.PREFIX)
    return tuple(marks.values())


def _boundary(tokenizer: ChatTokenizer, messages: Sequence[dict[str, Any]], prompt_ids: Sequence[int],
              tools: Sequence[dict[str, Any]] | None, kwargs: dict[str, Any] | None = None) -> int:
    """The length of `messages` rendered, if that is a proper prefix of the prompt's ids; else 0."""
    try:
        ids = tokenizer.encode(tokenizer.render_chat(list(messages), add_generation_prompt=False, tools=tools,
                                                     kwargs=kwargs))
    except Exception:  # a template may refuse a partial chat (e.g. a system message alone)
        return 0
    n = len(ids)
    return n if 0 < n < len(prompt_ids) and list(prompt_ids[:n]) == ids else 0


def reply_label(messages: Sequence[dict[str, Any]]) -> int:
    """The label of a request's final state: its messages and the reply."""
    return len(messages) + 1

"""hybridserve's fields beside OpenAI's in the body that ends a turn (a chat completion, its last
stream chunk, a Response): clients that do not know them ignore them (the OpenAI SDKs keep them
in `model_extra`)."""

from __future__ import annotations

from typing import Any

from deployments.messages import TurnDone


def served_by(done: TurnDone) -> dict[str, Any]:
    """Where a turn ran and where its cached tokens came from: the Serve replica's id;
    `cached_from` "head" (the conversation's own state) | "prefix" (a checkpoint at a message
    boundary or an earlier request's end) | "system" (a shared system prompt) | null (nothing
    reused); and how the worker got the state it continued from (messages.Recovery)."""
    return {"replica": done.replica, "cached_from": done.reused_from or None, "recovery": done.recovery.value}

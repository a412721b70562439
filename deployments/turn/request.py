"""What the ingress asks of a turn (TurnRequest), and the one answer other than a started
turn: the conversation's head was not the turn the request was planned on (HeadMoved).

    front/ (a chat completion, a Responses plan) --TurnRequest--> TurnRun.start
        -> TurnRun            the lease is held (a conversation), the job made
        -> HeadMoved          expect_turn given and the head found elsewhere under the lease, or
                              at it with another turn than expect_publish_id (replaced); the
                              lease is already discarded, nothing ran
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deployments.turn.outcome import IdempotencyKey
from proto.contract import ConversationRef
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions


@dataclass(frozen=True)
class TurnRequest:
    """One turn to run. `scope`: the caller's cache scope (a conversation's is its salt; a
    stateless request's names the prefixes it may reuse). `tools`: the request's function tools
    (TurnJob.tools)."""

    messages: list[dict[str, Any]]  # a conversation's new suffix, or a stateless request's history
    sampling: dict[str, Any]
    scope: str
    conversation: ConversationRef | None = None  # None: stateless
    wait_if_busy: bool = False  # wait for a conversation's lease (else 409 at once)
    idempotency: IdempotencyKey | None = None
    tools: tuple[dict[str, Any], ...] = ()
    parse_tool_calls: bool = False
    template: TemplateOptions = DEFAULT_TEMPLATE  # TurnJob.template
    request_id: str = ""  # "": a fresh chatcmpl- id
    # The head turn the conversation must be at under the turn's lease (0: a new conversation),
    # else the turn does not run (HeadMoved). None: whatever the head is.
    expect_turn: int | None = None
    # The publish id the turn at expect_turn must have under the lease ("": any): the turn the
    # request was planned on, not one that took its place after a rewind.
    expect_publish_id: str = ""
    # A fork nobody has been told of yet: deleted if this, its first turn, does not commit.
    drop_if_uncommitted: bool = False
    # A legacy completion's prompt (text or token ids), run as is, without the chat template
    # (stateless, `messages` empty). None: a chat request.
    prompt: str | tuple[int, ...] | None = None


@dataclass(frozen=True)
class HeadMoved:
    """The conversation's head was at `found`, not at the request's expect_turn; or `replaced`:
    at it, but its turn is not the one the request was planned on (that one was deleted)."""

    found: int
    replaced: bool = False

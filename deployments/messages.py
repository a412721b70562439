"""What travels between the ingress and a worker replica (pickled by Ray), stated once.

    ingress ── TurnJob ──> router (reads `owner`, `prefix_holders`) ──> Worker.run_turn
    ingress <── TurnDelta* then TurnDone | TurnFailed ──┘

Plain dataclasses and enums only: the ingress never imports torch or the engine.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from proto.contract import ConversationRef, tokens_digest
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions


@dataclass(frozen=True)
class HeadRef:
    """The conversation's committed head as the cache service knows it, under the turn's lease."""

    version: int
    turn: int
    committed_tokens: int
    tokens_sha256: str
    owner: str  # Serve replica id (unique part) of the worker holding the state; "" if none
    tier_version: int  # head version whose state the tier holds (0: none)
    incarnation: str = ""  # the conversation's life (a deleted and re-created one has another)

    @classmethod
    def of(cls, head: Any) -> "HeadRef":
        """From the cache service's `Head` message."""
        return cls(head.version, head.turn, head.committed_tokens, head.tokens_sha256, head.owner_replica,
                   head.tier_version, head.incarnation)

    def is_of(self, tokens: list[int]) -> bool:
        """Whether `tokens` are exactly this head's committed tokens."""
        return len(tokens) == self.committed_tokens and tokens_digest(tokens) == self.tokens_sha256

    def same_state(self, other: "HeadRef") -> bool:
        """The same committed turn (version, turn, tokens), whoever owns it and whatever the tier
        holds. A conversation deleted and re-created under its id and salt starts again at
        version 1: only its tokens tell it from the old one (identical tokens: identical state)."""
        return (self.version, self.turn, self.committed_tokens, self.tokens_sha256) == (
            other.version, other.turn, other.committed_tokens, other.tokens_sha256)


def prompt_as_messages(prompt: str | tuple[int, ...]) -> list[dict[str, Any]]:
    """How the prefix index names a legacy completion's prompt (it names message prefixes): one
    pseudo-message, so a request repeating a prompt is routed where that prompt's state is held."""
    return [{"role": "prompt", "content": prompt if isinstance(prompt, str) else json.dumps(list(prompt))}]


@dataclass(frozen=True)
class TurnJob:
    request_id: str
    messages: list[dict[str, Any]]  # the new suffix (conversation) or the full history (stateless)
    sampling: dict[str, Any]  # SamplingParams fields; the worker validates them
    conversation: ConversationRef | None = None  # None: stateless; salt scoped to the API key if auth is on
    lease: Any = None  # the cache client's Lease (token + proof of holding), passed back as given
    head: HeadRef | None = None  # None: the conversation's first turn
    # Names the turn's publish: the ingress finds the turn in the ledger by it when the publish's
    # outcome is unknown, and an idempotent retry (same Idempotency-Key and body) by its prefix.
    publish_id: str = ""
    # (replica, tokens held) of the replicas (Serve replica unique ids) the prefix index names as
    # holding the longest message prefix of a stateless request or a new conversation: the router
    # prices the prefill each one saves (routing/cost.py). A hint.
    prefix_holders: tuple[tuple[str, int], ...] = ()
    # (name, estimated tokens) of each message prefix of a stateless request or a new conversation
    # (routing/token_estimate.py `prefix_estimates`): when nobody holds any of it, the router sends
    # requests sharing a long one to where the first of them computes it (coalescing).
    prefix_names: tuple[tuple[str, int], ...] = ()
    # (name, tokens) of the longest prefix of a stateless request's messages the state tier holds
    # (the prefix index's "~tier" holder): the router prices importing it, and the worker imports
    # it when that is cheaper than computing what it lacks (worker/prefix_tier.py). A hint.
    tier_prefix: tuple[str, int] | None = None
    # A stateless request's cache scope (its salt, scoped to the API key if auth is on): the
    # prefixes it reuses and keeps are named in it. A conversation's scope is its ref's salt.
    stateless_scope: str = ""
    # The request's function tools (OpenAI chat shape: {"type": "function", "function": {...}}):
    # the chat template renders them; the reply's tool calls are parsed out of its text.
    tools: tuple[dict[str, Any], ...] = ()
    parse_tool_calls: bool = False  # tools given and tool_choice not "none"
    # How the chat template renders the messages (vLLM's chat_template_kwargs, add_generation_prompt,
    # continue_final_message); a conversation turn's always opens the reply.
    template: TemplateOptions = DEFAULT_TEMPLATE
    # A legacy completion's prompt (text or token ids), no chat template; stateless, no messages.
    prompt: str | tuple[int, ...] | None = None

    @property
    def scope(self) -> str:
        return self.conversation.salt if self.conversation is not None else self.stateless_scope

    @property
    def publish_name(self) -> str:
        return self.publish_id or self.request_id

    @property
    def owner(self) -> str:
        """The replica the sticky router prefers ("" = least loaded)."""
        return self.head.owner if self.head is not None else ""


@dataclass(frozen=True)
class ReplicaCall:
    """Marks a call meant for one replica, the owner of a head (e.g. dropping a deleted
    conversation's state): the sticky router ranks that replica first, as for a TurnJob."""

    owner: str


class Recovery(enum.Enum):
    """How a worker got the committed state the turn continues from."""

    NEW = "new"  # first turn, or a stateless request
    LOCAL = "local"  # the head was on this replica
    TIER_IMPORT = "tier_import"  # imported from the state tier (a migration)
    TIER_PREFIX = "tier_prefix"  # an older head imported from the tier, the turns after it recomputed
    PREFIX_IMPORT = "prefix_import"  # a stateless request's prefix checkpoint imported from the tier
    LEDGER_RECOMPUTE = "ledger_recompute"  # rebuilt from the ledger's token ids (a miss)
    REPLAY = "replay"  # not run: the turn had committed already (a retry), answered from the ledger


class ErrorKind(enum.Enum):
    INVALID = "invalid_request"  # 400
    TOO_LONG = "context_length_exceeded"  # 400, as in OpenAI's API
    CONFLICT = "conversation_conflict"  # 409: the head moved or the lease was lost meanwhile
    UNAVAILABLE = "unavailable"  # 503: a dependency is down, retry later
    INTERNAL = "internal_error"  # 500: a bug or a failed model step, never bad input
    # 503: the cache service could not say whether the turn committed; a retry with the same
    # Idempotency-Key learns it (answered from the ledger if it did, run if it did not)
    OUTCOME_UNKNOWN = "turn_outcome_unknown"
    # 503: the cache service's Redis is full (maxmemory): nothing was committed; reads go on
    STORAGE_FULL = "storage_full"


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class PromptLogprob:
    """A prompt token's logprob (the request's `prompt_logprobs`, or completions' `echo` with
    `logprobs`): None for the prompt's first token, which nothing precedes; its rank (1: the
    likeliest) and the top k as (token id, text, logprob), likeliest first."""

    token: str
    token_id: int
    logprob: float | None
    rank: int | None = None
    top: tuple[tuple[int, str, float], ...] = ()


@dataclass(frozen=True)
class ToolCall:
    """A tool call of the reply, parsed out of its text."""

    id: str
    name: str
    arguments: str  # the JSON text as the model wrote it


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the reply's `index`-th tool call, as it streams: its first delta names it
    (`id`, `name`), the next ones carry more of its arguments' text."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class TurnDelta:
    text: str  # the reply's content (the text of tool calls is in tool_calls, not here)
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    # An entry per prompt token, once, before the reply's first token (when the request asked);
    # n > 1: on choice 0 only (the prompt is every choice's)
    prompt_logprobs: tuple[PromptLogprob, ...] | None = None
    index: int = 0  # the choice (n > 1) it belongs to


@dataclass(frozen=True)
class ChoiceEnd:
    """How choice `index` (n > 1, index >= 1) of a turn ended; the turn's TurnDone is choice 0's
    and carries these. Only choice 0 is committed or checkpointed."""

    index: int
    finish_reason: str
    completion_tokens: int
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class TurnDone:
    finish_reason: str  # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    recovery: Recovery
    replica: str
    turn: int = 0  # the committed turn (0: stateless)
    head_version: int = 0
    # where the cached tokens came from: "head" (the conversation's), "prefix" (a checkpoint at a
    # message boundary or an earlier request's end), "system" (a shared system prompt), "" none
    reused_from: str = ""
    tool_calls: tuple[ToolCall, ...] = ()  # the reply's, whole (the deltas streamed them piece by piece)
    # n > 1: the other choices' ends, by index (prompt_tokens counts the prompt once; usage sums
    # completion_tokens over every choice, as OpenAI's does)
    others: tuple[ChoiceEnd, ...] = ()
    # A stateless request's or a first turn's prefix checkpoints on `replica`, named as the prefix
    # index names them: (message_prefix_digests name, tokens). The ingress routes the client's
    # next request by them at once (routing/recent_prefixes.py); the index hears of them later.
    prefixes: tuple[tuple[str, int], ...] = ()

    @property
    def all_completion_tokens(self) -> int:
        return self.completion_tokens + sum(c.completion_tokens for c in self.others)


@dataclass(frozen=True)
class TurnFailed:
    kind: ErrorKind
    message: str
    details: dict[str, Any] = field(default_factory=dict)


TurnEvent = TurnDelta | TurnDone | TurnFailed

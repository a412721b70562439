"""What a worker replica asks of its engine, whichever the backend: our engine
(engine_session.EngineSession) or vLLM's in an engine host (vllm_session.VllmSession).
The worker (replica.py), the recovery ladder and the tier exporter are typed against this;
tests/serve/test_session_protocol.py checks that both sessions implement it.

    a turn:     turn_started ─ holds / forget / adopt_ledger / import_state (the recovery ladder)
                ─ stream_turn (its final output carries the prepared TurnCommit)
                ─ commit or abandon, as the cache service decided ─ turn_ended
    stateless:  stream_stateless (the longest held prefix of its prompt is reused)
    the tier:   export_state (a committed head as tier parts), tier_holds (it landed there),
                import_state (another replica's);
                export_prefix, held_prefix, import_prefix: prefix checkpoints (where prefix_tier)
    upkeep:     load (routing stats), held_heads, forget_idle, check_health, shutdown

`use` is the replica's one count of the turns running here, per conversation: the session's
idle copies and the exporter's "export when quiet" both read it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from deployments.messages import HeadRef
from deployments.worker.turns_here import ConversationUse
from proto.contract import ConversationRef
from workers.conversation.records import HeadInfo, LedgerTurn, TurnCommit
from workers.engine import RequestOutput
from workers.load import EngineLoad
from workers.sampling import SamplingParams
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions
from workers.tokenizer import ChatTokenizer
from workers.tools.formats import ToolFormat


class Session(Protocol):
    use: ConversationUse
    tokenizer: ChatTokenizer  # the model's tokenizer and chat template (used off the engine thread too)
    prefix_tier: bool  # exports and imports prefix checkpoints (the three calls below; else never called)

    @property
    def tool_format(self) -> ToolFormat:
        """The form this model's chat template writes tool calls in."""
        ...

    def token_text(self, token_id: int) -> str: ...

    def shutdown(self) -> None: ...

    def check_health(self) -> None:
        """Raises once the engine can no longer serve (Serve replaces the replica)."""
        ...

    async def load(self) -> EngineLoad:
        """Its queue and measured speeds, for routing stats (what the backend cannot tell: 0)."""
        ...

    async def kv_cache_usage(self) -> float:
        """The fraction of KV cache blocks running requests hold (0..1), for routing stats."""
        ...

    def withdrawn_prefixes(self) -> list[Any]:
        """The engine's names (RequestOutput.checkpoint_keys) of checkpoints it no longer holds,
        since the last call: their announces are withdrawn from the prefix index."""
        ...

    async def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                       template: TemplateOptions) -> list[int]:
        """/tokenize: a raw prompt's ids, or the chat template's rendering of messages."""
        ...

    async def detokenize(self, token_ids: list[int]) -> str:
        """/detokenize: the ids' text, special tokens kept."""
        ...

    async def max_model_len(self) -> int:
        """The longest prompt + reply the engine takes."""
        ...

    # -- what this engine holds (the recovery ladder) ---------------------------------------
    async def holds(self, ref: ConversationRef, head: HeadRef) -> bool:
        """Whether this engine holds exactly `head`: its ledger at that version and its state."""
        ...

    async def forget(self, ref: ConversationRef, deleted: HeadRef | None = None) -> None:
        """Drop the conversation's ledger and heads here (with `deleted`: only if they are that head's)."""
        ...

    async def adopt_ledger(self, ref: ConversationRef, head: HeadRef, turns: list[LedgerTurn]) -> None: ...

    async def import_state(self, ref: ConversationRef, blob: bytes) -> HeadInfo: ...

    async def export_state(self, ref: ConversationRef) -> tuple[int, list[bytes]]:
        """(head version, tier parts) of the conversation's latest head."""
        ...

    async def tier_holds(self, ref: ConversationRef, version: int) -> None:
        """The tier now holds the conversation's head of `version` (it was exported): where memory
        runs short, such heads are let go before those held only here."""
        ...

    async def export_prefix(self, key: Any) -> list[bytes] | None:
        """Tier parts of the prefix checkpoint the engine names `key` (None: no longer held)."""

    async def held_prefix(self, scope: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template: TemplateOptions) -> tuple[list[int], int]:
        """(a stateless request's prompt ids, the tokens of it held here under `scope`)."""

    async def import_prefix(self, scope: str, blob: bytes, prompt: list[int]) -> int:
        """Install another replica's prefix checkpoint (a prefix of `prompt`); its tokens."""

    async def held_heads(self, ref: ConversationRef | None = None) -> int: ...

    def turn_started(self, ref: ConversationRef) -> None:
        """A turn of the conversation begins here (before its recovery): its ledger is kept."""
        ...

    def turn_ended(self, ref: ConversationRef) -> None: ...

    async def forget_idle(self, ttl_s: float) -> int:
        """Forget the conversations unused here for more than `ttl_s`; returns how many."""
        ...

    # -- turns ------------------------------------------------------------------------------
    async def prepare_grammar(self, params: SamplingParams) -> None:
        """Refuses (InvalidRequestError) what the engine cannot run, before the turn starts."""
        ...

    def stream_turn(self, ref: ConversationRef, suffix: list[dict[str, Any]], params: SamplingParams,
                    request_id: str, tools: list[dict[str, Any]] | None = None,
                    template: TemplateOptions = DEFAULT_TEMPLATE) -> AsyncIterator[RequestOutput]:
        """`template`: the request's chat_template_kwargs (a turn's prompt always opens its reply)."""
        ...

    def stream_stateless(self, messages: list[dict[str, Any]], params: SamplingParams, request_id: str,
                         cache_salt: str, tools: list[dict[str, Any]] | None = None,
                         template: TemplateOptions = DEFAULT_TEMPLATE) -> AsyncIterator[RequestOutput]:
        """`template`: how the chat template renders the messages (template_options.py)."""
        ...

    def stream_completion(self, prompt: str | tuple[int, ...], params: SamplingParams, request_id: str,
                          cache_salt: str) -> AsyncIterator[RequestOutput]:
        """A legacy completion: the prompt's text tokenized as is (no chat template, no special
        tokens added) or its token ids; reuses the longest prefix held here under `cache_salt`
        and keeps its end, as a stateless chat request."""
        ...

    async def commit(self, record: TurnCommit) -> HeadInfo:
        """The prepared turn becomes the conversation's head (the service accepted it)."""
        ...

    async def abandon(self, record: TurnCommit) -> None:
        """The prepared turn is dropped (the service refused it); the previous head is untouched."""
        ...

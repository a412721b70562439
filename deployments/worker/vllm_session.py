"""The worker's engine session on the vLLM backend: the Session interface (session.py) over
vLLM's engine in an engine host process (workers/vllm_backend). The conversations' bookkeeping
(ledgers, heads, two-phase turns) is workers/vllm_backend/conversations.py; this adapter builds
prompts (workers/conversation/prompt.py, as our engine does) and streams the host's frames.

A stateless request (the whole chat each time) loads the longest prefix checkpoint of its
prompt and leaves one where it ends and at the message boundaries our engine marks
(workers/conversation/boundaries.py): its system prompt, kept for the new chats that open with
it, and the end of its last message, kept for a next request that renders the history otherwise
(workers/vllm_backend/prefixes.py). As on our engine, a chat resent in full runs only its new
messages, and a shared system prompt is computed once; unlike it, a boundary not held yet costs
a one-token request of its own before the real one (vLLM has no state inside a prompt). Its
checkpoints travel through the state tier as our engine's do (worker/prefix_tier.py): exported
in this backend's format (workers/vllm_backend/export.py), so only another vLLM worker of the
same layout imports them.

Constrained decoding (structured outputs, forced and "auto" tool calls) runs as vLLM's own
structured outputs on its guidance backend: llguidance with our grammars and our view of the
tokenizer (workers/vllm_backend/structured.py). What the backend does not do: deterministic
mode and priorities (400s), and two of the boundaries our engine marks: the end of a first
message that is no system prompt, and a conversation's first turn's last message (it keeps only
its system prompt). vLLM's own prefix caching stays off: it is block-grained for hybrids and
crashes on CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import torch

from deployments.messages import HeadRef
from deployments.settings import AppSettings
from deployments.worker.turns_here import ConversationUse
from proto.contract import ConversationRef, ModelIdentity, tokens_digest
from workers.conversation.boundaries import message_marks
from workers.conversation.export_format import pack_export, unpack_export
from workers.conversation.prefix_export import scope_digest
from workers.conversation.prompt import build_turn_prompt
from workers.conversation.records import HeadInfo, LedgerTurn, TurnCommit
from workers.engine import RequestOutput
from workers.errors import CorruptStateError, InvalidRequestError, PrefixMismatchError
from workers.grammar.compiler import GrammarCompiler
from workers.grammar.guide import TokenGuide
from workers.load import EngineLoad
from workers.loop.admission import check_constraint_starts
from workers.request import CheckpointMark, ReuseSource
from workers.sampling import SamplingParams
from workers.state_names import PrefixKey
from workers.tokenizer import ChatTokenizer
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions
from workers.tools.formats import ToolFormat, plain_message, tool_format_for
from workers.vllm_backend import export as vllm_export
from workers.vllm_backend.conversations import HostedConversations
from workers.vllm_backend.engine_host import EngineHost, HostSettings
from workers.vllm_backend.prefixes import HostPrefixes
from workers.vllm_backend.requests import backend_params, vocabulary
from workers.vllm_backend.streams import HostStreams


class VllmSession:  # implements Session (session.py)
    use: ConversationUse  # the turns running here, per conversation
    tokenizer: ChatTokenizer
    prefix_tier: bool  # its prefix checkpoints go through the state tier (where it keeps any)

    def __init__(self, model_dir: str, settings: AppSettings):
        self.model_dir = model_dir
        self.tokenizer = ChatTokenizer(Path(model_dir))
        self._tool_format = tool_format_for(self.tokenizer.chat_template)
        self.vocab_size, self.allowed_ids, eos_token_ids = vocabulary(self.tokenizer, model_dir)
        self._banned_ids = torch.tensor(sorted(self.tokenizer.never_sample_ids), dtype=torch.long)
        # Checks constraints here (a bad schema is a 400); vLLM's guidance backend runs them.
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.vocab_size, eos_token_ids, self._tool_format)
        self.host = EngineHost(HostSettings(
            model=model_dir, python=settings.vllm_python, device=settings.device,
            max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
            kv_cache_mib=settings.kv_cache_mb, threads=settings.torch_threads,
            stall_timeout_s=settings.engine_stall_timeout_s))
        self.identity: ModelIdentity | None = None  # known once the host is up (its torch)
        self.layout: dict[str, Any] = {}
        self.conversations = HostedConversations(self.host, settings.head_cache_mb << 20, self.tokenizer,
                                                 eos_token_ids)
        self.prefixes = HostPrefixes(self.host, settings.prefix_cache_mb << 20)
        self.prefix_tier = self.prefixes.enabled
        self.streams = HostStreams(self.host, self.tokenizer, self.allowed_ids, self._tool_format, self.conversations,
                                   self.prefixes)
        self.use = ConversationUse()

    async def start(self) -> None:
        info = await self.host.start()
        if self.identity is None:
            self.identity = await vllm_export.host_identity(self.model_dir, self.host.settings.device, info)
            self.layout = vllm_export.host_layout(info)
            self.prefixes.layout = self.layout

    def shutdown(self) -> None:
        self.host.shutdown()

    async def aclose(self) -> None:
        await self.host.aclose()

    def check_health(self) -> None:
        """Raises once the engine host died (the replica cannot serve: Serve replaces it)."""
        self.host.check_alive()

    # -- what this engine holds -------------------------------------------------------------
    async def holds(self, ref: ConversationRef, head: HeadRef) -> bool:
        tokens = self.conversations.idle_head_tokens(ref.key, head.version, head.turn)
        return tokens is not None and head.is_of(tokens)

    async def forget(self, ref: ConversationRef, deleted: HeadRef | None = None) -> None:
        conv = self.conversations.ledgers.get(ref.key)
        if conv is None or conv.in_flight is not None:
            return
        if deleted is not None and ((conv.version, conv.turn) != (deleted.version, deleted.turn)
                                    or not deleted.is_of(conv.token_ids)):
            return
        await self.conversations.drop(ref.key)

    def turn_started(self, ref: ConversationRef) -> None:
        self.use.started(ref)

    def turn_ended(self, ref: ConversationRef) -> None:
        self.use.ended(ref)

    async def forget_idle(self, ttl_s: float) -> int:
        now, idle = self.use.idle(ttl_s)
        dropped, busy = await self.conversations.forget_idle(idle)
        self.use.forgotten(now, idle, busy)
        return dropped

    async def held_heads(self, ref: ConversationRef | None = None) -> int:
        return self.conversations.head_count(None if ref is None else ref.key)

    async def adopt_ledger(self, ref: ConversationRef, head: HeadRef, turns: list[LedgerTurn]) -> None:
        """Take the service's ledger at `head` (a head held here may stay: conversations.py)."""
        if len(turns) != head.turn or not head.is_of([t for turn in turns for t in turn.token_ids]):
            raise CorruptStateError("the ledger does not add up to the conversation's head")
        await self.conversations.adopt(ref, head.version, turns)

    async def import_state(self, ref: ConversationRef, blob: bytes) -> HeadInfo:
        """Install a head exported by another vLLM worker; the ledger must be adopted first."""
        await self.start()
        header, chunks = unpack_export(blob)
        meta, parts = await asyncio.to_thread(vllm_export.verify_export, header, chunks, self.identity, self.layout)
        return await self.conversations.install(ref, meta, parts)

    async def tier_holds(self, ref: ConversationRef, version: int) -> None:
        """Nothing: this backend's heads go by their byte budget's LRU alone."""

    async def export_state(self, ref: ConversationRef) -> tuple[int, list[bytes]]:
        """(head version, tier parts) of the conversation's head."""
        await self.start()
        return await self.conversations.export(ref, self.identity, self.layout)

    # -- prefix checkpoints through the tier (worker/prefix_tier.py) ------------------------------
    async def export_prefix(self, key: PrefixKey) -> list[bytes] | None:
        """Tier parts of the checkpoint named `key`; None if it is no longer held here, or was
        superseded by a longer link of its request chain."""
        await self.start()
        parts = await self.prefixes.export(key)
        if parts is None:
            return None
        meta = vllm_export.prefix_meta(key.scope, key.length, key.digest)
        exported = await asyncio.to_thread(vllm_export.build_export, meta, self.identity, self.layout, parts)
        return pack_export(exported)

    async def held_prefix(self, scope: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template: TemplateOptions) -> tuple[list[int], int]:
        """(the prompt's token ids, the tokens of it held here under `scope`): what a stateless
        request of these messages would load."""
        prompt = await asyncio.to_thread(self._stateless_prompt, messages, tools, template)
        return prompt, self.prefixes.index.reach(scope, prompt)[0]

    async def import_prefix(self, scope: str, blob: bytes, prompt: list[int]) -> int:
        """Install another vLLM worker's prefix checkpoint under `scope` if it is a prefix of
        `prompt` (token ids, exactly); returns its tokens. PrefixMismatchError if it is not,
        CorruptStateError if it is unsound, another backend's or another scope's."""
        await self.start()

        def verify() -> vllm_export.HeadParts:
            header, chunks = unpack_export(blob)
            meta, parts = vllm_export.verify_export(header, chunks, self.identity, self.layout)
            prefix = meta.get("prefix")
            if prefix is None:
                raise CorruptStateError("the export is a conversation's head, not a prefix checkpoint")
            if prefix["scope"] != scope_digest(scope):
                raise CorruptStateError("the export is another cache scope's prefix checkpoint")
            if parts.state_len >= len(prompt) or tokens_digest(prompt[:parts.state_len]) != prefix["digest"]:
                raise PrefixMismatchError("the tier's prefix checkpoint is not a prefix of this prompt",
                                          parts.state_len, prefix["digest"])
            return parts

        parts = await asyncio.to_thread(verify)
        return await self.prefixes.install(scope, tuple(prompt[:parts.state_len]), parts)

    def withdrawn_prefixes(self) -> list[PrefixKey]:
        return self.prefixes.index.withdrawn()

    async def kv_cache_usage(self) -> float:
        if not self.host.ready:
            return 0.0
        return float((await self.host.call("stats"))["usage"])

    async def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                       template: TemplateOptions) -> list[int]:
        return await asyncio.to_thread(self.tokenizer.request_ids, prompt, messages, template=template)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await asyncio.to_thread(self.tokenizer.decode_request_ids, token_ids)

    async def max_model_len(self) -> int:
        return (await self.host.start())["max_model_len"]

    async def load(self) -> EngineLoad:
        """Requests in the engine and free KV blocks, for routing stats (the router takes the
        fleet's measured speeds for this backend's); nothing while the engine host starts (Serve
        asks from the replica's start: the first ask begins the host's)."""
        if not self.host.ready:
            self.host.start_soon()
            self.host.check_alive()
            return EngineLoad(0, 0)
        stats = await self.host.call("stats")
        return EngineLoad(stats["running"], stats["free_blocks"])

    # -- turns ------------------------------------------------------------------------------
    async def prepare_grammar(self, params: SamplingParams) -> None:
        """Refuses what this backend does not do, and a constraint that cannot compile (made
        and checked off the loop, cached as on our engine)."""
        backend_params(params, self.vocab_size)
        if params.constraint is not None:
            await asyncio.to_thread(self._check_grammar, params.constraint)

    def _check_grammar(self, constraint) -> None:
        """Compiled (cached), and refused where the reply cannot begin: no first token this model
        may produce and an empty reply not whole (as on our engine: LLMEngine.check_constraint)."""
        self.grammars.prepare(constraint)
        guide = TokenGuide(self.grammars.matcher(constraint), self.vocab_size, None)
        check_constraint_starts(guide, self._banned_ids)

    def stream_turn(self, ref: ConversationRef, suffix: list[dict[str, Any]], params: SamplingParams,
                    request_id: str, tools: list[dict[str, Any]] | None = None,
                    template: TemplateOptions = DEFAULT_TEMPLATE) -> AsyncIterator[RequestOutput]:
        params = backend_params(params, self.vocab_size)
        conv = self.conversations.ledger_for_turn(ref)
        suffix = [plain_message(m, self.tool_format) for m in suffix]
        prompt = build_turn_prompt(self.tokenizer, list(conv.token_ids), conv.messages, suffix, tools,
                                   template).token_ids
        load = self.conversations.begin(conv, request_id)
        # A first turn opening with a system prompt starts from its checkpoint (shared by new chats).
        marks = self._marks(suffix, prompt, tools, template) if load is None and conv.turn == 0 else ()
        system = tuple(m for m in marks if m.source is ReuseSource.SYSTEM)
        return self.streams.turn(conv, suffix, prompt, params, request_id, load, system)

    def _marks(self, messages: list[dict[str, Any]], prompt: list[int], tools: list[dict[str, Any]] | None,
               template: TemplateOptions) -> tuple[CheckpointMark, ...]:
        """The prompt's message boundaries our engine marks (none when nothing is kept here), but
        the end of a first message that is no system prompt: here each boundary not held costs a
        request of its own, and chats sharing a first user message but not what follows are rare."""
        if not self.prefixes.enabled:
            return ()
        marks = message_marks(self.tokenizer, messages, prompt, tools, template.kwargs)
        return tuple(m for m in marks if m.source is ReuseSource.SYSTEM or m.label == len(messages))

    def stream_stateless(self, messages: list[dict[str, Any]], params: SamplingParams, request_id: str,
                         cache_salt: str, tools: list[dict[str, Any]] | None = None,
                         template: TemplateOptions = DEFAULT_TEMPLATE) -> AsyncIterator[RequestOutput]:
        params = backend_params(params, self.vocab_size)
        prompt = self._stateless_prompt(messages, tools, template)
        return self.streams.stateless(len(messages), prompt, self._marks(messages, prompt, tools, template), params,
                                      request_id, cache_salt)

    def _stateless_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template: TemplateOptions) -> list[int]:
        return build_turn_prompt(self.tokenizer, [], [], messages, tools, template).token_ids  # no committed ids

    def stream_completion(self, prompt: str | tuple[int, ...], params: SamplingParams, request_id: str,
                          cache_salt: str) -> AsyncIterator[RequestOutput]:
        params = backend_params(params, self.vocab_size)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        return self.streams.stateless(1, ids, (), params, request_id, cache_salt)  # one pseudo-message

    # Each verdict also drops the ledgers that hold no head here (as the engine session does):
    # ledgers stay those with a head, within head_cache_mb, and those of turns running here.
    async def commit(self, record: TurnCommit) -> HeadInfo:
        keep = self.use.in_use()  # now, before a later turn's recovery adopts a ledger
        try:
            return await self.conversations.commit(record)
        finally:
            self.conversations.drop_headless_ledgers(keep)

    async def abandon(self, record: TurnCommit) -> None:
        keep = self.use.in_use()
        try:
            await self.conversations.abandon(record)
        finally:
            self.conversations.drop_headless_ledgers(keep)

    @property
    def tool_format(self) -> ToolFormat:
        return self._tool_format

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode_exact([token_id])


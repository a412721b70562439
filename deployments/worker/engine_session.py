"""The one place where the worker deployment calls the engine and its conversation cache
(`workers/conversation/API.md`). Engine state is touched only on the engine thread
(`AsyncEngine.call`/`stream`); hashing and (de)serialization of exports run off it.

A turn's commit is two-phase across replicas:

    stream_turn (CommitMode.PREPARE) ... final output carries the TurnCommit
        publish to the cache service (CAS on the head version, fenced by the lease)
        ok       -> commit(record)    the prepared state becomes the head
        refused  -> abandon(record)   the previous head is untouched

Local state is reused only if it is exactly the service's head (version, turn, token digest);
otherwise the worker rebuilds it (tier import or ledger recompute), never trusting a copy that
may lag or lead the service.

The engine's ledgers are a cache of the service's too: after each turn's verdict, a ledger with
no head here and no turn on its way is dropped (the next turn here reads the service's again),
and a conversation idle here for `replica_copy_ttl_s` is forgotten whole (`forget_idle`): a
DELETE that reached another replica leaves this copy for at most that long.

A tier entry is an export cut into parts: its format is stated in
`workers/conversation/export_format.py` (`pack_export`, `unpack_export`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from deployments.worker.turns_here import ConversationUse
from deployments.messages import HeadRef
from deployments.settings import RETAIN_TURNS, AppSettings
from proto.contract import ConversationRef, tokens_digest
from workers.async_engine import AsyncEngine
from workers.conversation import export as head_export
from workers.conversation import prefix_export
from workers.conversation.cache import ConversationCache
from workers.conversation.export_format import pack_export, unpack_export
from workers.conversation.records import CommitMode, HeadInfo, LedgerTurn, TurnCommit
from workers.state_names import PrefixKey
from workers.engine import LLMEngine, RequestOutput
from workers.errors import CorruptStateError, PrefixMismatchError
from workers.load import EngineLoad
from workers.sampling import SamplingParams
from workers.template_options import DEFAULT_TEMPLATE, TemplateOptions
from workers.tokenizer import ChatTokenizer
from workers.tools.formats import ToolFormat


class EngineSession:  # implements Session (session.py)
    use: ConversationUse  # the turns running here, per conversation
    tokenizer: ChatTokenizer
    prefix_tier: bool = True  # its prefix checkpoints go through the state tier (prefix_tier.py)

    def __init__(self, model_dir: str, settings: AppSettings):
        engine = LLMEngine(settings.engine_config(model_dir))
        self.tokenizer = engine.tokenizer
        self.cache = ConversationCache(engine, retain_turns=RETAIN_TURNS)
        self.identity, self.layout = self.cache.export_identity()
        self.aengine = AsyncEngine(engine)
        self.use = ConversationUse()

    def shutdown(self) -> None:
        self.aengine.shutdown()

    def check_health(self) -> None:
        """Raises if the engine can no longer serve (its loop thread died)."""
        self.aengine.check_alive()

    # -- what this engine holds -------------------------------------------------------------
    async def holds(self, ref: ConversationRef, head: HeadRef) -> bool:
        """Whether this engine holds exactly `head`: its ledger at that version and its state."""
        tokens = await self.aengine.call(
            lambda _e: self.cache.idle_head_tokens(ref, head.version, head.turn))
        return tokens is not None and head.is_of(tokens)

    async def forget(self, ref: ConversationRef, deleted: HeadRef | None = None) -> None:
        """Drop the conversation's local ledger and heads; with `deleted` only if the ledger is
        exactly that head (compared off the engine thread, like `holds`), not a re-created
        conversation's. An older local copy of the deleted one stays until evicted or idle for
        replica_copy_ttl_s, and serves only if a re-created conversation's ledger has its very
        tokens (adopt_ledger drops it otherwise), when its state is exact anyway."""

        def ledger(_e) -> tuple[int, int, list[int]] | None:
            state = self.cache.ledger_state(ref)
            return None if state is None else (state.version, state.turn, list(state.token_ids))

        seen = None
        if deleted is not None:
            seen = await self.aengine.call(ledger)
            if seen is None or seen[:2] != (deleted.version, deleted.turn) or not deleted.is_of(seen[2]):
                return

        def drop(_e) -> None:
            now = ledger(_e)
            if now is not None and (seen is None or now == seen):  # unchanged meanwhile
                self.cache.delete(ref)

        await self.aengine.call(drop)

    def turn_started(self, ref: ConversationRef) -> None:
        """A turn of the conversation begins here (before its recovery): its ledger is kept."""
        self.use.started(ref)

    def turn_ended(self, ref: ConversationRef) -> None:
        self.use.ended(ref)

    async def forget_idle(self, ttl_s: float) -> int:
        """Forget (ledger and heads) the conversations unused here for more than `ttl_s`;
        returns how many. One with a turn still awaiting its verdict is kept and counts as used."""
        now, idle = self.use.idle(ttl_s)

        def drop(_e) -> tuple[int, list[ConversationRef]]:
            dropped, busy = 0, []
            for ref in idle:
                state = self.cache.ledger_state(ref)
                if state is not None and state.busy:
                    busy.append(ref)
                elif state is not None:
                    self.cache.delete(ref)
                    dropped += 1
            return dropped, busy

        # Submitted before any later turn's engine call (commands run in order): a turn that
        # starts meanwhile finds the conversation gone and recovers it from the service.
        dropped, busy = await self.aengine.call(drop)
        self.use.forgotten(now, idle, busy)
        return dropped

    async def held_heads(self, ref: ConversationRef | None = None) -> int:
        return await self.aengine.call(lambda _e: self.cache.head_count(ref))

    async def adopt_ledger(self, ref: ConversationRef, head: HeadRef, turns: list[LedgerTurn]) -> None:
        """Take the service's ledger at `head` as this engine's (the next turn recomputes from it)."""
        tokens = [t for turn in turns for t in turn.token_ids]
        if len(turns) != head.turn or not head.is_of(tokens):
            raise CorruptStateError("the ledger does not add up to the conversation's head")
        await self.aengine.call(
            lambda _e: self.cache.adopt_ledger(ref, version=head.version, turns=turns))

    async def import_state(self, ref: ConversationRef, blob: bytes) -> HeadInfo:
        """Install a head exported by another replica; the ledger must be adopted first."""
        held = await self.aengine.call(lambda _e: self.cache.held_chunk_digests())

        def verify() -> head_export.VerifiedHead:
            header, chunks = unpack_export(blob)
            return head_export.verify_export(header, chunks, self.identity, self.layout, held)

        verified = await asyncio.to_thread(verify)

        def install(_e) -> HeadInfo:
            info = self.cache.install_head(ref, verified)
            self.cache.mark_in_tier(ref, verified.meta["version"])  # it came from there
            return info

        return await self.aengine.call(install)

    async def tier_holds(self, ref: ConversationRef, version: int) -> None:
        await self.aengine.call(lambda _e: self.cache.mark_in_tier(ref, version))

    async def export_state(self, ref: ConversationRef) -> tuple[int, list[bytes]]:
        """(head version, tier parts) of the conversation's latest head."""
        snapshot = await self.aengine.call(lambda _e: self.cache.snapshot_head(ref))
        exported = await asyncio.to_thread(head_export.build_export, snapshot)
        await self.aengine.call(lambda _e: self.cache.remember_chunks(snapshot, exported))
        return snapshot.meta["version"], pack_export(exported)

    # -- prefix checkpoints through the tier (prefix_tier.py) --------------------------------------
    async def export_prefix(self, key: PrefixKey) -> list[bytes] | None:
        """Tier parts of the checkpoint named `key`; None if it is no longer held here, or was
        superseded by a longer link of its request chain (the export would be stale at once)."""
        snapshot = await self.aengine.call(lambda e: prefix_export.snapshot_checkpoint(e, key))
        if snapshot is None:
            return None
        exported = await asyncio.to_thread(head_export.build_export, snapshot)
        await self.aengine.call(lambda _e: self.cache.remember_chunks(snapshot, exported))
        return pack_export(exported)

    async def held_prefix(self, scope: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          template: TemplateOptions) -> tuple[list[int], int]:
        """(the prompt's token ids, the tokens of it this engine holds under `scope`): what a
        stateless request of these messages would attach here."""
        prompt = await asyncio.to_thread(self.cache.stateless_prompt, messages, tools, template)
        return prompt, await self.aengine.call(lambda e: prefix_export.held_prefix_length(e, scope, prompt))

    async def import_prefix(self, scope: str, blob: bytes, prompt: list[int]) -> int:
        """Install another replica's prefix checkpoint under `scope` if it is a prefix of
        `prompt` (token ids, exactly); returns its tokens. PrefixMismatchError if it is not,
        CorruptStateError if it is unsound."""
        held = await self.aengine.call(lambda _e: self.cache.held_chunk_digests())

        def verify() -> head_export.VerifiedHead:
            header, chunks = unpack_export(blob)
            verified = head_export.verify_export(header, chunks, self.identity, self.layout, held)
            length = verified.meta["committed_tokens"]
            if length >= len(prompt) or tokens_digest(prompt[:length]) != verified.meta["tokens_digest"]:
                raise PrefixMismatchError("the tier's prefix checkpoint is not a prefix of this prompt", length,
                                          verified.meta["tokens_digest"])
            return verified

        verified = await asyncio.to_thread(verify)
        key = await self.aengine.call(lambda e: prefix_export.install_checkpoint(e, scope, verified))
        return key.length

    async def kv_cache_usage(self) -> float:
        return self.aengine.load.kv_cache_usage  # as load(): no wait for the running step

    def withdrawn_prefixes(self) -> list[PrefixKey]:
        return self.aengine.engine.withdrawn_prefixes()  # thread-safe: no engine-thread call needed

    async def tokenize(self, prompt: str | None, messages: list[dict[str, Any]] | None,
                       template: TemplateOptions) -> list[int]:
        tokenizer = self.aengine.engine.tokenizer  # not the engine thread's work: off it
        return await asyncio.to_thread(tokenizer.request_ids, prompt, messages, template=template)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await asyncio.to_thread(self.aengine.engine.tokenizer.decode_request_ids, token_ids)

    async def max_model_len(self) -> int:
        return self.aengine.engine.max_model_len

    async def load(self) -> EngineLoad:
        """Its queue and measured speeds, for routing stats: as of the engine's last step, without
        waiting for the one running."""
        return self.aengine.load

    # -- turns ------------------------------------------------------------------------------
    async def prepare_grammar(self, params: SamplingParams) -> None:
        """A constrained request's grammar made and checked off the engine thread (a bad schema
        is refused here); cached, so an agent loop's same tools are compiled once."""
        if params.constraint is not None:
            await asyncio.to_thread(self.cache.prepare_grammar, params.constraint)

    def stream_turn(
        self,
        ref: ConversationRef,
        suffix: list[dict[str, Any]],
        params: SamplingParams,
        request_id: str,
        tools: list[dict[str, Any]] | None = None,
        template: TemplateOptions = DEFAULT_TEMPLATE,
    ) -> AsyncIterator[RequestOutput]:
        """The final output's `turn_commit` is the prepared turn (None if it was discarded). A
        stream left before its final output was read leaves nothing prepared: a turn that
        finished as it was left is abandoned at once, not held (and its conversation busy)
        until it expires."""
        start = lambda _e: self.cache.begin_turn(  # noqa: E731
            ref, suffix, params, request_id, commit=CommitMode.PREPARE, tools=tools, template=template)
        return self.aengine.stream(request_id, start, on_left=lambda _e: self._abandon_unowned(request_id))

    def _abandon_unowned(self, request_id: str) -> None:
        """On the engine thread: the turn's stream was left; whatever it prepared, nobody owns."""
        record = self.cache.prepared(request_id)
        if record is not None:
            self.cache.abandon(record)

    def stream_stateless(
        self, messages: list[dict[str, Any]], params: SamplingParams, request_id: str, cache_salt: str,
        tools: list[dict[str, Any]] | None = None, template: TemplateOptions = DEFAULT_TEMPLATE,
    ) -> AsyncIterator[RequestOutput]:
        """A full-history request: it attaches the longest prefix of its prompt held here under
        its salt, checkpoints its message boundaries and its end (the final output's
        `checkpoints`, labelled by the messages they cover, see workers/conversation/boundaries.py)."""

        start = lambda _e: self.cache.begin_stateless(  # noqa: E731
            messages, params, request_id, cache_salt, tools, template)
        return self.aengine.stream(request_id, start)

    def stream_completion(self, prompt: str | tuple[int, ...], params: SamplingParams, request_id: str,
                          cache_salt: str) -> AsyncIterator[RequestOutput]:
        start = lambda _e: self.cache.begin_completion(prompt, params, request_id, cache_salt)  # noqa: E731
        return self.aengine.stream(request_id, start)

    # Each verdict also drops the ledgers that hold no head here: O(ledgers + heads) on the
    # engine thread, and ledgers stay few (those with a head, within the head budget, and those
    # of turns running here or failed since the last verdict).
    async def commit(self, record: TurnCommit) -> HeadInfo:
        keep = self.use.in_use()  # now, before any later turn's engine call is submitted

        def commit(_e) -> HeadInfo:
            try:
                return self.cache.commit(record)
            finally:
                self.cache.drop_headless_ledgers(keep)

        return await self.aengine.call(commit)

    async def abandon(self, record: TurnCommit) -> None:
        keep = self.use.in_use()

        def abandon(_e) -> None:
            try:
                self.cache.abandon(record)
            finally:
                self.cache.drop_headless_ledgers(keep)

        await self.aengine.call(abandon)

    @property
    def tool_format(self) -> ToolFormat:
        """The form this model's chat template writes tool calls in."""
        return self.cache.tool_format

    def token_text(self, token_id: int) -> str:
        return self.cache.token_text(token_id)


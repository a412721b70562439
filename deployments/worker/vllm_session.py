"""The worker's engine session on the vLLM backend: the interface of EngineSession
(engine_session.py), over vLLM's engine in an engine host process (workers/vllm_backend).

Our side keeps what our engine's conversation cache keeps: each conversation's ledger (token
ids are authoritative), its committed head here (the latest turn only) and prepared turns. The
host keeps the state: a head is vLLM's KV blocks and Mamba state pages after the committed
tokens but the last one, loaded into a turn's request by our KV connector and captured at its
end. Two-phase as on our engine:

    stream_turn  prompt = ledger ids + the template's delta of the suffix; the head (if held)
                 is loaded (state_len tokens), the rest runs; the end is captured *prepared*
    commit       the prepared state becomes the conversation's head (the older one is dropped)
    abandon      the prepared state is dropped; the head it continued was never written

A stateless request (the whole chat each time) loads the longest prefix checkpoint of its
prompt and leaves one where it ends, and a system prompt is kept as a checkpoint of its own for
the new chats that open with it (vllm_prefixes.py): as on our engine, a chat resent in full runs
only its new messages, and a shared system prompt is computed once.

What the backend does not do: deterministic mode and constrained decoding (400s; tool_choice
"auto" runs unconstrained, its calls parsed from the text), and checkpoints at a prompt's other
message boundaries. vLLM's own prefix caching stays off: it is block-grained for hybrids and
crashes on CPU.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deployments.worker.turns_here import ConversationUse
from deployments.messages import HeadRef
from deployments.settings import AppSettings
from workers.vllm_backend.prefixes import HostPrefixes, PrefixCheckpoint, detached
from proto.contract import ConversationRef, ModelIdentity, tokens_digest
from workers.conversation.boundaries import system_boundary
from workers.conversation.export_format import pack_export, unpack_export
from workers.config import CacheConfig
from workers.conversation.ledger import ConversationLedger
from workers.conversation.prompt import build_turn_prompt
from workers.conversation.records import HeadInfo, LedgerTurn, TurnCommit
from workers.engine import RequestOutput
from workers.errors import (
    ConversationNotFoundError,
    CorruptStateError,
    EngineShutdownError,
    PromptTooLongError,
    TurnResolvedError,
)
from workers.identity import model_identity
from workers.quantization import WeightQuantization
from workers.request import FinishReason, ReuseSource
from workers.sampling import SamplingParams
from workers.tokenizer import ChatTokenizer
from workers.tools.formats import ToolFormat, plain_message, tool_format_for
from workers.vllm_backend import export as vllm_export
from workers.vllm_backend.engine_host import EngineHost, HostSettings
from workers.vllm_backend.requests import OutputStream, backend_params, vllm_sampling

PREPARED_TURN_TIMEOUT_S = CacheConfig.prepared_turn_timeout_s  # as our engine's: an unresolved turn is abandoned


@dataclass
class HostedHead:
    """A committed head held by the engine host."""

    head_id: str
    turn: int
    version: int
    state_len: int  # = the turn's committed tokens - 1
    tokens_digest: str  # of the committed tokens of `turn`
    nbytes: int


@dataclass
class PreparedTurn:
    record: TurnCommit
    state_len: int
    expiry: asyncio.TimerHandle


class VllmSession:
    def __init__(self, model_dir: str, settings: AppSettings):
        self.model_dir = model_dir
        self.tokenizer = ChatTokenizer(Path(model_dir))
        self.tool_format: ToolFormat = tool_format_for(self.tokenizer.chat_template)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        banned = set(self.tokenizer.never_sample_ids)  # control ids (vLLM may sample only the others)
        self._allowed = [i for i in range(config["vocab_size"]) if i not in banned] if banned else None
        eos = config.get("eos_token_id")
        self.eos_token_ids = frozenset((eos if isinstance(eos, list) else [eos] if eos is not None else [])
                                       + list(self.tokenizer.eos_token_ids()))
        self.host = EngineHost(HostSettings(
            model=model_dir, python=settings.vllm_python, device=settings.device,
            max_model_len=settings.max_model_len, max_num_seqs=settings.max_num_seqs,
            kv_cache_mib=settings.kv_cache_mb, threads=settings.torch_threads,
            stall_timeout_s=settings.engine_stall_timeout_s))
        self.head_budget_bytes = settings.head_cache_mb << 20
        self.identity: ModelIdentity | None = None  # known once the host is up (its torch)
        self.layout: dict[str, Any] = {}
        self.conversations: dict[str, ConversationLedger] = {}
        self.heads: dict[str, HostedHead] = {}  # conversation key -> its head here (LRU order)
        self.prepared: dict[str, PreparedTurn] = {}  # request id -> a turn awaiting its verdict
        self.prefixes = HostPrefixes(self.host, settings.prefix_cache_mb << 20)
        self.use = ConversationUse()
        self._numbers = itertools.count()

    async def start(self) -> None:
        info = await self.host.start()
        if self.identity is None:  # the weights' digest reads every file: off the event loop
            base = await asyncio.to_thread(model_identity, self.model_dir, torch.float32, self.host.settings.device,
                                           WeightQuantization.NONE)
            # vLLM's kernels make the bits: its torch and dtype, not ours.
            self.identity = ModelIdentity(base.weights_digest, base.config_digest, info["dtype"], info["torch"],
                                          base.device_kind)
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
        conv, held = self.conversations.get(ref.key), self.heads.get(ref.key)
        if conv is None or held is None or conv.in_flight is not None:
            return False
        if (conv.version, conv.turn, held.turn) != (head.version, head.turn, head.turn):
            return False
        self._touch(ref.key)
        return head.is_of(conv.token_ids)

    async def forget(self, ref: ConversationRef, deleted: HeadRef | None = None) -> None:
        conv = self.conversations.get(ref.key)
        if conv is None or conv.in_flight is not None:
            return
        if deleted is not None and ((conv.version, conv.turn) != (deleted.version, deleted.turn)
                                    or not deleted.is_of(conv.token_ids)):
            return
        await self._drop_conversation(ref.key)

    def turn_started(self, ref: ConversationRef) -> None:
        self.use.started(ref)

    def turn_ended(self, ref: ConversationRef) -> None:
        self.use.ended(ref)

    async def forget_idle(self, ttl_s: float) -> int:
        now, idle = self.use.idle(ttl_s)
        dropped, busy = 0, []
        for ref in idle:
            conv = self.conversations.get(ref.key)
            if conv is not None and conv.in_flight is not None:
                busy.append(ref)
            elif conv is not None:
                await self._drop_conversation(ref.key)
                dropped += 1
        self.use.forgotten(now, idle, busy)
        return dropped

    async def held_heads(self, ref: ConversationRef | None = None) -> int:
        return len(self.heads) if ref is None else int(ref.key in self.heads)

    async def adopt_ledger(self, ref: ConversationRef, head: HeadRef, turns: list[LedgerTurn]) -> None:
        """Take the service's ledger at `head`; a head held here stays if the ledger still has
        its tokens (the next turn continues it and runs the turns after it)."""
        new = ConversationLedger(ref, version=head.version)
        for turn in turns:
            new.append([dict(m) for m in turn.messages], list(turn.token_ids))
        if len(turns) != head.turn or not head.is_of(new.token_ids):
            raise CorruptStateError("the ledger does not add up to the conversation's head")
        old = self.conversations.get(ref.key)
        if old is not None:
            old.ensure_idle()
        held = self.heads.get(ref.key)
        if held is not None:
            same = held.turn <= new.turn and tokens_digest(new.tokens_until(held.turn)) == held.tokens_digest
            if same:
                held.version = head.version if held.turn == new.turn else held.version
            else:
                await self._drop_head(ref.key)
        self.conversations[ref.key] = new

    async def import_state(self, ref: ConversationRef, blob: bytes) -> HeadInfo:
        """Install a head exported by another vLLM worker; the ledger must be adopted first."""
        await self.start()
        header, chunks = unpack_export(blob)
        meta, parts = await asyncio.to_thread(vllm_export.verify_export, header, chunks, self.identity, self.layout)
        conv = self.conversations.get(ref.key)
        turn = meta["turn"]
        if (conv is None or meta["conversation"] != ref.key or not 1 <= turn <= conv.turn
                or len(conv.tokens_until(turn)) != meta["committed_tokens"]
                or tokens_digest(conv.tokens_until(turn)) != meta["tokens_digest"]):
            raise CorruptStateError("the export is not a head of this conversation's ledger")
        conv.ensure_idle()
        head_id = self._head_id(ref.key, turn)
        nbytes = await self.host.call("install", head=head_id, tokens=parts.state_len, blocks=parts.blocks,
                                      state=parts.state)
        await self._drop_head(ref.key)
        self.heads[ref.key] = HostedHead(head_id, turn, meta["version"], parts.state_len, meta["tokens_digest"], nbytes)
        await self._keep_within_budget()
        return _head_info(conv, turn, parts.state_len)

    async def export_state(self, ref: ConversationRef) -> tuple[int, list[bytes]]:
        """(head version, tier parts) of the conversation's head."""
        await self.start()
        held, conv = self.heads.get(ref.key), self.conversations.get(ref.key)
        if held is None or conv is None or held.turn != conv.turn:  # as our engine: the latest turn's head
            raise ConversationNotFoundError(f"no head of {ref.id!r}'s latest turn here")
        state_len, blocks, state = await self.host.call("export", head=held.head_id)
        committed = conv.tokens_until(held.turn)
        meta = {"conversation": ref.key, "turn": held.turn, "version": held.version,
                "committed_tokens": len(committed), "tokens_digest": tokens_digest(committed)}
        exported = await asyncio.to_thread(vllm_export.build_export, meta, self.identity, self.layout,
                                           vllm_export.HeadParts(state_len, blocks, state))
        return held.version, pack_export(exported)

    async def load(self) -> tuple[int, int]:
        """(requests in the engine, free KV blocks), for routing stats; (0, 0) while the engine
        host starts (Serve asks from the replica's start: the first ask begins the host's)."""
        if not self.host.ready:
            self.host.start_soon()
            self.host.check_alive()
            return 0, 0
        stats = await self.host.call("stats")
        return stats["running"], stats["free_blocks"]

    # -- turns ------------------------------------------------------------------------------
    async def prepare_grammar(self, params: SamplingParams) -> None:
        backend_params(params)  # refuses what this backend does not do

    def stream_turn(self, ref: ConversationRef, suffix: list[dict[str, Any]], params: SamplingParams,
                    request_id: str, tools: list[dict[str, Any]] | None = None) -> AsyncIterator[RequestOutput]:
        params = backend_params(params)
        conv = self.conversations.get(ref.key) or ConversationLedger(ref)
        conv.ensure_idle()
        suffix = [plain_message(m, self.tool_format) for m in suffix]
        prompt = build_turn_prompt(self.tokenizer, list(conv.token_ids), conv.messages, suffix, tools).token_ids
        held = self.heads.get(ref.key)
        load = (held.head_id, held.state_len) if held is not None and held.turn <= conv.turn else None
        # A first turn opening with a system prompt starts from its checkpoint (shared by new chats).
        system_end = self._system_end(suffix, prompt, tools) if load is None and conv.turn == 0 else 0
        self.conversations[ref.key] = conv
        conv.in_flight = request_id
        return self._turn(conv, suffix, prompt, params, request_id, load, system_end)

    async def _turn(self, conv: ConversationLedger, suffix: list[dict[str, Any]], prompt: list[int],
                    params: SamplingParams, request_id: str, load: tuple[str, int] | None, system_end: int
                    ) -> AsyncIterator[RequestOutput]:
        prepared, base = False, None
        try:
            await self._check_length(prompt)
            if system_end:
                base = await self.prefixes.attach(conv.ref.salt, prompt, system_end)
                load = (base.head_id, len(base.tokens)) if base is not None else None
            outputs = OutputStream(request_id, self.tokenizer, params, len(prompt))
            async for frame in self.host.stream(request_id, prompt, vllm_sampling(params, self._allowed), load,
                                                capture=True):
                record, checkpoints = None, ()
                if frame["finished"] and frame["prepared"] is not None:
                    try:
                        record = self._prepare(conv, suffix, prompt, outputs, frame, request_id)
                    except BaseException:
                        await self.host.call("abandon", id=request_id)
                        raise
                    prepared = True
                    checkpoints = self.prefixes.system_checkpoint(conv.ref.salt, prompt, system_end)
                yield outputs.output(frame, record, reused=base.source if base else ReuseSource.HEAD,
                                     checkpoints=checkpoints)
        finally:
            self.prefixes.release(base)
            if not prepared:
                self._end_turn(conv)

    def _system_end(self, messages: list[dict[str, Any]], prompt: list[int],
                    tools: list[dict[str, Any]] | None) -> int:
        """Where the prompt's system message ends (0: it opens with none, or none is kept here)."""
        return system_boundary(self.tokenizer, messages, prompt, tools) if self.prefixes.enabled else 0

    async def _check_length(self, prompt: list[int]) -> None:
        """As our engine: a prompt must leave room for one token (vLLM would refuse it)."""
        limit = (await self.host.start())["max_model_len"]
        if len(prompt) >= limit:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens; this model takes at most {limit - 1}")

    def _prepare(self, conv: ConversationLedger, suffix: list[dict[str, Any]], prompt: list[int],
                 outputs: OutputStream, frame: dict[str, Any], request_id: str) -> TurnCommit:
        output = outputs.output_ids + list(frame["tokens"])
        reason = FinishReason.STOP if frame["reason"] == "stop" else FinishReason.LENGTH
        reply_ids = output[:-1] if reason is FinishReason.STOP and output and output[-1] in self.eos_token_ids else output
        committed = prompt + output
        if frame["prepared"] != len(committed) - 1:  # the state must cover all committed tokens but the last
            raise CorruptStateError(f"captured {frame['prepared']} tokens of state for {len(committed)} committed")
        start = len(conv.token_ids)
        record = TurnCommit(
            request_id=request_id, conversation=conv.ref, base_version=conv.version, base_turn=conv.turn,
            start=start, token_ids=tuple(committed[start:]),
            messages=(*suffix, {"role": "assistant", "content": self.tokenizer.decode_exact(reply_ids)}),
            committed_tokens=len(committed), tokens_digest=tokens_digest(committed), state_len=frame["prepared"],
            finish_reason=reason)
        expiry = asyncio.get_running_loop().call_later(
            PREPARED_TURN_TIMEOUT_S, lambda: asyncio.ensure_future(self._expire(record)))
        self.prepared[request_id] = PreparedTurn(record, frame["prepared"], expiry)
        return record

    def stream_stateless(self, messages: list[dict[str, Any]], params: SamplingParams, request_id: str,
                         cache_salt: str, tools: list[dict[str, Any]] | None = None) -> AsyncIterator[RequestOutput]:
        params = backend_params(params)
        prompt = self.tokenizer.encode(self.tokenizer.render_chat(messages, add_generation_prompt=True, tools=tools))
        return self._stateless(len(messages), prompt, self._system_end(messages, prompt, tools), params,
                               request_id, cache_salt)

    async def _stateless(self, num_messages: int, prompt: list[int], system_end: int, params: SamplingParams,
                         request_id: str, salt: str) -> AsyncIterator[RequestOutput]:
        await self._check_length(prompt)
        base: PrefixCheckpoint | None = await self.prefixes.attach(salt, prompt, system_end)
        try:
            outputs = OutputStream(request_id, self.tokenizer, params, len(prompt))
            async for frame in self.host.stream(request_id, prompt, vllm_sampling(params, self._allowed),
                                                (base.head_id, len(base.tokens)) if base else None,
                                                capture=self.prefixes.fits(len(prompt) + params.max_tokens)):
                checkpoints = ()
                if frame["finished"] and frame.get("prepared") is not None:
                    # Kept before the last output goes out (the client's next request may follow at
                    # once), and kept whole even if this stream is cancelled meanwhile.
                    tokens = await asyncio.shield(detached(self.prefixes.keep(
                        salt, prompt + outputs.output_ids + list(frame["tokens"]), frame["prepared"], request_id)))
                    checkpoints = self.prefixes.system_checkpoint(salt, prompt, system_end)
                    if tokens:
                        checkpoints += ((num_messages + 1, tokens),)  # the messages and the reply
                yield outputs.output(frame, reused=base.source if base else ReuseSource.PREFIX,
                                     checkpoints=checkpoints)
        finally:
            self.prefixes.release(base)

    async def commit(self, record: TurnCommit) -> HeadInfo:
        entry = self._take(record, "commit")
        conv = self.conversations[record.conversation.key]
        turn = record.base_turn + 1
        head_id = self._head_id(conv.key, turn)
        try:
            nbytes = await self.host.call("commit", id=record.request_id, head=head_id)
        except ValueError as e:
            self._end_turn(conv)
            raise TurnResolvedError(f"cannot commit turn {record.request_id!r}: {e}") from e
        except BaseException:  # the host died: the turn's state is gone with it
            self._end_turn(conv)
            raise
        await self._drop_head(conv.key)
        conv.truncate(record.base_turn)
        conv.append([dict(m) for m in record.messages], list(record.token_ids))
        conv.version = record.base_version + 1
        self.heads[conv.key] = HostedHead(head_id, turn, conv.version, entry.state_len, record.tokens_digest, nbytes)
        self._end_turn(conv)
        await self._keep_within_budget()
        return _head_info(conv, turn, entry.state_len)

    async def abandon(self, record: TurnCommit) -> None:
        self._take(record, "abandon")
        try:
            await self.host.call("abandon", id=record.request_id)
        finally:
            self._end_turn(self.conversations[record.conversation.key])

    async def _expire(self, record: TurnCommit) -> None:
        if self.prepared.get(record.request_id, None) is not None:
            try:
                await self.abandon(record)
            except (TurnResolvedError, EngineShutdownError):
                pass

    def _take(self, record: TurnCommit, how: str) -> PreparedTurn:
        entry = self.prepared.get(record.request_id)
        if entry is None or entry.record != record:
            raise TurnResolvedError(f"cannot {how} turn {record.request_id!r}: not a prepared turn here")
        del self.prepared[record.request_id]
        entry.expiry.cancel()
        return entry

    def _end_turn(self, conv: ConversationLedger) -> None:
        conv.in_flight = None
        if conv.turn == 0 and conv.key not in self.heads:
            self.conversations.pop(conv.key, None)  # a first turn that never committed leaves nothing

    # -- heads --------------------------------------------------------------------------------
    def _head_id(self, key: str, turn: int) -> str:
        return f"{key}/{turn}/{next(self._numbers)}"

    def _touch(self, key: str) -> None:
        self.heads[key] = self.heads.pop(key)  # most recently used last

    async def _drop_head(self, key: str) -> None:
        held = self.heads.pop(key, None)
        if held is not None:
            await self.host.call("drop", heads=[held.head_id])

    async def _drop_conversation(self, key: str) -> None:
        await self._drop_head(key)
        self.conversations.pop(key, None)

    async def _keep_within_budget(self) -> None:
        """Least recently used heads of idle conversations go beyond head_cache_mb."""
        used = sum(h.nbytes for h in self.heads.values())
        victims = []
        for key in list(self.heads):  # chosen and taken at once: another call may run at the await
            if used <= self.head_budget_bytes:
                break
            conv = self.conversations.get(key)
            if conv is None or conv.in_flight is None:
                used -= self.heads[key].nbytes
                victims.append(self.heads.pop(key).head_id)
        if victims:
            await self.host.call("drop", heads=victims)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode_exact([token_id])


def _head_info(conv: ConversationLedger, turn: int, state_len: int) -> HeadInfo:
    committed = conv.tokens_until(turn)
    return HeadInfo(conv.key, turn, conv.version, len(committed), tokens_digest(committed), state_len, state_len)


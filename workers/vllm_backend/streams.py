"""A vLLM backend request as our engine's outputs: a conversation's turn (its head loaded, its end
captured prepared for the two-phase commit, conversations.py) or a stateless request (the longest
prefix checkpoint loaded, its message boundaries and its end kept as ones, prefixes.py), streamed
from the engine host."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from workers.conversation.ledger import ConversationLedger
from workers.engine import RequestOutput
from workers.errors import PromptTooLongError
from workers.request import CheckpointMark, ReuseSource
from workers.sampling import SamplingParams
from workers.tokenizer import ChatTokenizer
from workers.tools.formats import ToolFormat
from workers.vllm_backend.conversations import HostedConversations
from workers.vllm_backend.engine_host import EngineHost
from workers.vllm_backend.prefixes import HostPrefixes, PrefixCheckpoint, detached
from workers.vllm_backend.requests import OutputStream, vllm_sampling


class HostStreams:
    def __init__(self, host: EngineHost, tokenizer: ChatTokenizer, allowed_ids: list[int] | None,
                 tool_format: ToolFormat, conversations: HostedConversations, prefixes: HostPrefixes):
        self.host = host
        self.tokenizer = tokenizer
        self.allowed_ids = allowed_ids
        self.tool_format = tool_format
        self.conversations = conversations
        self.prefixes = prefixes

    async def turn(self, conv: ConversationLedger, suffix: list[dict[str, Any]], prompt: list[int],
                   params: SamplingParams, request_id: str, load: tuple[str, int] | None,
                   marks: tuple[CheckpointMark, ...]) -> AsyncIterator[RequestOutput]:
        """marks: where a first turn may start from a checkpoint (its system prompt's), or ()."""
        prepared, base = False, None
        try:
            params = await self.fit(prompt, params)
            if marks:
                base = await self.prefixes.attach(conv.ref.salt, prompt, marks)
                load = (base.head_id, len(base.tokens)) if base is not None else None
            outputs = OutputStream(request_id, self.tokenizer, params, len(prompt), self.conversations.eos_token_ids)
            async for frame in self.host.stream(request_id, prompt, vllm_sampling(params, self.allowed_ids, self.tool_format), load,
                                                capture=True):
                record, checkpoints, keys = None, (), ()
                if frame["finished"] and frame["prepared"] is not None:
                    try:
                        record = self.conversations.prepare(conv, suffix, prompt,
                                                            outputs.output_ids + list(frame["tokens"]), frame,
                                                            request_id)
                    except BaseException:
                        await self.host.call("abandon", id=request_id)
                        raise
                    prepared = True
                    checkpoints, keys = self.prefixes.held_marks(conv.ref.salt, prompt, marks)
                yield outputs.output(frame, record, reused=base.source if base else ReuseSource.HEAD,
                                     checkpoints=checkpoints, checkpoint_keys=keys)
        finally:
            self.prefixes.release(base)
            if not prepared:
                self.conversations.end_turn(conv)

    async def fit(self, prompt: list[int], params: SamplingParams) -> SamplingParams:
        """As our engine: a prompt must leave room for one token (vLLM would refuse it), and the
        reply ends where the context does (max_tokens clamped to what it leaves, never refused)."""
        limit = (await self.host.start())["max_model_len"]
        if len(prompt) >= limit:
            raise PromptTooLongError(f"the prompt has {len(prompt)} tokens; this model takes at most {limit - 1}")
        if len(prompt) + params.max_tokens > limit:
            room = limit - len(prompt)
            return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        return params

    async def stateless(self, num_messages: int, prompt: list[int], marks: tuple[CheckpointMark, ...],
                        params: SamplingParams, request_id: str, salt: str) -> AsyncIterator[RequestOutput]:
        """marks: the prompt's message boundaries (boundaries.message_marks), labelled as our
        engine labels them; the end is labelled num_messages + 1 (the messages and the reply)."""
        params = await self.fit(prompt, params)
        base: PrefixCheckpoint | None = await self.prefixes.attach(salt, prompt, marks)
        try:
            outputs = OutputStream(request_id, self.tokenizer, params, len(prompt), self.conversations.eos_token_ids)
            async for frame in self.host.stream(request_id, prompt, vllm_sampling(params, self.allowed_ids, self.tool_format),
                                                (base.head_id, len(base.tokens)) if base else None,
                                                capture=self.prefixes.fits(len(prompt) + params.max_tokens)):
                checkpoints, keys = (), ()
                if frame["finished"] and frame.get("prepared") is not None:
                    # Kept before the last output goes out (the client's next request may follow at
                    # once), and kept whole even if this stream is cancelled meanwhile.
                    kept = await asyncio.shield(detached(self.prefixes.keep(
                        salt, prompt + outputs.output_ids + list(frame["tokens"]), frame["prepared"], request_id,
                        end=True)))
                    checkpoints, keys = self.prefixes.held_marks(salt, prompt, marks)
                    if kept is not None:
                        checkpoints += ((num_messages + 1, len(kept.tokens)),)  # the messages and the reply
                        keys += (kept.key,)
                        if base is not None and base.end:
                            base.superseded = True  # the chain goes on from this longer link
                yield outputs.output(frame, reused=base.source if base else ReuseSource.PREFIX,
                                     checkpoints=checkpoints, checkpoint_keys=keys)
        finally:
            self.prefixes.release(base)

"""Prefix checkpoints on the vLLM backend, kept in the engine host, at the places our engine
keeps them (workers/conversation/boundaries.py): where a stateless request ended, so the same
chat resent in full with one more message (what an ordinary OpenAI client does every turn) runs
only what is new; and at its message boundaries, the end of a system prompt (new chats opening
with it, stateless or a conversation's first turn, do not compute it again) and the end of its
last message (the whole history before the generation prompt: the next request of a client that
renders the reply otherwise, e.g. without its reasoning, still shares it).

    attach     the longest checkpoint under the request's salt whose tokens begin its prompt
               (exact token ids: a history rendered otherwise misses, it never misleads),
               pinned until the request ends so no budget drops what a request loads
    prime      a boundary PRIME_MIN_TOKENS or more beyond the longest checkpoint the request
               would load (so not held yet) is computed first, by a one-token request of its own
               loading that checkpoint, and kept (vLLM computes a prompt in one go: there is no
               state inside one); concurrent requests sharing it wait for the same one. The last
               message's end only where the request loads no earlier request's end: a client
               resending the chat as it got it never loads it, and would pay a prime a turn
    keep       a finished stateless request's captured state, its prompt and reply but the last
               token (what vLLM computed), becomes a checkpoint

    export   a checkpoint's state (its host head) goes to the state tier as a prefix export
             (export.py), named as our engine names one (PrefixKey: salt, length, token digest);
             one a longer link of its request chain superseded is not sent
    install  another worker's export of a prefix of a request's prompt becomes a checkpoint here

A prime costs one more request before the real one (an engine step, a round trip to the host
and a copy of the state in and out), never more computed tokens: the real request loads what
the prime computed. prefix_cache_mb holds the checkpoints, least recently used dropped first; a
state that could not fit in it (the host's layout says how big it is) is neither captured nor
primed.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from proto.contract import tokens_digest
from workers.errors import CorruptStateError, OutOfCacheError
from workers.request import CheckpointMark, ReuseSource
from workers.state_names import PrefixKey
from workers.sampling import SamplingParams
from workers.vllm_backend.engine_host import EngineHost
from workers.vllm_backend.export import HeadParts
from workers.vllm_backend.lru_budget import LruBudget
from workers.vllm_backend.host.hybridserve_vllm.heads import LayerLayout, block_count
from workers.vllm_backend.requests import vllm_sampling

log = logging.getLogger("hybridserve.vllm")

# A boundary closer than this to what the request loads anyway is computed with the rest of the
# prompt: priming it would cost an extra request (an engine step and a round trip to the host)
# to save a later request a few dozen tokens.
PRIME_MIN_TOKENS = 32
_PRIME = vllm_sampling(SamplingParams(temperature=0.0, max_tokens=1), None)  # one token: vLLM computes the prompt


@dataclass
class PrefixCheckpoint:
    head_id: str  # the engine host's head
    salt: str
    tokens: tuple[int, ...]  # the tokens its state covers
    nbytes: int
    source: ReuseSource = ReuseSource.PREFIX  # SYSTEM: a system prompt's
    loads: int = 0  # requests loading it now: never dropped meanwhile
    end: bool = False  # where a request ended (prompt + reply), not a message boundary it primed
    superseded: bool = False  # an end a longer link of its request chain (the next step) replaced
    key: PrefixKey = field(init=False)  # its name, as our engine names a checkpoint (announced, exported)

    def __post_init__(self):
        self.key = PrefixKey(self.salt, len(self.tokens), tokens_digest(self.tokens))


# Names of checkpoints dropped since the worker last asked (their announces are withdrawn); a
# name past this many is left to expire with the prefix index's TTL.
WITHDRAWN_KEPT = 4096


class PrefixCheckpoints:
    """The checkpoints' index on the worker's side (the host holds their state)."""

    def __init__(self, budget_bytes: int):
        self._held: LruBudget[str, PrefixCheckpoint] = LruBudget(  # by head id
            budget_bytes, lambda c: c.nbytes, lambda _, c: c.loads > 0)
        self._withdrawn: deque[PrefixKey] = deque(maxlen=WITHDRAWN_KEPT)

    @property
    def budget_bytes(self) -> int:
        return self._held.budget_bytes

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self):
        return iter(self._held)

    @property
    def nbytes(self) -> int:
        return self._held.nbytes

    def longest(self, salt: str, prompt: Sequence[int]) -> PrefixCheckpoint | None:
        """The longest checkpoint of `salt` that is a proper prefix of `prompt`, pinned (release it)."""
        best = self._longest(salt, tuple(prompt))
        if best is not None:
            best.loads += 1
            self._held.touch(best.head_id)
        return best

    def reach(self, salt: str, prompt: Sequence[int]) -> tuple[int, bool]:
        """How many tokens of `prompt` its longest checkpoint covers (what `longest` would load),
        and whether that one is where a request ended."""
        best = self._longest(salt, tuple(prompt))
        return (len(best.tokens), best.end) if best is not None else (0, False)

    def _longest(self, salt: str, prompt: tuple[int, ...]) -> PrefixCheckpoint | None:
        best = None
        for c in self._held:
            n = len(c.tokens)
            if c.salt == salt and n < len(prompt) and (best is None or n > len(best.tokens)) and prompt[:n] == c.tokens:
                best = c
        return best

    def release(self, checkpoint: PrefixCheckpoint) -> None:
        checkpoint.loads -= 1

    def pinned(self, key: PrefixKey) -> PrefixCheckpoint | None:
        """The checkpoint named `key`, pinned (release it), or None if none is held."""
        for c in self._held:
            if c.key == key:
                c.loads += 1
                return c
        return None

    def withdrawn(self) -> list[PrefixKey]:
        """The names of checkpoints dropped since the last call (each once)."""
        names = list(self._withdrawn)
        self._withdrawn.clear()
        return names

    def holds(self, salt: str, tokens: Sequence[int]) -> bool:
        return self.held(salt, tokens) is not None

    def held(self, salt: str, tokens: Sequence[int]) -> PrefixCheckpoint | None:
        """The checkpoint of exactly `tokens` under `salt`, if held (not pinned)."""
        tokens = tuple(tokens)
        return next((c for c in self._held if c.salt == salt and c.tokens == tokens), None)

    def keep(self, checkpoint: PrefixCheckpoint) -> list[str]:
        """Hold a new checkpoint; returns the head ids to drop in the host (one of the same
        tokens it replaces, and those beyond the budget; itself if it alone is beyond it)."""
        if checkpoint.nbytes > self.budget_bytes:
            return [checkpoint.head_id]
        dropped = [c.head_id for c in self._held
                   if c.salt == checkpoint.salt and c.tokens == checkpoint.tokens and not c.loads]
        for head_id in dropped:
            self._held.pop(head_id)
        self._held.put(checkpoint.head_id, checkpoint)
        over = self._held.over_budget()
        self._withdrawn.extend(c.key for c in over if c.key != checkpoint.key)
        return dropped + [c.head_id for c in over]


class HostPrefixes:
    """Prefix checkpoints for one engine host: their index here, their state there."""

    def __init__(self, host: EngineHost, budget_bytes: int):
        self.host = host
        self.index = PrefixCheckpoints(budget_bytes)
        self._priming: dict[tuple[str, tuple[int, ...]], asyncio.Future] = {}
        self._numbers = itertools.count()
        self.prime_min_tokens = PRIME_MIN_TOKENS
        self.layout: dict[str, Any] = {}  # the host's (export.host_layout), once it is up

    @property
    def enabled(self) -> bool:
        return self.index.budget_bytes > 0

    def fits(self, tokens: int) -> bool:
        """Whether a state of `tokens` tokens fits the budget (its KV blocks and Mamba pages)."""
        return self.enabled and bool(self.layout) and state_bytes(self.layout, tokens) <= self.index.budget_bytes

    async def attach(self, salt: str, prompt: Sequence[int], marks: Sequence[CheckpointMark]
                     ) -> PrefixCheckpoint | None:
        """The checkpoint the request loads, pinned (release it when the request ends), or None.
        marks: the prompt's message boundaries (boundaries.message_marks); each one
        prime_min_tokens beyond what the request would load is computed first and kept."""
        if not self.enabled:
            return None
        reach, loads_an_end = self.index.reach(salt, prompt)
        for mark in sorted(marks, key=lambda m: m.position):
            # A request that loads an earlier request's end is a client resending its history as
            # it got it: its next request will load this one's end too, and a last-message mark
            # would cost a request per turn and a second copy of the state for nothing. Primed
            # for new chats and for clients that render the history otherwise (the end missed).
            if mark.source is not ReuseSource.SYSTEM and loads_an_end:
                continue
            if mark.position - reach >= self.prime_min_tokens and self.fits(mark.position):
                await self._prime(salt, tuple(prompt[:mark.position]), mark.source)
                reach, loads_an_end = self.index.reach(salt, prompt)  # the mark's, unless its prime failed or did not fit
        return self.index.longest(salt, prompt)

    def release(self, checkpoint: PrefixCheckpoint | None) -> None:
        if checkpoint is not None:
            self.index.release(checkpoint)

    def held_marks(self, salt: str, prompt: Sequence[int], marks: Sequence[CheckpointMark]
                   ) -> tuple[tuple[tuple[int, int], ...], tuple[PrefixKey, ...]]:
        """The request's marks held here, as RequestOutput.checkpoints ((label, tokens): the
        first `label` messages) for the prefix index (chats sharing them are routed here), and
        their names (RequestOutput.checkpoint_keys: what the worker may export)."""
        held = [(m, c) for m in sorted(marks, key=lambda m: m.position)
                if (c := self.index.held(salt, prompt[:m.position])) is not None]
        return tuple((m.label, m.position) for m, _ in held), tuple(c.key for _, c in held)

    async def _prime(self, salt: str, tokens: tuple[int, ...], source: ReuseSource) -> None:
        key = (salt, tokens)
        priming = self._priming.get(key)
        if priming is None:
            priming = self._priming[key] = detached(self._compute(salt, tokens, source))
            priming.add_done_callback(lambda _: self._priming.pop(key, None))
        await asyncio.shield(priming)  # a request cancelled meanwhile leaves it to the others

    async def _compute(self, salt: str, tokens: tuple[int, ...], source: ReuseSource) -> None:
        """`tokens` computed (loading their longest checkpoint) and kept as a checkpoint."""
        request_id = f"prime/{next(self._numbers)}"
        base, last = self.index.longest(salt, tokens), None
        try:
            async for frame in self.host.stream(request_id, list(tokens), _PRIME,
                                                (base.head_id, len(base.tokens)) if base else None, capture=True):
                last = frame
        finally:
            self.release(base)
        if last is not None and last.get("error"):  # vLLM refused it: the request computes it itself
            log.warning("priming a prefix of %d tokens failed: %s", len(tokens), last["error"])
        elif last is not None and last.get("prepared") is not None:
            await self.keep(salt, [*tokens, *last["tokens"]], last["prepared"], request_id, source)

    async def keep(self, salt: str, tokens: list[int], captured: int, request_id: str,
                   source: ReuseSource = ReuseSource.PREFIX, end: bool = False) -> PrefixCheckpoint | None:
        """A finished request's captured state (of `tokens`, its prompt and output) as a
        checkpoint; returns it (None: not kept)."""
        if captured != len(tokens) - 1:  # the state must cover all the tokens but the last
            await self.host.call("abandon", id=request_id)
            return None
        head_id = f"prefix/{next(self._numbers)}"
        try:
            nbytes = await self.host.call("commit", id=request_id, head=head_id)
        except ValueError:  # not prepared there after all: nothing to keep
            return None
        return await self._hold(PrefixCheckpoint(head_id, salt, tuple(tokens[:captured]), nbytes, source, end=end))

    async def _hold(self, checkpoint: PrefixCheckpoint) -> PrefixCheckpoint | None:
        """`checkpoint` (its state in the host) in the index; None if the budget dropped it."""
        dropped = self.index.keep(checkpoint)
        if dropped:
            await self.host.call("drop", heads=dropped)
        return None if checkpoint.head_id in dropped else checkpoint

    async def export(self, key: PrefixKey) -> HeadParts | None:
        """The state of the checkpoint named `key`; None if it is no longer held here or a
        longer link of its request chain superseded it (the export would be stale at once)."""
        checkpoint = self.index.pinned(key)
        if checkpoint is None:
            return None
        try:
            if checkpoint.superseded:
                return None
            state_len, blocks, state = await self.host.export_head(checkpoint.head_id)
        finally:
            self.release(checkpoint)
        return HeadParts(state_len, blocks, state)

    async def install(self, salt: str, tokens: tuple[int, ...], parts: HeadParts) -> int:
        """Another worker's checkpoint of `tokens` (verified: export.verify_export) held here
        under `salt`; returns its tokens. OutOfCacheError if it cannot fit the budget (nothing
        changes), CorruptStateError if the host refuses its bytes."""
        if self.index.holds(salt, tokens):
            return len(tokens)
        if not self.fits(len(tokens)):
            raise OutOfCacheError(f"a prefix checkpoint of {len(tokens)} tokens does not fit prefix_cache_mb")
        head_id = f"prefix/{next(self._numbers)}"
        try:
            nbytes = await self.host.call("install", head=head_id, tokens=parts.state_len, blocks=parts.blocks,
                                          state=parts.state)
        except ValueError as e:
            raise CorruptStateError(f"the engine host refused the prefix checkpoint: {e}") from e
        if await self._hold(PrefixCheckpoint(head_id, salt, tokens, nbytes)) is None:
            raise OutOfCacheError("the prefix checkpoints' budget is held by checkpoints in use")
        return len(tokens)


def detached(work) -> asyncio.Task:
    """`work` as a task that runs to its end even if all its waiters are cancelled (await it
    through asyncio.shield); its failure, if nobody is left to see it, is not logged as lost."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def state_bytes(layout: dict[str, Any], tokens: int) -> int:
    """The bytes of a head of `tokens` tokens in the host (its HeadStore's): a block per
    attention layer per block of tokens, and every Mamba layer's state page."""
    def total(key: str) -> int:
        return sum(LayerLayout.from_dict(layer).nbytes for layer in layout[key])

    return block_count(tokens, layout["block_size"]) * total("attention") + total("mamba")

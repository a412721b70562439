"""Prefix checkpoints through the state tier: what one replica computed, another imports.

    export   after a stateless request or a first turn, each checkpoint it made of at least
             prefix_export_min_tokens (a tenant's system prompt and tool catalogue, an agent loop
             step's end), named as announced (scope + prefix name), waits tier_export_delay_s and
             goes to the tier (put_prefix_state) if the engine still holds it and no longer link of
             its chain superseded it; one export at a time, each name once (the tier stores a
             scope's chunks once: a chain's next link sends only its new blocks and state)
    import   a stateless request whose TurnJob names the tier as holding a longer prefix of its
             messages than this engine holds, by at least IMPORT_MIN_TOKENS: fetched, checked
             against the prompt's own token ids and installed as a checkpoint before the request
             is queued (it then attaches it as any checkpoint), when importing it is cheaper than
             computing the tokens it adds at this replica's measured speeds

The router prices the same choice (routing/cost.py): a replica that does not hold a prefix the
tier has costs the import of it, not its prefill, when that is cheaper. Both are hints over a
cache: a failed export is logged and counted, a failed import computes the prefix, neither fails
the request. Deterministic requests neither import nor attach (no checkpoint is canonical).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from cache_service.client import CacheClient, CacheError
from deployments.routing.cost import DEFAULT_IMPORT_SPEEDUP  # until measured: the router's assumption
from deployments.routing.prefix_hints import FailureLog
from deployments.settings import AppSettings, TierExport
from deployments.worker.session import Session
from proto.contract import tokens_digest
from workers.errors import CorruptStateError, EngineShutdownError, OutOfCacheError, PrefixMismatchError
from workers.load import Rate
from workers.state_names import PrefixKey
from workers.template_options import TemplateOptions

log = logging.getLogger("hybridserve.worker")

# A shorter gain is computed rather than fetched: a round trip to the tier and an install cost
# about what a few dozen tokens of prefill do.
IMPORT_MIN_TOKENS = 64
# Checkpoints waiting for their export at most (the oldest dropped: the tier is a cache), and
# names this replica remembers having exported or imported: not sent again for SENT_FOR_S (the
# tier lets an entry go after the prefix TTL, 30 min, unread, or sooner past its byte bound; a
# name still hot here goes again after this long), nor after an import found it gone.
PENDING_KEPT = 256
NAMES_KEPT = 16384
SENT_FOR_S = 600.0
# An import may take at most this many times the prefill it saves (at least IMPORT_DEADLINE_MIN_S):
# a slow or stalled tier must not hold a request longer than computing the prefix would.
IMPORT_DEADLINE_FACTOR = 2.0
IMPORT_DEADLINE_MIN_S = 1.0


class PrefixTier:
    def __init__(self, session: Session, settings: AppSettings, cache: Callable[[], Awaitable[CacheClient]],
                 spawn: Callable[[Coroutine], None], import_rate: Rate):
        self.session, self.settings, self._cache, self._spawn = session, settings, cache, spawn
        self.import_rate = import_rate  # head and prefix imports alike: tokens installed per second
        self.on = settings.tier_export is not TierExport.OFF and session.prefix_tier
        self._pending: OrderedDict[tuple[str, str], tuple[PrefixKey, int, float]] = OrderedDict()
        self._done: OrderedDict[tuple[str, str], float] = OrderedDict()  # (scope, name) -> when sent or fetched
        # (scope, name) -> (tokens, digest) of a tier entry that was no prefix of the prompt it was
        # fetched for (another rendering of the same messages: other chat_template_kwargs): a
        # prompt that does not begin with those tokens skips the fetch
        self._mismatched: OrderedDict[tuple[str, str], tuple[int, str, float]] = OrderedDict()
        self._exporting = False
        self.failures = FailureLog("prefix tier")
        self.counters = {"exports": 0, "export_skips": 0, "imports": 0, "import_misses": 0}

    # -- export --------------------------------------------------------------------------------
    def offer(self, scope: str, keyed: Sequence[tuple[str, int, PrefixKey]]) -> None:
        """A request made these checkpoints: (index name, tokens, engine name) each (as announced,
        routing/prefix_hints.py `keyed`). Those long enough are exported once quiet."""
        if not self.on:
            return
        due = time.monotonic() + self.settings.tier_export_delay_s
        for name, tokens, key in keyed:
            if tokens < self.settings.prefix_export_min_tokens or self._sent_lately(scope, name):
                continue
            self._pending[scope, name] = (key, tokens, due)
            self._pending.move_to_end((scope, name))
        while len(self._pending) > PENDING_KEPT:
            self._pending.popitem(last=False)
        if self._pending and not self._exporting:
            self._exporting = True
            self._spawn(self._export_pending())

    async def _export_pending(self) -> None:
        try:
            while self._pending:
                (scope, name), (key, tokens, due) = next(iter(self._pending.items()))
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    continue  # the queue may have changed meanwhile
                del self._pending[scope, name]
                await self._export(scope, name, key, tokens)
        finally:
            self._exporting = False

    async def _export(self, scope: str, name: str, key: PrefixKey, tokens: int) -> None:
        try:
            parts = await self.session.export_prefix(key)
            if parts is None:  # evicted or superseded meanwhile
                self.counters["export_skips"] += 1
                return
            await (await self._cache()).put_prefix_state(scope, name, tokens, parts)
            self.counters["exports"] += 1
            self._remember(scope, name)
        except (CacheError, OutOfCacheError) as e:
            self.failures.failed(e)
        except EngineShutdownError:
            raise
        except Exception as e:  # a defect here must not end the exports queued behind it unseen
            log.exception("exporting prefix %s", name)
            self.failures.failed(e)

    # -- import --------------------------------------------------------------------------------
    async def import_for(self, scope: str, engine_scope: str, messages: list[dict[str, Any]],
                         tools: list[dict[str, Any]] | None, template: TemplateOptions,
                         tier_prefix: tuple[str, int] | None) -> bool:
        """Install the tier's prefix of this request's messages when that beats computing it
        here; True if it did (the request then attaches it). `scope`: the index's (tools
        included), `engine_scope`: the engine's (the request's salt)."""
        if not self.on or tier_prefix is None:
            return False
        name, tokens = tier_prefix
        prompt, held = await self.session.held_prefix(engine_scope, messages, tools, template)
        gain = min(tokens, len(prompt) - 1) - held
        speed = (await self.session.load()).prefill_tokens_per_s
        if gain < IMPORT_MIN_TOKENS or not self._cheaper(tokens, gain, speed) or self._mismatches(scope, name, prompt):
            return False
        deadline = max(IMPORT_DEADLINE_MIN_S, IMPORT_DEADLINE_FACTOR * gain / speed if speed > 0 else 0.0)
        started = time.perf_counter()
        try:
            blob = await asyncio.wait_for((await self._cache()).get_prefix_state(scope, name), deadline)
            installed = await self.session.import_prefix(engine_scope, blob, prompt)
        except PrefixMismatchError as e:  # the same messages rendered otherwise: not fetched again for it
            self.counters["import_misses"] += 1
            self._mismatched[scope, name] = (e.length, e.digest, time.monotonic())
            self._mismatched.move_to_end((scope, name))
            while len(self._mismatched) > NAMES_KEPT:
                self._mismatched.popitem(last=False)
            return False
        except (CacheError, CorruptStateError, OutOfCacheError, TimeoutError) as e:  # a cache: compute it instead
            self.counters["import_misses"] += 1
            self._done.pop((scope, name), None)  # gone from the tier, maybe: a replica holding it may send it again
            log.debug("prefix import of %s failed, computing it: %s", name, e)
            return False
        self.import_rate.observe(installed, time.perf_counter() - started)
        self.counters["imports"] += 1
        self._remember(scope, name)  # the tier has it: not sent back for a while
        return True

    def _cheaper(self, tokens: int, gain: int, prefill_tokens_per_s: float) -> bool:
        if prefill_tokens_per_s <= 0:  # nothing measured yet: the router chose this, trust it
            return True
        imports = self.import_rate.value or prefill_tokens_per_s * DEFAULT_IMPORT_SPEEDUP
        return tokens / imports < gain / prefill_tokens_per_s

    def _mismatches(self, scope: str, name: str, prompt: list[int]) -> bool:
        """The tier's entry of `name`, lately fetched, covers tokens `prompt` does not begin with."""
        seen = self._mismatched.get((scope, name))
        if seen is None or time.monotonic() - seen[2] > SENT_FOR_S:
            return False
        length, digest, _ = seen
        return tokens_digest(prompt[:length]) != digest

    def _sent_lately(self, scope: str, name: str) -> bool:
        at = self._done.get((scope, name))
        return at is not None and time.monotonic() - at < SENT_FOR_S

    def _remember(self, scope: str, name: str) -> None:
        self._done[scope, name] = time.monotonic()
        self._done.move_to_end((scope, name))
        while len(self._done) > NAMES_KEPT:
            self._done.popitem(last=False)

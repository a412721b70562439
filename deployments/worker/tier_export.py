"""Write-behind export of a worker's committed heads to the cache service's state tier.

    policy (settings.tier_export):  sync  -> before the turn is answered
                                    off   -> never
                                    async -> once the conversation has been quiet here for tier_export_delay_s

    async export of one conversation (a next turn often follows within milliseconds):
      turn N ends ──delay──> export head N            quiet: the tier holds head N
      turn N ends ──> turn N+1 starts ──> timer fires: a turn runs here, skip
                                   ──> turn N+1 ends ──delay──> export head N+1
    Exporting head N while turn N+1 prefills would only compete with it for the CPU (hashing,
    serialization, the service storing chunks) and be superseded a moment later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine

from cache_service.client import CacheClient, CacheError, VersionConflict
from deployments.messages import HeadRef
from deployments.settings import AppSettings, TierExport
from deployments.worker.session import Session
from proto.contract import ConversationRef
from workers.errors import ConversationBusyError, ConversationNotFoundError

log = logging.getLogger("hybridserve.worker")

class TierExporter:
    """Which heads committed here the tier does not hold yet, and when to send them."""

    def __init__(self, session: Session, settings: AppSettings,
                 cache: Callable[[], Awaitable[CacheClient]], spawn: Callable[[Coroutine], None]):
        self.session = session
        self.settings = settings
        self._cache = cache
        self._spawn = spawn
        # Heads committed here whose state the tier does not hold yet: exported on shutdown.
        self._unexported: dict[ConversationRef, HeadRef] = {}
        self._export_due: dict[ConversationRef, asyncio.TimerHandle] = {}  # async exports waiting for quiet

    def turn_ended(self, conv: ConversationRef) -> None:
        """A turn of `conv` ended here (after the session counted it out)."""
        # Also after a failed turn: the head it would have replaced may still wait for its export.
        if conv in self._unexported and self.settings.tier_export is TierExport.ASYNC:
            self._export_when_quiet(conv)

    async def committed(self, conv: ConversationRef, head: HeadRef) -> None:
        """A turn committed `head` here: export it now (sync), later (async) or never (off)."""
        if self.settings.tier_export is TierExport.OFF:
            return  # kept nowhere: a pending entry would wait, per conversation, for the replica's life
        self._unexported[conv] = head
        if self.settings.tier_export is TierExport.SYNC:
            await self.export_head(conv, head)

    def forget(self, conv: ConversationRef, deleted: HeadRef) -> None:
        """Drop the pending export of a deleted head (not of a re-created conversation's head)."""
        pending = self._unexported.get(conv)
        if pending is not None and pending.same_state(deleted):
            del self._unexported[conv]
            due = self._export_due.pop(conv, None)
            if due is not None:
                due.cancel()

    def _export_when_quiet(self, conv: ConversationRef) -> None:
        due = self._export_due.pop(conv, None)
        if due is not None:
            due.cancel()
        self._export_due[conv] = asyncio.get_running_loop().call_later(
            self.settings.tier_export_delay_s, self._export_if_quiet, conv)

    def _export_if_quiet(self, conv: ConversationRef) -> None:
        self._export_due.pop(conv, None)
        head = self._unexported.get(conv)
        if head is not None and not self.session.use.running(conv):  # else the running turn's end schedules again
            self._spawn(self.export_head(conv, head))

    async def export_head(self, conv: ConversationRef, head: HeadRef) -> None:
        try:
            version, parts = await self.session.export_state(conv)
            # The incarnation the turn saw, carried: looked up now, it could be a re-created
            # conversation's at the same version, and this state would land under it.
            await (await self._cache()).put_state(conv, version, parts, incarnation=head.incarnation or None)
            await self.session.tier_holds(conv, version)  # let go first where memory runs short
        except VersionConflict:
            log.debug("export of %s v%d superseded by a newer turn", conv.id, head.version)
        except (CacheError, ConversationBusyError, ConversationNotFoundError) as e:
            # Not kept for another try: the ledger has the turn, and a next owner recomputes
            # what the tier lacks; a kept entry would pile up while the tier is down.
            log.warning("export of %s v%d failed: %s", conv.id, head.version, e)
        if self._unexported.get(conv) == head:
            del self._unexported[conv]

    async def shutdown(self) -> None:
        """Hand the heads only this replica holds to the tier (unless export is off)."""
        for due in self._export_due.values():
            due.cancel()
        if self.settings.tier_export is not TierExport.OFF:
            for conv, head in list(self._unexported.items()):
                await self.export_head(conv, head)

    def pending(self) -> int:
        """Heads waiting for their export (bounded by the conversations committed here within
        the export delay)."""
        return len(self._unexported)

"""The recovery ladder: how a worker comes to hold a conversation's committed head.

    head is None            -> NEW (a new conversation: drop any stale local copy)
    local state == head      -> LOCAL (a hit)
    tier holds head.version  -> TIER_IMPORT (the head migrates here)
    tier holds an older one  -> TIER_PREFIX (imported; the turns after it run again)
    else                     -> LEDGER_RECOMPUTE (token ids from the service's ledger)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from cache_service.client import CacheClient, CacheError
from deployments.messages import Recovery, TurnJob
from deployments.settings import AppSettings, TierExport
from deployments.worker.session import Session
from workers.conversation.records import LedgerTurn
from workers.errors import CorruptStateError, OutOfCacheError

log = logging.getLogger("hybridserve.worker")


async def attach(session: Session, settings: AppSettings, cache: Callable[[], Awaitable[CacheClient]],
                 job: TurnJob) -> Recovery:
    """Make this engine hold the conversation's committed head, by the recovery ladder."""
    conv, head = job.conversation, job.head
    if head is None:
        await session.forget(conv)  # a deleted and re-created conversation
        return Recovery.NEW
    if await session.holds(conv, head):
        return Recovery.LOCAL
    client = await cache()
    ledger = await client.read_ledger(conv)
    turns = [LedgerTurn(tuple({"role": m.role, "content": m.content} for m in t.messages), tuple(t.token_ids))
             for t in ledger.turns]
    await session.adopt_ledger(conv, head, turns)
    # The ledger's head is fresher than the lease's: a bypassed owner may have exported since.
    tier_version = ledger.head.tier_version
    if settings.tier_export is not TierExport.OFF and 0 < tier_version <= head.version:
        # An older copy (the owner died before exporting its last turns) still spares the
        # turns it covers: the engine continues it and runs only the turns after it.
        try:
            # The incarnation: a copy left on an instance from before a delete and re-creation
            # at the same version must not be imported.
            _, blob = await client.get_state(conv, tier_version, incarnation=ledger.head.incarnation or None)
            await session.import_state(conv, blob)
            return Recovery.TIER_IMPORT if tier_version == head.version else Recovery.TIER_PREFIX
        except (CacheError, CorruptStateError, OutOfCacheError) as e:  # the tier is a cache: never fatal
            log.warning("tier import of %s failed, recomputing from the ledger: %s", conv.id, e)
    return Recovery.LEDGER_RECOMPUTE

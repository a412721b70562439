"""Turns under a Redis failover, and the ledger's verdict on those that got an error.

Shared by the Sentinel and the Cluster failover tests: clients run turns (acquire -> publish)
round their conversations; a turn that got an error is resolved by reading the ledger (present
as the next turn, or absent and published again), so at the end each conversation's ledger must
hold exactly the turns recorded here, in order.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from cache_service.errors import CacheError
from proto.contract import ConversationRef, tokens_digest

CLIENTS, CONVERSATIONS_PER_CLIENT = 4, 3
TURNS_BEFORE_KILL = 40
TURNS_AFTER_FAILOVER = 5        # per client, each started after the failover
LOAD_DEADLINE_S = 45.0


@dataclass
class Conversation:
    ref: ConversationRef
    tokens: list[int] = field(default_factory=list)
    publish_ids: list[str] = field(default_factory=list)   # what the ledger must hold, in order


@dataclass
class Load:
    acked: int = 0
    in_flight_errors: int = 0        # turns that got an error: resolved from the ledger, then retried
    resolved_present: int = 0        # ... of which the ledger held the turn
    failed_over: asyncio.Event = field(default_factory=asyncio.Event)
    enough_before_kill: asyncio.Event = field(default_factory=asyncio.Event)


async def in_ledger(client, conv: Conversation, publish_id: str) -> bool:
    """The ledger's verdict on a turn that got an error: present (as the next turn) or absent."""
    head = await client.get_head_or_none(conv.ref)
    version = head.version if head else 0
    assert version in (len(conv.publish_ids), len(conv.publish_ids) + 1), (version, len(conv.publish_ids))
    if version == len(conv.publish_ids):
        return False
    (turn,) = (await client.read_ledger(conv.ref, from_turn=version)).turns
    assert turn.publish_id == publish_id, "a turn nobody published is in the ledger"
    return True


async def turn(client, reader, conv: Conversation, load: Load) -> None:
    """One turn by `client`; an error is resolved by the ledger's verdict, read by `reader`."""
    publish_id, new = uuid.uuid4().hex, [len(conv.tokens) + 1, 7]
    while True:
        try:
            lease = await client.acquire_lease(conv.ref, ttl_ms=5_000, wait_s=10.0)
            await client.publish_turn(
                conv.ref, lease_token=lease, expected_version=len(conv.publish_ids),
                messages=[{"role": "user", "content": publish_id}], token_ids=new,
                committed_tokens=len(conv.tokens) + len(new), tokens_sha256=tokens_digest(conv.tokens + new),
                publish_id=publish_id)
        except CacheError:
            load.in_flight_errors += 1
            if not await in_ledger(reader, conv, publish_id):
                continue  # absent: the retry publishes it
            load.resolved_present += 1
        else:
            load.acked += 1
        conv.tokens += new
        conv.publish_ids.append(publish_id)
        if load.acked >= TURNS_BEFORE_KILL:
            load.enough_before_kill.set()
        return


async def client_loop(client, reader, convs: list[Conversation], load: Load) -> int:
    """Turns round the conversations until TURNS_AFTER_FAILOVER turns started after the failover."""
    after = 0
    while after < TURNS_AFTER_FAILOVER:
        for conv in convs:
            started_after = load.failed_over.is_set()
            await turn(client, reader, conv, load)
            after += started_after
    return after

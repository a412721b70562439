"""The conversation routes' work: a conversation's ledger as JSON, its items, its deletion, and
asking its owner replica to forget its local copy (also after a Responses delete)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from cache_service.client import CacheClient, CacheError, LeaseHeld, NotFound, StorageFull, pb
from deployments import errors
from deployments.errors import APIError
from deployments.front import responses_plan
from deployments.messages import HeadRef, ReplicaCall
from deployments.settings import AppSettings
from deployments.turn import outcome
from proto.contract import ConversationRef

log = logging.getLogger("hybridserve.ingress")


def check_id(conversation_id: str) -> None:
    if not 0 < len(conversation_id.encode()) <= 256:
        raise APIError(400, "conversation_id must be 1..256 bytes", "invalid_request", param="conversation_id")


def unknown(conversation_id: str) -> APIError:
    return APIError(404, f"no conversation {conversation_id!r} under this cache_salt", "conversation_not_found")


async def _ledger(cache: CacheClient, conv: ConversationRef) -> pb.ReadLedgerResponse:
    """The conversation's ledger (404 if there is none, 503 if the service is down)."""
    try:
        return await cache.read_ledger(conv)
    except NotFound:
        raise unknown(conv.id) from None
    except CacheError as e:
        raise errors.cache_failed(e) from e


async def describe(cache: CacheClient, conv: ConversationRef) -> dict[str, Any]:
    """GET /v1/conversations/{id}: the ledger and the head."""
    ledger = await _ledger(cache, conv)
    head = ledger.head
    return {
        "id": conv.id, "object": "conversation", "turn": head.turn,
        "created_at": ledger.turns[0].committed_at_ms // 1000 if ledger.turns else 0, "metadata": {},
        "head": {"version": head.version, "turn": head.turn, "committed_tokens": head.committed_tokens,
                 "tokens_sha256": head.tokens_sha256, "owner": head.owner_replica,
                 "tier_version": head.tier_version},
        "turns": [{"turn": i, "messages": [{"role": m.role, "content": m.content} for m in t.messages],
                   "token_ids": list(t.token_ids)} for i, t in enumerate(ledger.turns, start=1)],
    }


async def items(cache: CacheClient, conv: ConversationRef, order: str) -> dict[str, Any]:
    """Each turn's new messages, then its reply as its client was sent it (`told`)."""
    ledger = await _ledger(cache, conv)
    if not ledger.head.version:
        raise unknown(conv.id)
    return responses_plan.item_list([entry for t in ledger.turns for entry in told(t)], conv.key, order)


def told(turn: pb.LedgerTurn) -> list:
    """A turn as its client saw it: the messages it sent, then the reply as it was sent (the
    content cut at a stop string, special tokens skipped, tool calls apart, `outcome.sent_reply`)
    and the reply's tool calls. The ledger's own last message is the model's side of the reply,
    which the next prompt re-renders and no client was shown."""
    if not turn.messages or turn.messages[-1].role != "assistant":  # no reply recorded
        return list(turn.messages)
    content, calls = outcome.sent_reply(turn)
    return [*turn.messages[:-1], pb.Message(role="assistant", content=content), *calls]


class Forgetting:
    """Deletes conversations, and has their owners drop their local copies."""

    def __init__(self, settings: AppSettings, workers: DeploymentHandle):
        self.settings, self.workers = settings, workers

    async def delete(self, cache: CacheClient, conv: ConversationRef) -> None:
        """DELETE /v1/conversations/{id}: the head, the ledger, the tier copy, the owner's copy."""
        try:
            lease = None
            try:
                lease = await cache.acquire_lease(conv, int(self.settings.lease_ttl_s * 1000))
                head = lease.head
            except StorageFull:
                # A full store must still let clients free it, and taking a lease is a write. Without
                # one, a turn in flight is not waited for but cannot commit either: the delete drops
                # its lease, so its publish is refused (lease lost).
                head = await cache.get_head_or_none(conv) or pb.Head()
            if head.version == 0:
                if lease is not None:
                    await cache.release_lease(conv, lease)
                raise unknown(conv.id)
            # Deleting drops the lease too; a turn started after this point begins a new conversation.
            await cache.delete_conversation(conv)
        except LeaseHeld:
            raise errors.busy(conv.id) from None
        except CacheError as e:
            raise errors.cache_failed(e) from e
        await self.locally(conv, HeadRef.of(head))

    async def locally(self, conv: ConversationRef, deleted: HeadRef) -> None:
        """The owner's local copy frees its blocks now. Best effort and bounded: the conversation
        is gone from the service already, and a stale copy is never used (workers check it
        against the head). With every replica at max_ongoing_requests the call would back off
        for as long as they stay full; DELETE does not wait for that. A copy left behind (here,
        or on a replica that served an earlier turn) expires within replica_copy_ttl_s."""
        if not deleted.owner:
            return
        response = self.workers.forget.remote(ReplicaCall(deleted.owner), conv, deleted)
        try:
            await asyncio.wait_for(response, self.settings.forget_timeout_s)
        except TimeoutError:
            response.cancel()
            log.warning("the owner of %s did not answer within %.1f s: its local copy stays until it expires",
                        conv.id, self.settings.forget_timeout_s)
        except (RayError, BackPressureError) as e:
            log.warning("the owner of %s kept its local copy until it expires: %s", conv.id, e)

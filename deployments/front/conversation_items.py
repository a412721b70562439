"""POST /v1/conversations/{id}/items: messages appended to a stored conversation without a turn.

The items are committed like a turn that has no reply: under the conversation's lease, one
PublishTurn (compare-and-set on the head version) appends a ledger turn holding the items and
their token ids, so they are all there or none is. Their ids are the template's rendering of
them after the committed history, without a generation prompt (a worker renders them; any
replica will do):

    committed ids  [ history ........................ ][ items ]      the new head
    next turn      [ history ........................ ][ items ][ suffix + reply ]
                     ^ the owner's head still holds this   ^ prefilled with the suffix

The owner keeps its state of the head before the items: the next turn, routed to it as ever,
finds the head moved (holds() fails), adopts the ledger and continues from that older head, so
only the items and the new suffix are computed (recovery_ladder.attach, TurnLifecycle).
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.handle import DeploymentHandle

from cache_service.client import CacheClient, CacheError, LeaseHeld, LeaseLost, VersionConflict, pb
from deployments import errors
from deployments.errors import APIError
from deployments.front import conversations, responses_plan
from deployments.front.responses_models import ItemsCreate, engine_messages
from proto.contract import ConversationRef, tokens_digest

log = logging.getLogger("hybridserve.ingress")


async def append(cache: CacheClient, workers: DeploymentHandle, conv: ConversationRef, body: ItemsCreate,
                 lease_ttl_ms: int) -> dict[str, Any]:
    """Append the items as one committed ledger turn; the list of the new items, as OpenAI answers."""
    try:
        lease = await cache.acquire_lease(conv, lease_ttl_ms)
    except LeaseHeld:
        raise errors.busy(conv.id) from None
    except CacheError as e:
        raise errors.cache_failed(e) from e
    published = False
    try:
        head = lease.head
        if head.version == 0:
            raise conversations.unknown(conv.id)
        ledger = await cache.read_ledger(conv)
        committed = [t for turn in ledger.turns for t in turn.token_ids]
        history = [{"role": m.role, "content": m.content} for turn in ledger.turns for m in turn.messages]
        before = sum(len(conversations.told(turn)) for turn in ledger.turns)  # the items' ids go on from here
        ids, messages, refused = await workers.appended_ids.remote(committed, history, engine_messages(body.items))
        if refused:
            raise APIError(400, f"the items cannot be appended to this conversation: {refused}", "invalid_request",
                           param="items")
        if not ids:
            raise APIError(400, "the items render to no tokens", "invalid_request", param="items")
        # The owner stays: it holds the state of the head before the items, which the next turn continues.
        await cache.publish_turn(conv, lease_token=lease, expected_version=head.version, messages=messages,
                                 token_ids=ids, committed_tokens=len(committed) + len(ids),
                                 tokens_sha256=tokens_digest(committed + ids), owner_replica=head.owner_replica,
                                 release_lease=True)
        published = True
    except (LeaseLost, VersionConflict):  # a delete or a rewind took the conversation meanwhile
        raise errors.busy(conv.id) from None
    except CacheError as e:
        raise errors.cache_failed(e) from e
    finally:
        if not published:
            await _release(cache, conv, lease)
    added = [pb.Message(role=m["role"], content=m["content"]) for m in messages]
    return responses_plan.item_list(added, conv.key, "asc", first=before)


async def _release(cache: CacheClient, conv: ConversationRef, lease: pb.Lease) -> None:
    """Nothing was published: the lease goes back at once (an unreachable service lets it expire)."""
    try:
        await cache.release_lease(conv, lease)
    except CacheError as e:
        log.warning("the lease of %s was not released (it expires): %s", conv.id, e)

"""Install a verified head on the engine thread (tensor copies only), all-or-nothing.

The export must belong to the ledger this engine adopted from the cache service: its
conversation key, committed length, token digest and messages digest are checked against it
before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from proto.contract import ConversationRef, tokens_digest
from workers.cache.holders import HolderSlots, SlotRole
from workers.conversation.export_format import messages_digest
from workers.conversation.export_verify import VerifiedHead
from workers.conversation.ledger import ConversationLedger
from workers.conversation.records import HeadInfo
from workers.conversation.retention import HeadRetention
from workers.engine import LLMEngine
from workers.errors import ConversationNotFoundError, CorruptStateError


def install_head(
    engine: LLMEngine,
    conversations: dict[str, ConversationLedger],
    retention: HeadRetention,
    ref: ConversationRef,
    verified: VerifiedHead,
) -> HeadInfo:
    """Install a verified head for a conversation whose ledger this engine holds (adopted).

    All-or-nothing: CorruptStateError (it does not match the ledger, a held chunk is gone) or
    OutOfCacheError leave the engine exactly as it was. If a head of that turn or a later one
    is held already, nothing is installed and that head is described."""
    meta = verified.meta
    key = ref.key
    if meta["conversation"] != key:
        raise CorruptStateError("the export belongs to another conversation or cache_salt")
    conv = conversations.get(key)
    if conv is None:
        raise ConversationNotFoundError(f"no ledger of {ref.id!r} here: adopt it from the service first")
    conv.ensure_idle()
    turn = meta["turn"]
    committed = conv.tokens_until(turn) if turn <= conv.turn else None
    messages = [m for t in conv.turns[:turn] for m in t.messages]
    # The digests prove which tokens and messages; the length is checked too, since state_len
    # is trusted from it.
    if (
        committed is None
        or meta["committed_tokens"] != len(committed)
        or tokens_digest(committed) != meta["tokens_digest"]
        or messages_digest(messages) != meta["messages_digest"]
    ):
        raise CorruptStateError("the export does not match this engine's ledger of the conversation")
    # A head of this turn or a later one serves the next turn at least as well (an older tier
    # copy arriving where a later head survived): installing would only take room from others.
    caches = engine.caches
    held = caches.heads.latest(key)
    if held is not None and held.turn >= turn:
        return conv.head_info(held)
    shared = shared_blocks(engine, verified)
    head = caches.install_head(
        key, turn, meta["version"], meta["state_len"], meta["aligned_len"], shared,
        aligned=SlotRole.ALIGNED in verified.states, write=state_writer(engine, verified, shared),
        canonical_window=meta["canonical_window"],
    )
    caches.remember_chunks(head, [digest for digest, _ in verified.blocks])
    retention.retire_older(key, turn, keep=head.holder)  # imported for the turn about to run
    return conv.head_info(head)


def shared_blocks(engine: LLMEngine, verified: VerifiedHead) -> list[int | None]:
    """Per block of the export, the local block already holding that chunk (its digest names its
    contents: a tier import sends every chunk, and one this engine holds is shared, not copied),
    or None (a new block the writer fills). CorruptStateError if a chunk the export left out is
    gone meanwhile."""
    shared: list[int | None] = []
    for digest, data in verified.blocks:
        block = engine.caches.chunks.block_of(digest)
        if data is None and block is None:
            raise CorruptStateError(f"chunk {digest[:16]} is no longer held here: send it")
        shared.append(block)
    return shared


def state_writer(engine: LLMEngine, verified: VerifiedHead,
                 shared: list[int | None]) -> Callable[[list[int], HolderSlots], None]:
    """What fills an installed state's new blocks (those `shared` leaves None) and its slots from
    the export (engine thread)."""
    runner = engine.runner

    def write(new_blocks: list[int], slots: HolderSlots) -> None:
        fresh = [data for (_, data), block in zip(verified.blocks, shared, strict=True) if block is None]
        if fresh:
            runner.write_blocks(new_blocks, torch.stack(fresh, dim=2))
        roles = slots.roles
        conv_t = torch.stack([verified.states[r][0] for r in roles], dim=1)
        ssm_t = torch.stack([verified.states[r][1] for r in roles], dim=1)
        runner.write_slots(list(roles.values()), conv_t, ssm_t)

    return write

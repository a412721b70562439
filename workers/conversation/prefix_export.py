"""A prefix checkpoint as an export, for the state tier: the state of a token prefix that no
conversation owns (a tenant's system prompt and tool catalogue, a stateless request's end),
computed on one replica and attached on another (deployments/worker/prefix_tier.py).

    header   a head's (export.py), with "prefix": {scope, length, digest},
             committed_tokens = state_len = length, tokens_digest = digest, turn 0, no conversation
    scope    sha256 of the engine's cache scope (the salt, API-key scoped), never the scope itself
    chunks   a head's: one per full KV block, the tail, and the terminal Mamba state only

The engine names a checkpoint `PrefixKey(scope, L, tokens_digest(t[:L]))`; an imported one gets
exactly that name under the importing request's own scope (and only if the export's scope digest
is that scope's), so a request attaches it only where its own token ids match, the same exact
rule as for a checkpoint computed here: a wrong or stale tier entry costs a fetch, never a token.

Threads as for heads: `snapshot_checkpoint` and `install_checkpoint` on the engine thread (tensor
copies), `build_export` / `verify_export` anywhere.
"""

from __future__ import annotations

import hashlib

from workers.cache.holders import SlotRole
from workers.conversation.export import HeadSnapshot, engine_layout
from workers.conversation.export_install import shared_blocks, state_writer
from workers.conversation.export_verify import VerifiedHead
from workers.engine import LLMEngine
from workers.errors import CorruptStateError
from workers.state_names import PrefixKey


def scope_digest(scope: str) -> str:
    return hashlib.sha256(scope.encode()).hexdigest()


def snapshot_checkpoint(engine: LLMEngine, key: PrefixKey) -> HeadSnapshot | None:
    """A copy of the state named `key` (a checkpoint, or a head named by the same tokens), None
    if this engine no longer holds it (evicted since it was made) or a longer link of its request
    chain superseded it (an agent loop's next step ended here: that end is the one worth sending)."""
    caches = engine.caches
    held = [s for s in caches.heads.index.holding(key) if s.state_len == key.length and not s.superseded]
    if not held:
        return None
    state = held[0]
    table = caches.kv.table(state.holder)
    kv = engine.runner.read_blocks(table)
    bs = caches.kv.block_size
    if state.state_len % bs:  # positions past the prefix (the request that made it went on) stay here
        kv[:, :, -1, state.state_len % bs :] = 0
    # A checkpoint is attached from its terminal state only (a head's aligned one serves the
    # deterministic tiles of its own conversation, which never attach a prefix).
    slots = {SlotRole.TERMINAL: caches.states.slots[state.holder].roles[SlotRole.TERMINAL]}
    conv_state, ssm_state = engine.runner.read_slots(list(slots.values()))
    meta = {
        "conversation": "",
        "turn": 0,
        "version": 0,
        "state_len": state.state_len,
        "aligned_len": 0,
        "canonical_window": 0,
        "prefix": {"scope": scope_digest(key.scope), "length": key.length, "digest": key.digest},
    }
    return HeadSnapshot(
        identity=engine.identity, layout=engine_layout(engine), meta=meta, token_ids=(), messages=(),
        kv=kv, blocks=tuple((b, caches.kv.generation(b)) for b in table),
        known=tuple(caches.chunks.digest_of(b) for b in table), roles=tuple(slots), conv=conv_state,
        ssm=ssm_state,
    )


def install_checkpoint(engine: LLMEngine, scope: str, verified: VerifiedHead) -> PrefixKey:
    """Install an imported prefix checkpoint under `scope` (the request's own); returns its name.
    A name held already is left as it is. All-or-nothing: CorruptStateError (not a prefix export,
    another scope's) or OutOfCacheError (no room within the checkpoints' budget) change nothing."""
    prefix = verified.meta.get("prefix")
    if prefix is None:
        raise CorruptStateError("the export is a conversation's head, not a prefix checkpoint")
    if prefix["scope"] != scope_digest(scope):
        raise CorruptStateError("the export is another cache scope's prefix checkpoint")
    key = PrefixKey(scope, prefix["length"], prefix["digest"])
    caches = engine.caches
    if key in caches.heads.index:
        return key
    shared = shared_blocks(engine, verified)
    checkpoint = caches.install_checkpoint(key, verified.meta["state_len"], shared,
                                           write=state_writer(engine, verified, shared))
    caches.remember_chunks(checkpoint, [digest for digest, _ in verified.blocks])
    return key


def held_prefix_length(engine: LLMEngine, scope: str, token_ids: list[int]) -> int:
    """The longest prefix of `token_ids` this engine holds under `scope` (what a request would
    attach, at most len - 1 tokens); 0 for none. Not counted as a lookup."""
    found = engine.caches.heads.index.longest(scope, token_ids, len(token_ids) - 1)
    return found[0].length if found is not None else 0

"""Requests that arrive together share a prefix nobody holds yet: the later ones wait for the
first one's checkpoint instead of all computing it.

    t0  R, W arrive (same scope, same 1,900-token tool catalogue; nothing held)
        R admitted; W would be too (the budget fits both) and compute the catalogue a second time
    t0  W waits: R has a mark at 1,900 it has not reached, and W's prompt has the same prefix there
    t1  R's prefill passes 1,900: the checkpoint is named
    t1  W attaches it (coordinator.attach_prefix) and computes only its own tail

A waiting request never waits on a request that left the running set (finished, aborted,
preempted), on a mark already passed, or on a mark that got no room when its request was
admitted (it will make no checkpoint): it runs as a miss then, at once. Deterministic requests
neither look up nor mark, and never wait.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from workers.cache.prefix_index import prefix_keys
from workers.request import CheckpointMark, Request

# Shorter shared prefixes are not worth holding a request back for (the engine checkpoints at
# message boundaries; a shared first message shorter than this is cheaper to recompute).
MIN_SHARED_TOKENS = 32


def awaited_prefix(waiting: Request, running: Iterable[Request],
                   open_marks: Callable[[str], Iterable[CheckpointMark]]) -> int:
    """The length of the longest prefix of `waiting`'s prompt that a running request of its
    scope will checkpoint and has not reached yet, longer than what `waiting` holds now; 0 when
    there is none (admit it now). `open_marks(request_id)`: the marks of a running request that
    have a slot, i.e. will become checkpoints (a mark admitted without room makes none: waiting
    for it would only delay computing the prefix)."""
    if not waiting.prefix_lookup or waiting.prefix_scope is None or waiting.deterministic:
        return 0
    prompt = waiting.prompt_token_ids
    held = waiting.head.state_len if waiting.head is not None else 0
    pending = {m.key: m.position for r in running if r.prefix_scope == waiting.prefix_scope
               for m in open_marks(r.request_id)
               if m.key is not None and r.num_computed_tokens < m.position < len(prompt)
               and m.position > max(held, MIN_SHARED_TOKENS - 1)}
    if not pending:
        return 0
    mine = prefix_keys(waiting.prefix_scope, list(prompt), sorted(set(pending.values())))
    return max((key.length for key in mine if key in pending), default=0)

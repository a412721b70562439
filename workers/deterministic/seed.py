"""Seeds of deterministic requests that were given none: the same on every replica."""

from __future__ import annotations

import hashlib


def derived_seed(prompt_token_ids: list[int]) -> int:
    """A seed from the prompt's token ids (a conversation turn's prompt is its committed
    history plus the new suffix, so this names the conversation and the turn), never a
    random draw: another replica, a retry or a recompute gets the same one."""
    digest = hashlib.sha256(b"hybridserve-seed\0" + b",".join(str(t).encode() for t in prompt_token_ids))
    return int.from_bytes(digest.digest()[:8], "big") >> 1  # [0, 2**63)

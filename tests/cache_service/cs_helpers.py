"""Helpers shared by the cache-service tests (imported as a plain module)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_service.client import CacheClient, Conversation, tokens_sha256


@dataclass
class History:
    """What a worker would know about a conversation: its committed tokens."""

    tokens: list[int] = field(default_factory=list)
    version: int = 0


async def commit_turn(client: CacheClient, conv: Conversation, history: History, new_tokens: list[int],
                      text: str, *, owner: str = "replica-0") -> None:
    lease = await client.acquire_lease(conv, ttl_ms=10_000, wait_s=5.0)
    tokens = history.tokens + new_tokens
    head = await client.publish_turn(
        conv, lease_token=lease.token, expected_version=history.version,
        messages=[{"role": "user", "content": text}, {"role": "assistant", "content": f"re: {text}"}],
        token_ids=new_tokens, committed_tokens=len(tokens), tokens_sha256=tokens_sha256(tokens),
        owner_replica=owner)
    assert head.version == history.version + 1
    history.tokens, history.version = tokens, head.version

"""Acknowledged = replicated, when the operator asks: a write script followed by WAIT.

`WAIT n timeout` counts the replicas that acknowledged every write this *connection* made,
so the script and the WAIT go down one connection, as one pipeline. A write that fewer than n
replicas acknowledged in time is answered UNAVAILABLE: it is on the primary, but a failover
now could lose it. The client retries; each write script is safe to run again (a publish
carries its publish_id, an acquire its attempt key), and its retry path writes too (a
PEXPIRE), so the retry's WAIT also covers the first attempt's write.

On a Redis Cluster, WAIT has no key to route by: the pair goes down one connection to the
primary of the script's slot (every key of a script shares one hash tag). A redirect (the slot
moved in a failover) or a dead node reloads the slot map and answers UNAVAILABLE: the client's
retry runs on the promoted node.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import AskError, ClusterDownError, NoScriptError, RedisError, SlotNotCoveredError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from cache_service import errors


@dataclass(frozen=True)
class ReplicaWait:
    replicas: int = 0         # 0: answer once the primary has the write (no WAIT)
    timeout_ms: int = 1000

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.timeout_ms <= 0:
            raise ValueError("need replicas >= 0 and timeout_ms > 0")


async def run_waited(redis: aioredis.Redis, script: AsyncScript, keys: list, args: list,
                     wait: ReplicaWait, what: str):
    """The script's reply; Unavailable if it wrote (status OK) but too few replicas acknowledged."""
    if wait.replicas == 0:
        return await script(keys=keys, args=args)
    for _ in range(2):  # a primary just promoted may not have the script cached yet
        if isinstance(redis, RedisCluster):
            reply, acked = await _on_slot_primary(redis, script, keys, args, wait)
        else:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                pipe.execute_command("WAIT", wait.replicas, wait.timeout_ms)
                reply, acked = await pipe.execute(raise_on_error=False)
        if not isinstance(reply, NoScriptError):
            break
        await redis.script_load(script.script)
    for result in (reply, acked):
        if isinstance(result, Exception):
            raise result
    wrote = reply[0] == b"OK" if isinstance(reply, list) else bool(reply)  # delete answers a count
    if wrote and acked < wait.replicas:
        raise errors.Unavailable(f"{what}: written on the Redis primary, but {acked} of {wait.replicas} replicas "
                                 f"acknowledged it within {wait.timeout_ms} ms; retrying is safe")
    return reply


# MovedError is an AskError.
_TOPOLOGY_ERRORS = (AskError, ClusterDownError, TryAgainError, SlotNotCoveredError, RedisConnectionError,
                    RedisTimeoutError, OSError)


async def _on_slot_primary(redis: RedisCluster, script: AsyncScript, keys: list, args: list,
                           wait: ReplicaWait) -> tuple:
    """(script reply, replicas acknowledged) from one connection to the slot's primary."""
    commands = [PipelineCommand(0, "EVALSHA", script.sha, len(keys), *keys, *args),
                PipelineCommand(1, "WAIT", wait.replicas, wait.timeout_ms)]
    try:
        await redis.get_node_from_key(keys[0]).execute_pipeline(commands)
    except _TOPOLOGY_ERRORS as e:
        commands[0].result = e
    if isinstance(commands[0].result, _TOPOLOGY_ERRORS):
        try:
            await redis.nodes_manager.initialize()
        except RedisError:
            pass  # the cluster is still electing: the client's next retry reloads the map again
        raise errors.Unavailable(f"the Redis Cluster moved or lost this slot's primary "
                                 f"({type(commands[0].result).__name__}); retrying is safe")
    return commands[0].result, commands[1].result

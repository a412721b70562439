"""The cycle's gRPC floor: `python -m bench.kit.grpc_floor` serves CacheService with no work at all.

AcquireLease and PublishTurn answer fixed replies the size of the service's (no Redis, no
checks), registered as the service registers its handlers (wire.add_servicer: the same
parsing) on the same event loop (uvloop). bench/cache_service.py drives it with the same
CacheClient cycle as the service: what that costs is gRPC and the client alone, the part of a
cycle no change to the service's handlers can remove. Prints the bound port on stdout.
"""

from __future__ import annotations

import grpc
import uvloop

from cache_service import wire
from proto import cache_pb2 as pb
from proto import cache_pb2_grpc

HEAD = pb.Head(version=7, turn=7, committed_tokens=448, tokens_sha256="ab" * 32, owner_replica="r0",
               updated_at_ms=1_700_000_000_000, incarnation="0123456789abcdef")
LEASE = pb.Lease(holder="client:" + "0" * 32, token=8, expires_at_ms=1_700_000_030_000, proof=bytes(24), head=HEAD)


class Floor(cache_pb2_grpc.CacheServiceServicer):
    async def AcquireLease(self, request, context):
        return LEASE

    async def PublishTurn(self, request, context):
        return HEAD


async def serve() -> None:
    server = grpc.aio.server()
    wire.add_servicer(Floor(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(serve())

"""How requests reach the handlers: tolerant parsing and the optional shared secret.

Parsing: the generated registration lets gRPC parse requests itself, and a malformed
message then fails inside gRPC as UNKNOWN ("Unexpected DecodeError"). Here every
method gets a deserializer that never raises: a message that does not parse becomes a
`Malformed` value, which the rpc decorator answers with INVALID_ARGUMENT. Unknown
fields are dropped on parse, so nothing a newer or hostile client adds is ever stored.

Authentication: with a shared secret configured, every call except the standard
health service must carry `authorization: Bearer <secret>`; anything else is
UNAUTHENTICATED before a handler runs.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from cache_service import errors
from proto import cache_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["CacheService"]
AUTH_METADATA_KEY = "authorization"
_HEALTH_PREFIX = "/grpc.health.v1.Health/"

_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True)
class Malformed:
    """A request that did not parse; handlers never see it (rpc.py refuses it)."""

    error: str


def _parser(cls):
    def parse(data: bytes):
        message = cls()
        try:
            message.ParseFromString(data)
        except DecodeError as exc:
            return Malformed(str(exc))
        message.DiscardUnknownFields()
        return message
    return parse


def add_servicer(servicer, server: grpc.aio.Server) -> None:
    """Register every CacheService method of `servicer` with tolerant parsing."""
    handlers = {}
    for method in SERVICE.methods:
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_parser(getattr(pb, method.input_type.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata a client sends when the service has a shared secret."""
    return ((AUTH_METADATA_KEY, f"Bearer {token}"),)


_REFUSED = errors.Unauthenticated("this cache service requires its shared secret "
                                  "(metadata 'authorization: Bearer <secret>')")


async def _refuse(request, context):
    await context.abort(_REFUSED.code, _REFUSED.message, trailing_metadata=_REFUSED.trailing_metadata())


async def _refuse_stream(request, context):
    await _refuse(request, context)
    yield  # an async generator, as a server-streaming handler must be


class SharedSecretInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()
        self._refusals = {}
        for method in SERVICE.methods:
            kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
            handler = _refuse_stream if method.server_streaming else _refuse
            self._refusals[f"/{SERVICE.full_name}/{method.name}"] = kind(handler)
        self._refuse_unary = grpc.unary_unary_rpc_method_handler(_refuse)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(_HEALTH_PREFIX):
            return await continuation(details)
        presented = next((v for k, v in details.invocation_metadata or () if k == AUTH_METADATA_KEY), "")
        if isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._expected):
            return await continuation(details)
        return self._refusals.get(details.method, self._refuse_unary)

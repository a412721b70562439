"""A streamed turn as server-sent events: how its events are rendered (EventStream: the chat
completion's chunks here, the Responses API's in responses_format.ResponseStream), and the
response that carries them (sse_response)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import StreamingResponse

from deployments.errors import APIError
from deployments.front.chat_format import ChatFormat
from deployments.messages import TurnDelta, TurnDone


class EventStream(Protocol):
    """How a streamed turn is rendered: its SSE chunks at the start, per delta, at the end or
    on a failure."""

    def start(self) -> Iterable[str]: ...
    def delta(self, delta: TurnDelta) -> Iterable[str]: ...
    def end(self, done: TurnDone) -> Iterable[str]: ...
    def error(self, error: APIError) -> Iterable[str]: ...


@dataclass(frozen=True)
class ChatStream:
    """A chat completion's chunks (chat_format.ChatFormat) as an EventStream."""

    form: ChatFormat
    include_usage: bool

    def start(self) -> Iterable[str]:
        return list(self.form.sse_start())

    def delta(self, delta: TurnDelta) -> Iterable[str]:
        return [self.form.sse_delta(delta)]

    def end(self, done: TurnDone) -> Iterable[str]:
        return self.form.sse_end(done, self.include_usage)

    def error(self, error: APIError) -> Iterable[str]:
        return [self.form.sse_error(error)]


class _ClosingStream(StreamingResponse):
    """A stream whose body generator is closed however the response ends. Starlette leaves it
    suspended at its last `yield` when the client hangs up, to be closed whenever the garbage
    collector gets to it; its `finally` settles the turn (cancels the worker's run, discards the
    lease) and the ingress's in-flight count, which cannot wait that long."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await asyncio.shield(self.body_iterator.aclose())


def sse_response(chunks: AsyncIterator[str]) -> StreamingResponse:
    """`chunks` as an event stream, closed (and so its turn settled) however the response ends."""
    return _ClosingStream(chunks, media_type="text/event-stream")

"""The request body limit, on the bytes actually received.

A `Content-Length` over the limit is refused before the body is read (ingress.py); a chunked
body (no length) or a body longer than its declared length is counted here as it arrives: past
the limit the app stops reading, and whatever it would have answered is replaced by a 413.

Pure ASGI, like the ingress's guard: the response's chunks (each SSE token) pass straight through.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.errors import APIError


class BodyTooLarge(Exception):
    pass


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit} bytes", "request_too_large")


class BodyLimit:
    """Counts the body's bytes against `app.state.max_body_bytes` (None: no limit)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = getattr(scope["app"].state, "max_body_bytes", None) if scope["type"] == "http" else None
        if limit is None:
            await self.app(scope, receive, send)
            return
        received, over, started = 0, False, False

        async def counted() -> Message:
            nonlocal received, over
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    raise BodyTooLarge
            return message

        async def unless_over(message: Message) -> None:
            nonlocal started
            if over:  # the app's answer to a body it could not read (e.g. FastAPI's 400): replaced below
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, unless_over)
        except BodyTooLarge:
            pass
        if over and not started:
            await too_large(limit).response()(scope, receive, send)

"""What every request passes before a route sees it: CORS, the API key, the key's rate and the
body's size.

    Cors       with cors_allow_origins set: Starlette's CORSMiddleware (preflights answered
               before authentication, which browsers never send on them)
    Guard      before the body is read: 401 without a configured API key (every /v1 route),
               429 over the key's rate_limit_rpm (every /v1 route),
               413 when its Content-Length is over the limit
    BodyLimit  a chunked body (no length) or one longer than its declared length is counted as
               it arrives: past the limit the app stops reading, and whatever it would have
               answered is replaced by a 413

The settings are the deployment's, set on the app's state in ChatIngress.__init__. Pure ASGI, not
`@api.middleware("http")`: that one passes every response chunk (each SSE token) through an extra
task and memory stream; here the response's chunks pass straight through.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.errors import APIError


def install(api: FastAPI) -> None:
    api.add_middleware(Guard)
    api.add_middleware(BodyLimit)
    api.add_middleware(Cors)  # outermost: a preflight is answered before the key is asked for


def bearer(request: Request) -> str:
    """The request's API key (empty without one); the scheme's case does not matter (RFC 9110)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class Cors:
    """Starlette's CORSMiddleware for `app.state.cors_allow_origins` (empty: no CORS headers),
    made on the first request: the origins are the deployment's, known after import."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self._cors: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origins = getattr(scope["app"].state, "cors_allow_origins", ()) if scope["type"] == "http" else ()
        if not origins:
            await self.app(scope, receive, send)
            return
        if self._cors is None:
            self._cors = CORSMiddleware(self.app, allow_origins=list(origins), allow_methods=["*"],
                                        allow_headers=["*"], expose_headers=["Retry-After", "x-request-id"])
        await self._cors(scope, receive, send)


class Guard:
    """Refuses a request without a configured API key, or declaring a body over the limit."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = _refusal(Request(scope))
            if refusal is not None:
                await refusal.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _refusal(request: Request) -> APIError | None:
    state = request.app.state  # the deployment's copy of `api` that serves the request, not ingress.py's
    keys = getattr(state, "api_keys", ())
    path = request.url.path.removeprefix(request.scope.get("root_path", ""))  # the app's own route
    if keys and path.startswith("/v1/") and bearer(request) not in keys:
        return APIError(401, "invalid or missing API key", "invalid_api_key")
    limiter = getattr(state, "rate_limiter", None)
    if limiter is not None and path.startswith("/v1/"):
        retry_after = limiter.retry_after(bearer(request))
        if retry_after is not None:
            return APIError(429, f"rate limit of {limiter.rpm} requests per minute reached for this API key",
                            "rate_limit_exceeded", retry_after_s=retry_after)
    limit = getattr(state, "max_body_bytes", None)
    size = request.headers.get("content-length", "")
    if limit is not None and size.isdigit() and int(size) > limit:
        return too_large(limit)
    return None


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

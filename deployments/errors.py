"""OpenAI-style error bodies, `{"error": {"message", "type", "code", "param"}}`, for every failure.

A 500 never tells the client what failed inside (exception text, worker internals): the details
go to the log under the request's id (Ray Serve's `x-request-id`, also a response header), and
the client gets a generic message naming that id.
"""

from __future__ import annotations

import contextvars
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from cache_service.client import StorageFull
from deployments.messages import ErrorKind

log = logging.getLogger("hybridserve.errors")
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "conflict_error",
          429: "rate_limit_error", 503: "service_unavailable"}


def error_type(status: int) -> str:
    """OpenAI's error type of a status: any other 4xx is the request's fault (400, 405, 413, 422...),
    any 5xx the server's."""
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, *, retry_after_s: int | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# context_length_exceeded is a 400, as in OpenAI's API; 413 is only a body over the size limit.
_KIND_STATUS = {ErrorKind.INVALID: 400, ErrorKind.TOO_LONG: 400, ErrorKind.CONFLICT: 409,
                ErrorKind.UNAVAILABLE: 503, ErrorKind.INTERNAL: 500,
                ErrorKind.OUTCOME_UNKNOWN: 503, ErrorKind.STORAGE_FULL: 503}


def from_kind(kind: ErrorKind, message: str) -> APIError:
    if kind is ErrorKind.INTERNAL:
        return internal(message)
    status = _KIND_STATUS[kind]
    return APIError(status, message, kind.value, retry_after_s=1 if status == 503 else None)


def internal(details: str) -> APIError:
    """A 500: `details` are logged, never sent."""
    request_id = _request_id.get()
    log.error("internal error in request %s: %s", request_id or "?", details)
    return APIError(500, f"the server failed to process the request (request id {request_id or 'unknown'}); "
                         "the details are in its log", "internal_error")


def busy(conversation_id: str) -> APIError:
    return APIError(409, f"conversation {conversation_id!r} has a turn in flight", "conversation_busy")


def overloaded(why: str) -> APIError:
    return APIError(503, why, "overloaded", retry_after_s=1)


def storage_full() -> APIError:
    return APIError(503, "the conversation store is full: nothing was committed; stored conversations can still be "
                         "read, and new turns are accepted once older conversations expire or are deleted",
                    ErrorKind.STORAGE_FULL.value, retry_after_s=60)


def cache_failed(error: Exception) -> APIError:
    """A cache-service call that failed for the service's own reasons: 503 either way, storage_full
    when its Redis refused the write for memory (retrying soon will not help), else overloaded."""
    if isinstance(error, StorageFull):
        return storage_full()
    return overloaded(f"cache service unavailable: {error}")


class _RequestIdContext:
    """Makes the request's id (set by Serve's proxy) known to `internal()` wherever it runs."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            _request_id.set(dict(scope.get("headers", ())).get(b"x-request-id", b"").decode(errors="replace"))
        await self.app(scope, receive, send)


def install(app: FastAPI) -> None:
    app.add_middleware(_RequestIdContext)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return internal(f"{type(exc).__name__}: {exc}").response()

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        # A union's value fails each member: its type mismatches say less than the other errors.
        first = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0] if errors else {})
        # Field names and list indices; not "body" nor pydantic's names of union members
        where = ".".join(str(p) for p in first.get("loc", ())[1:] if re.fullmatch(r"\w+", str(p)))
        where = (first.get("ctx") or {}).get("field") or where  # a check across fields names its field
        unsupported = first.get("type") in ("extra_forbidden", "unsupported")
        why = "not supported by this server" if unsupported else first.get("msg", "invalid request")
        message = f"{where}: {why}" if where else why
        code = "unsupported_parameter" if unsupported else "invalid_request"
        return APIError(400, message, code, param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return APIError(exc.status_code, str(exc.detail), code).response()

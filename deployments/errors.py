"""OpenAI-style error bodies, `{"error": {"message", "type", "code", "param"}}`, for every failure."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.protocol import ErrorKind

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 422: "invalid_request_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str, *, retry_after_s: int | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.retry_after_s = retry_after_s

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


_KIND_STATUS = {ErrorKind.INVALID: 400, ErrorKind.TOO_LONG: 413, ErrorKind.CONFLICT: 409,
                ErrorKind.UNAVAILABLE: 503, ErrorKind.INTERNAL: 500,
                ErrorKind.OUTCOME_UNKNOWN: 503}


def from_kind(kind: ErrorKind, message: str) -> APIError:
    status = _KIND_STATUS[kind]
    return APIError(status, message, kind.value, retry_after_s=1 if status == 503 else None)


def busy(conversation_id: str) -> APIError:
    return APIError(409, f"conversation {conversation_id!r} has a turn in flight", "conversation_busy")


def overloaded(why: str) -> APIError:
    return APIError(503, why, "overloaded", retry_after_s=1)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return APIError(400, message, "invalid_request", param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return APIError(exc.status_code, str(exc.detail), code).response()

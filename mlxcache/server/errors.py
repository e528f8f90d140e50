"""OpenAI's error object for every failure: `{"error": {message, type, param, code}}`.

Domain errors map to 400 (bad input), 404 (unknown model or route), 429 (queue full);
anything unexpected is a one-line 500 (the traceback goes to the server log only).
"""

from __future__ import annotations

import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mlxcache.errors import ContextLengthError, MlxcacheError, UserInputError

RETRY_AFTER_S = 1
"""What a refused client is told to wait (the queue moves one request at a time)."""


class APIError(Exception):
    """An HTTP error with OpenAI's body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def one_line(text: str) -> str:
    return " ".join(text.split())


def from_domain(exc: MlxcacheError) -> APIError:
    """The HTTP error of a library error raised while preparing or running a request."""
    if isinstance(exc, ContextLengthError):
        return APIError(400, one_line(str(exc)), param="messages", code="context_length_exceeded")
    if isinstance(exc, UserInputError):
        return APIError(400, one_line(str(exc)), code="invalid_value")
    if type(exc).__name__ == "QueueFullError":
        return queue_full(one_line(str(exc)))
    return APIError(500, one_line(str(exc)), type="server_error")


def queue_full(message: str) -> APIError:
    return APIError(
        429,
        message or "too many requests are waiting; retry later",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def from_validation(exc: RequestValidationError) -> APIError:
    """The first problem pydantic found, as `field: reason` (malformed JSON included)."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        reason = ctx.get("error", "invalid JSON")
        return APIError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members show up as loc parts naming types ("str", "list[...]"): drop them.
    loc = [p for p in loc if not p[:1].islower() or "[" not in p]
    param = ".".join(loc) or None
    message = one_line(str(first.get("msg", "invalid value")))
    if param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value")


def install(app: FastAPI) -> None:
    """Route every error through OpenAI's error object."""

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(exc).response()

    @app.exception_handler(MlxcacheError)
    async def _domain(request: Request, exc: MlxcacheError) -> JSONResponse:
        return from_domain(exc).response()

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, one_line(str(exc.detail)), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc)
        message = one_line(f"internal error: {type(exc).__name__}: {exc}")
        return APIError(500, message, type="server_error").response()

"""OpenAI's error object for every failure: `{"error": {message, type, param, code}}`;
on the Anthropic routes (`/v1/messages...`), Anthropic's: `{"type": "error", "error":
{type, message}}` (`APIError.body`).

Domain errors map to 400 (bad input), 404 (unknown model or route), 429 (queue full),
503 (shutting down);
anything unexpected is a one-line 500 (the traceback goes to the server log only).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from mlxcache.errors import (
    ContextLengthError,
    EngineStoppedError,
    FieldError,
    MemoryBusyError,
    MemoryLimitError,
    MlxcacheError,
    ModelLoadError,
    ModelNotServedError,
    QueueFullError,
    UserInputError,
    settings_named,
)
from mlxcache.fileio import loads_json
from mlxcache.request_settings import CHAT, fields_of
from mlxcache.server.log import log_fields

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

    def body(self, path: str = "") -> dict[str, Any]:
        """The error object of the API that `path` belongs to."""
        if anthropic(path):
            kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "")
            return {"type": "error", "error": {"type": kind or self.type, "message": self.message}}
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, path: str = "") -> JSONResponse:
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)


def anthropic(path: str) -> bool:
    """Whether `path` is one of the Anthropic API's routes."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
"""Anthropic's error type for each status (others: `api_error` from 500 on)."""


def one_line(text: str) -> str:
    return " ".join(text.split())


FIELDS = {
    **{row.name: name for name, row in fields_of(CHAT).items()},
    "tool_choice": "tool_choice",
    "strict": "response_format",
}
"""The request field of each setting a library message names (`errors.Worded`): the
error's `param`. Messages keep the library's words, which are the API's."""


def from_domain(exc: MlxcacheError) -> APIError:
    """The HTTP error of a library error raised while preparing or running a request."""
    if isinstance(exc, MemoryLimitError):
        return APIError(400, one_line(str(exc)), code="memory_limit")
    if isinstance(exc, MemoryBusyError):
        return queue_full(one_line(str(exc)), code="memory_busy")
    if isinstance(exc, ModelNotServedError):
        return APIError(404, one_line(str(exc)), param="model", code="model_not_found")
    if isinstance(exc, ModelLoadError):
        return APIError(500, one_line(str(exc)), type="server_error", code="model_load_failed")
    if isinstance(exc, ContextLengthError):
        return APIError(400, one_line(str(exc)), param="messages", code="context_length_exceeded")
    if isinstance(exc, FieldError):
        return APIError(400, one_line(str(exc)), param=exc.param, code=exc.code)
    if isinstance(exc, UserInputError):
        field = next((FIELDS[k] for k in settings_named(exc) if k in FIELDS), None)
        return APIError(400, one_line(str(exc)), param=field, code="invalid_value")
    if isinstance(exc, QueueFullError):
        return queue_full(one_line(str(exc)))
    if isinstance(exc, EngineStoppedError):
        return APIError(503, one_line(str(exc)), type="server_error", code="shutting_down")
    return APIError(500, one_line(str(exc)), type="server_error")


def queue_full(message: str, code: str = "queue_full") -> APIError:
    return APIError(
        429,
        message or "too many requests are waiting; retry later",
        type="rate_limit_error",
        code=code,
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def from_validation(problems: Sequence[Any]) -> APIError:
    """The problem pydantic found deepest in the body (`ValidationError.errors()`), as
    `field: reason`, the field named by its path in the body. A union reports one problem
    per member: the member that got furthest is the one meant; when every member refused
    the value's type at the same place, the reason names each shape wanted."""
    if not problems:
        return APIError(400, "invalid request body")
    paths = [_path(p) for p in problems]
    deepest = max(paths, key=len)  # the first of the deepest
    here = [p for p, at in zip(problems, paths, strict=True) if at == deepest]
    reasons = [one_line(str(p.get("msg", "invalid value"))) for p in here]
    if len(here) > 1 and all(str(p.get("type", "")).endswith("_type") for p in here):
        lead = "Input should be "
        reasons = [" or ".join([reasons[0], *(r.removeprefix(lead) for r in reasons[1:])])]
    param = ".".join(deepest) or None
    message = f"{param}: {reasons[0]}" if param else reasons[0]
    return APIError(400, message, param=param, code="invalid_value")


def _path(problem: Any) -> list[str]:
    # Union members show up in loc as type names ("str", "list[TextPart]", a tagged
    # member's model name): dropped.
    return [str(p) for p in problem.get("loc", ()) if p != "body" and not _is_type_name(p)]


def _is_type_name(part: Any) -> bool:
    return isinstance(part, str) and (part in _TYPE_NAMES or "[" in part or part[:1].isupper())


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


def parse_json(raw: bytes) -> Any:
    """The request body as JSON (whatever its content type: curl -d sends form's).

    Raises:
        APIError: 400 when it is not JSON or not UTF-8.
    """
    try:
        return loads_json(raw)
    except json.JSONDecodeError as exc:
        message = (
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        )
        raise APIError(400, message, code="invalid_json") from None
    except UnicodeDecodeError:
        raise APIError(400, "the request body is not UTF-8", code="invalid_json") from None


def internal(exc: Exception) -> str:
    """A fault of the server's own, in one line."""
    return one_line(f"internal error: {type(exc).__name__}: {exc}")


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) reply was ready."""


CLIENT_CLOSED = 499
"""The status logged for a client gone before its reply (nginx's; nobody receives it)."""


def install(app: FastAPI) -> None:
    """Route every error through OpenAI's error object (its message goes to the log too)."""

    def answer(request: Request, error: APIError) -> JSONResponse:
        log_fields(request.scope)["error"] = error.message
        return error.response(request.url.path)

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(MlxcacheError)
    async def _domain(request: Request, exc: MlxcacheError) -> JSONResponse:
        return answer(request, from_domain(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return answer(request, APIError(exc.status_code, one_line(str(exc.detail)), code=code))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The client gets one line; uvicorn logs the traceback on the server's stderr.
        return answer(request, APIError(500, internal(exc), type="server_error"))

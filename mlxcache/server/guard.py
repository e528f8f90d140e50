"""ASGI middleware around every HTTP request: bearer key, body size limit, request log and
its count for `/metrics`.

The body is read here (bounded) before any route sees it, so an oversized or
unauthorized request never reaches the JSON parser or the engine.
"""

from __future__ import annotations

import hmac
import json
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlxcache.server.errors import APIError
from mlxcache.server.log import RequestLog, log_fields
from mlxcache.server.metrics import Metrics

OPEN_PATHS = frozenset({"/health"})
"""Answered without the API key (a liveness probe; it reveals nothing else)."""


class Guard:
    def __init__(
        self,
        app: ASGIApp,
        log: RequestLog,
        api_key: str | None,
        max_body: int,
        metrics: Metrics | None = None,
    ) -> None:
        self.app = app
        self.log = log
        self.api_key = api_key
        self.max_body = max_body
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        fields = log_fields(scope)
        status = 0

        async def send_logged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = self._authorize(scope)
            body = b""
            if refusal is None:
                body, refusal = await self._read_body(scope, receive)
            if refusal is not None:
                fields["error"] = refusal.message
                await _respond(refusal, send_logged, scope["path"])
                return
            await self.app(scope, _replay(body, receive), send_logged)
        finally:
            if self.metrics is not None:
                self.metrics.request(scope, status or "disconnected")
            self.log.write(
                {
                    "id": fields.pop("id", None),
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status or "disconnected",
                    **fields,
                    "total_s": round(time.perf_counter() - start, 4),
                }
            )

    def _authorize(self, scope: Scope) -> APIError | None:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return None
        # Bytes against bytes: the header as sent, the key as UTF-8 (what clients send for
        # a non-ASCII key; decoding the header as latin-1 first refused every such key).
        # The scheme is case-insensitive (RFC 9110): "bearer KEY" is the same request.
        # Anthropic's clients send the key as `x-api-key`: either header is checked.
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
        key = self.api_key.encode()
        if scheme.lower() == b"bearer" and hmac.compare_digest(given.lstrip(b" "), key):
            return None
        if hmac.compare_digest(headers.get(b"x-api-key", b""), key):
            return None
        return APIError(
            401,
            "missing or wrong API key (send Authorization: Bearer <key>, or x-api-key)",
            type="authentication_error",
            code="invalid_api_key",
        )

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, APIError | None]:
        too_big = APIError(
            413,
            f"the request body is over the server's limit of {self.max_body} bytes",
            code="request_too_large",
        )
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return b"", too_big
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the real channel (so a later disconnect is still seen)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(error: APIError, send: Send, path: str) -> None:
    body = json.dumps(error.body(path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})

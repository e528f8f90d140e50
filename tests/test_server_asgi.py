"""The ASGI app called directly with a stand-in worker: refusals that a real engine would
only give under load (429) or that need odd framing (a chunked body over the limit)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Callable
from typing import Any

import pytest

from mlxcache.engine import Engine, Request
from mlxcache.errors import EngineStoppedError, QueueFullError
from mlxcache.events import Event
from mlxcache.model import LoadedModel
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog


class FullWorker:
    """A worker whose queue is always full."""

    waiting = 3

    def submit(self, request: Request, sink: Callable[[Event], None]) -> Any:
        raise QueueFullError("3 requests are already waiting")

    def warm(self, tokens: list[int]) -> None:
        raise AssertionError("nothing finished, nothing to warm")

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        raise AssertionError("not used here")


def call(
    app: Any, path: str, chunks: list[bytes], headers: dict[str, str]
) -> tuple[int, dict[str, str], Any]:
    sent: list[dict[str, Any]] = []
    incoming = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
        for i, c in enumerate(chunks)
    ]

    async def receive() -> dict[str, Any]:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "query_string": b"",
    }
    asyncio.run(app(scope, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    head = {k.decode(): v.decode() for k, v in start["headers"]}
    return start["status"], head, json.loads(body)


@pytest.fixture
def app(tiny: LoadedModel) -> Any:
    log = RequestLog(stream=io.StringIO())
    return create_app(Engine(tiny), FullWorker(), Settings(tiny.name, max_body=1024), log)


def test_a_full_queue_is_429_with_retry_after(app: Any, tiny: LoadedModel) -> None:
    body = json.dumps({"model": tiny.name, "messages": [{"role": "user", "content": "hi"}]})
    status, headers, doc = call(app, "/v1/chat/completions", [body.encode()], {})
    assert (status, headers["retry-after"]) == (429, "1")
    assert doc == {
        "error": {
            "message": "3 requests are already waiting",
            "type": "rate_limit_error",
            "param": None,
            "code": "queue_full",
        }
    }


def test_a_chunked_body_over_the_limit_is_413(app: Any) -> None:
    status, _, doc = call(app, "/v1/completions", [b"{" + b" " * 600, b" " * 600 + b"}"], {})
    assert status == 413 and doc["error"]["code"] == "request_too_large"
    status, _, _ = call(app, "/v1/completions", [b"{}"], {"Content-Length": "5000"})
    assert status == 413


class StoppingWorker(FullWorker):
    """A worker that is shutting down."""

    waiting = 0

    def submit(self, request: Request, sink: Callable[[Event], None]) -> Any:
        raise EngineStoppedError("the engine is shutting down")


def test_a_request_during_shutdown_is_503(tiny: LoadedModel) -> None:
    log = RequestLog(stream=io.StringIO())
    app = create_app(Engine(tiny), StoppingWorker(), Settings(tiny.name, max_body=1024), log)
    body = json.dumps({"model": tiny.name, "messages": [{"role": "user", "content": "hi"}]})
    status, _headers, doc = call(app, "/v1/chat/completions", [body.encode()], {})
    assert status == 503
    assert doc == {
        "error": {
            "message": "the engine is shutting down",
            "type": "server_error",
            "param": None,
            "code": "shutting_down",
        }
    }

"""The ASGI app called directly with a stand-in worker: refusals that a real engine would
only give under load (429) or that need odd framing (a chunked body over the limit)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import json
import threading
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import pytest
from asgi import acall

from mlxcache.engine import Engine, Request
from mlxcache.errors import EngineStoppedError, QueueFullError
from mlxcache.events import Done, Event, Result, Stats, Token
from mlxcache.model import LoadedModel
from mlxcache.server import service as server_app
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
    reply = asyncio.run(acall(app, "POST", path, chunks, headers))
    return reply.status, reply.headers, reply.json()


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


class QueuedWorker(FullWorker):
    """A full queue whose engine answers reports (idle, on the caller's thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        return fn(self.engine)


def test_metrics_show_the_queue_depth_and_refusals(tiny: LoadedModel) -> None:
    engine = Engine(tiny)
    log = RequestLog(stream=io.StringIO())
    app = create_app(engine, QueuedWorker(engine), Settings(tiny.name), log)
    body = json.dumps({"model": tiny.name, "messages": [{"role": "user", "content": "hi"}]})
    assert call(app, "/v1/chat/completions", [body.encode()], {})[0] == 429
    text = asyncio.run(acall(app, "GET", "/metrics")).body.decode().splitlines()
    assert 'mlxcache_requests_total{path="/v1/chat/completions",status="429"} 1' in text
    assert "mlxcache_requests_waiting 3" in text
    assert "mlxcache_cache_hits_total 0" in text  # no cache: nothing to report, all zero


class HeldWorker:
    """A worker whose request runs only once the test lets it (`go`): until then the
    stream waits, as one queued behind other requests does."""

    waiting = 0

    def __init__(self) -> None:
        self.go = threading.Event()

    def submit(self, request: Request, sink: Callable[[Event], None]) -> Any:
        def run() -> None:
            self.go.wait(timeout=300)
            sink(Token(0, 97, "a"))
            sink(Done(0, Result("a", [97], "length", Stats(prompt_tokens=3, generated_tokens=1))))

        threading.Thread(target=run, daemon=True).start()
        return SimpleNamespace(cancel=lambda: None)

    def warm(self, tokens: list[int]) -> None:
        return None

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        raise AssertionError("not used here")


def test_a_waiting_stream_gets_keepalive_comments(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a stream has nothing to send, SSE comment lines keep it alive; the request
    is let go only once one has come, so the test waits on no clock."""
    monkeypatch.setattr(server_app, "KEEPALIVE_S", 0.01)
    worker = HeldWorker()
    app = create_app(Engine(tiny), worker, Settings(tiny.name), RequestLog(stream=io.StringIO()))
    body = json.dumps(
        {
            "model": tiny.name,
            "stream": True,
            "max_tokens": 1,
            "messages": [{"role": "user", "content": "hi"}],
        }
    ).encode()

    def let_go(message: dict[str, Any]) -> None:
        if server_app.KEEPALIVE.encode() in message.get("body", b""):
            worker.go.set()

    reply = asyncio.run(acall(app, "POST", "/v1/chat/completions", [body], on_send=let_go))
    stream = reply.body.decode()
    first_keepalive = stream.index(server_app.KEEPALIVE)
    assert first_keepalive < stream.index('"content": "a"')  # before the reply's text
    assert stream.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize("steps", range(6))
def test_a_stream_cancelled_as_its_events_end_leaves_no_task_exception(steps: int) -> None:
    """The client leaves (its handler is cancelled) while the next event is being read,
    `steps` loop turns in: at some of them that read has just ended with
    StopAsyncIteration. Its outcome is retrieved whatever the moment, so asyncio logs
    nothing ("Task exception was never retrieved")."""
    logged: list[str] = []

    async def events() -> AsyncIterator[str]:
        yield "a"

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda _loop, context: logged.append(context["message"])
        )
        kept = server_app.kept_alive(events())
        assert await anext(kept) == "a"
        handler = asyncio.ensure_future(anext(kept))
        for _ in range(steps):
            await asyncio.sleep(0)
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await handler
        await kept.aclose()
        gc.collect()  # a future's unread exception is logged when it is collected
        await asyncio.sleep(0)

    asyncio.run(main())
    assert logged == []

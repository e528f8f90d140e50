"""The server's faults: bad bodies and schemas are an HTTP 400 naming the field, a schema being prepared stalls no other client, and API keys compare as UTF-8. The server runs in-process, over its ASGI app."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from mlxcache.engine import Engine
from mlxcache.model import LoadedModel
from mlxcache.modes import json_mode
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.worker import EngineWorker

LONG_WAIT_S = 300
"""How long a test waits for what must happen at once (only reached when it fails)."""


def wide_schema(properties: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(properties)},
    }


SURROGATE = "weather \\ud800 in Paris?"  # as JSON text: an escape of half a UTF-16 pair


class Client:
    """Requests to the ASGI app in this process (several may run at once in one loop)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def call(
        self, path: str, doc: Any = None, headers: dict[str, bytes] | None = None
    ) -> tuple[int, Any]:
        body = b"" if doc is None else json.dumps(doc).encode()
        sent: list[dict[str, Any]] = []
        answered = asyncio.Event()
        read = False

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()  # the client stays until its reply is complete
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered.set()

        scope = {
            "type": "http",
            "method": "GET" if doc is None else "POST",
            "path": path,
            "headers": [(k.lower().encode(), v) for k, v in (headers or {}).items()],
            "query_string": b"",
        }
        await self.app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return start["status"], json.loads(data)

    def __call__(self, path: str, doc: Any = None, **headers: bytes) -> tuple[int, Any]:
        return asyncio.run(self.call(path, doc, headers))


@pytest.fixture
def engine(tiny: LoadedModel) -> Iterator[tuple[Engine, EngineWorker]]:
    engine = Engine(tiny)
    with EngineWorker(engine) as worker:
        yield engine, worker


def serve(tiny: LoadedModel, engine: tuple[Engine, EngineWorker], **settings: Any) -> Client:
    log = RequestLog(stream=io.StringIO())
    return Client(create_app(*engine, Settings(tiny.name, **settings), log))


def chat_body(tiny: LoadedModel, content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {
        "model": tiny.name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        **fields,
    }


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> Any:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return 400, {"error": error}


def test_a_schema_being_prepared_does_not_stall_another_client(
    tiny: LoadedModel, engine: tuple[Engine, EngineWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = serve(tiny, engine)
    entered, release = threading.Event(), threading.Event()
    check = json_mode.check_schema

    def held(*args: Any, **kwargs: Any) -> Any:
        """The schema check of the first client, held until the second has its reply."""
        entered.set()
        release.wait(LONG_WAIT_S)
        return check(*args, **kwargs)

    monkeypatch.setattr(json_mode, "check_schema", held)
    schema = {"name": "s", "schema": {"type": "string", "maxLength": 3}}
    slow_body = chat_body(tiny, response_format={"type": "json_schema", "json_schema": schema})

    async def two_clients() -> tuple[tuple[int, Any], tuple[int, Any]]:
        slow = asyncio.ensure_future(client.call("/v1/chat/completions", slow_body))
        assert await asyncio.to_thread(entered.wait, LONG_WAIT_S)
        try:
            quick = await asyncio.wait_for(
                client.call("/v1/chat/completions", chat_body(tiny)), LONG_WAIT_S
            )
        finally:
            release.set()
        return quick, await slow

    quick, slow = asyncio.run(two_clients())
    assert quick[0] == 200 and quick[1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert slow[0] == 200, slow


def test_server_faults_are_400(tiny: LoadedModel, engine: tuple[Engine, EngineWorker]) -> None:
    client = serve(tiny, engine)
    path = "/v1/chat/completions"
    body = chat_body(tiny, content=SURROGATE.replace("\\ud800", "\ud800"))
    at = json.dumps(body).index("\\ud800") + 1
    assert client(path, body) == invalid(
        "the request body is not valid JSON: a lone surrogate in a string (not valid text) "
        f"at line 1 column {at}",
        code="invalid_json",
    )
    huge = {"type": "array", "minItems": 10**20}
    fmt = {"type": "json_schema", "json_schema": {"name": "h", "schema": huge}}
    assert client(path, chat_body(tiny, response_format=fmt)) == invalid(
        "schema has a number constrained decoding cannot read at /minItems (integers must "
        "fit in 64 bits, numbers must be finite)"
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": wide_schema(2_100)}}
    assert client(path, chat_body(tiny, response_format=fmt)) == invalid(
        "schema is too large: more than 2,000 JSON objects (split or simplify it)"
    )
    for field, value, kind in [
        ("stream", "yes", "boolean"),
        ("max_tokens", "5", "integer"),
        ("seed", 1.5, "integer"),
        ("temperature", "0", "number"),
    ]:
        assert client(path, chat_body(tiny, **{field: value})) == invalid(
            f"{field}: Input should be a valid {kind}", param=field
        ), field


def test_an_api_key_with_non_ascii_characters_is_compared_as_utf8(
    tiny: LoadedModel, engine: tuple[Engine, EngineWorker]
) -> None:
    client = serve(tiny, engine, api_key="clé-ünïcode")
    status, doc = client("/v1/models", authorization="Bearer clé-ünïcode".encode())
    assert (status, doc["data"][0]["id"]) == (200, tiny.name)
    for wrong in ("Bearer clé-ünïcod".encode(), "Bearer clé-ünïcode".encode("latin-1")):
        assert client("/v1/models", authorization=wrong)[0] == 401


def test_a_tiny_temperature_in_the_server_is_greedy(
    tiny: LoadedModel, engine: tuple[Engine, EngineWorker]
) -> None:
    client = serve(tiny, engine)
    replies = [
        client("/v1/chat/completions", chat_body(tiny, temperature=t, seed=1, max_tokens=12))
        for t in (0, 1e-310, 1e-39)
    ]
    assert all(status == 200 for status, _ in replies)
    texts = {doc["choices"][0]["message"]["content"] for _, doc in replies}
    assert len(texts) == 1 and texts != {""}

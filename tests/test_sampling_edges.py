"""Sampling at its numeric edges (a temperature whose inverse overflows, a top-p that rounds to 0) is greedy, in the CLI and in the server."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mlxcache.engine import Engine
from mlxcache.model import LoadedModel
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.worker import EngineWorker
from mlxcache_cli.main import app as cli

runner = CliRunner()


def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(cli, list(args), input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.stdout, result.stderr


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


@pytest.mark.parametrize(
    "edge",
    [
        ["--temp", "1e-39", "--seed", "1"],  # 1/T overflows float32
        ["--temp", "1e-310", "--seed", "2"],  # 1/T overflows float64
        ["--temp", "1", "--top-p", "1e-300", "--seed", "3"],  # top-p rounds to 0
    ],
)
def test_sampling_at_its_edges_is_greedy(
    edge: list[str], tiny_gguf: Path, cache_root: Path
) -> None:
    base = ["generate", "--raw", "Once upon a time", "-m", str(tiny_gguf), "-n", "12"]
    greedy = run(*base, "--cache-disk", "0")
    assert greedy[0] == 0 and greedy[1]
    assert run(*base, "--cache-disk", "0", *edge)[:2] == greedy[:2]


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

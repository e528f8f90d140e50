"""Requests to an ASGI app in this process: the exact status, headers and bytes it sends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[str]:
        """The `data:` payloads of a server-sent event stream."""
        lines = self.body.decode().split("\n")
        return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


async def acall(
    app: Any,
    method: str,
    path: str,
    chunks: list[bytes] | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    on_send: Callable[[dict[str, Any]], None] | None = None,
) -> Reply:
    """One request: its body sent as `chunks`; the client stays until the reply is complete
    (then disconnects), as a real one does. `on_send` sees each message as it is sent."""
    parts = chunks or [b""]
    incoming = [
        {"type": "http.request", "body": c, "more_body": i < len(parts) - 1}
        for i, c in enumerate(parts)
    ]
    sent: list[dict[str, Any]] = []
    answered = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if on_send is not None:
            on_send(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered.set()

    raw = {k.lower(): v if isinstance(v, bytes) else v.encode() for k, v in (headers or {}).items()}
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.encode(), v) for k, v in raw.items()],
        "query_string": b"",
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    head = {k.decode(): v.decode() for k, v in start["headers"]}
    return Reply(start["status"], head, body)


def call(
    app: Any,
    method: str,
    path: str,
    doc: Any = None,
    headers: Mapping[str, str | bytes] | None = None,
) -> Reply:
    """`acall` with `doc` as the JSON body (none when None)."""
    chunks = None if doc is None else [json.dumps(doc).encode()]
    return asyncio.run(acall(app, method, path, chunks, headers))

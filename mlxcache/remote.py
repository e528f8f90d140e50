"""A running `mlxcache serve` as the engine of a one-shot command (`--server URL`).

A command sent to a server pays no model import or load and resumes from the server's
memory tier. It must reply exactly as it would in-process, so the server publishes its
`identity` on its model card ("mlxcache": model name, family, a digest of its source and a
stamp of its files, model key, block size, cache on or off, batch exactness, version; never
a local path) and the client compares it with what the command would load (`differences`)
before sending anything.

Only the standard library is used here (http.client, json): a command that goes to a server
must start fast, so nothing of mlx_lm, transformers or an HTTP client package is imported.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mlxcache.config import ENV_API_KEY
from mlxcache.errors import (
    GenerationError,
    QueueFullError,
    ServerError,
    Setting,
    UserInputError,
    Worded,
)
from mlxcache.events import Done, Event, Result, Stats, Token
from mlxcache.wire import USAGE_FIELD, model_source, published

if TYPE_CHECKING:
    from mlxcache.modes.tools import ToolChoice
    from mlxcache.sampling import SamplingParams

CONNECT_TIMEOUT_S = 10.0
"""Bound on connecting (a host that drops packets); a reply itself may take any time."""


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a command would run in-process: its model spec and cache settings."""

    spec: str
    block_size: int
    cache: bool

    def identity(self) -> dict[str, Any]:
        from mlxcache import __version__

        return {
            **published(self.spec),
            "block_size": self.block_size,
            "cache": self.cache,
            "exact": True,
            "version": __version__,
        }


_WHAT = {
    "digest": "model",
    "stamp": "model files (changed since the server loaded them)",
    "block_size": "block size",
    "cache": "prompt cache on",
    "exact": "exact replies (not serve --batch-inexact)",
    "version": "mlxcache version",
}


def differences(found: dict[str, Any], wanted: Wanted) -> list[str]:
    """What differs between a server's identity and what the command would run, as
    `name: server's vs this command's` phrases (empty: the server replies as in-process).
    Another model is named: the server's by its name, this command's by what it loads."""
    mine = wanted.identity()
    out = []
    for name, what in _WHAT.items():
        if name == "stamp" and found.get("digest") != mine["digest"]:
            continue  # another model: its files' stamp says nothing more
        if found.get(name) == mine[name]:
            continue
        if name == "digest":
            theirs, ours = found.get("model"), model_source(wanted.spec)["source"]
        else:
            theirs, ours = found.get(name), mine[name]
        out.append(f"{what}: {theirs} (server) vs {ours} (this command)")
    return out


class Server:
    """A client of one `mlxcache serve` at `url` (http://host:port); one connection.

    Raises (every method):
        ServerError: the server cannot be reached or answers what no server of ours would.
        UserInputError: the server refused the request as given (4xx, its message).
        QueueFullError: the server's queue is full (429).
        GenerationError: the request failed while running (5xx, or an error event).
    """

    def __init__(self, url: str, api_key: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserInputError(f"--server must be an http://HOST:PORT address, got {url!r}")
        self.url = url.rstrip("/")
        self._base = parts.path.rstrip("/")
        self._key = api_key
        try:
            port = parts.port
        except ValueError as exc:
            raise UserInputError(f"--server {url!r}: {exc}") from exc
        kind = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        self._conn = kind(parts.hostname, port, timeout=CONNECT_TIMEOUT_S)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        headers = {"Accept": "application/json, text/event-stream"}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        data = None
        if body is not None:
            data = json.dumps(body, ensure_ascii=False).encode()
            headers["Content-Type"] = "application/json"
        try:
            if self._conn.sock is None:
                self._conn.connect()
                assert self._conn.sock is not None
                self._conn.sock.settimeout(None)  # a long prefill sends nothing for a while
            self._conn.request(method, self._base + path, data, headers)
            response = self._conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self._conn.close()
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise ServerError(f"cannot reach the server at {self.url}: {reason}") from exc
        except BaseException:  # Ctrl-C mid-exchange: the connection cannot be reused
            self._conn.close()
            raise
        if response.status >= 400:
            raise self._refusal(response)
        return response

    def _refusal(self, response: Any) -> Exception:
        try:
            message = json.loads(response.read())["error"]["message"]
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
            message = f"HTTP {response.status} {response.reason}"
        if response.status == 401:
            return UserInputError(f"the server at {self.url} needs its API key: set ${ENV_API_KEY}")
        if response.status == 429:
            return QueueFullError(f"the server at {self.url} is busy: {message}")
        if response.status < 500:
            return UserInputError(message)
        return GenerationError(message)

    def get(self, path: str) -> Any:
        """The JSON document at `path`."""
        return self._json(self._send("GET", path, None))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        """The JSON reply to `body` (not streamed)."""
        return self._json(self._send("POST", path, body))

    def _json(self, response: Any) -> Any:
        try:
            return json.loads(response.read())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self._conn.close()
            raise ServerError(f"the server at {self.url} sent no JSON reply: {exc}") from exc

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The server-sent events of a streamed reply to `body`, as they come, until
        `[DONE]`; leaving early closes the connection (the server cancels the request)."""
        response = self._send("POST", path, {**body, "stream": True})
        done = False
        try:
            while True:
                try:
                    line = response.readline()
                    if line.rstrip(b"\r\n") == b"data: [DONE]":
                        # Read the body to its end: the connection then serves the next
                        # request (a chat's next turn).
                        response.read()
                        done = True
                        return
                except (OSError, http.client.HTTPException) as exc:
                    raise ServerError(f"the server at {self.url} stopped replying: {exc}") from exc
                if not line:
                    raise ServerError(f"the server at {self.url} ended the reply early")
                text = line.decode("utf-8").rstrip("\r\n")
                if not text.startswith("data: "):
                    continue  # blank separators and keepalive comments
                event = json.loads(text[len("data: ") :])
                if "error" in event:
                    raise GenerationError(event["error"].get("message") or "the request failed")
                yield event
        finally:
            if not done:  # interrupted or failed: a half-read response cannot be reused
                self._conn.close()

    def card(self, model: str | None = None) -> dict[str, Any]:
        """The model card of the server's model, with its identity (`identity`).

        Raises:
            ServerError: the server publishes no identity (not mlxcache, or too old).
        """
        cards = self.get("/v1/models").get("data") or []
        if len(cards) != 1 or "mlxcache" not in cards[0]:
            raise ServerError(
                f"the server at {self.url} is not an mlxcache server this version can use"
            )
        card: dict[str, Any] = cards[0]
        return card


def usage_of(usage: dict[str, Any] | None, url: str) -> dict[str, Any]:
    """The request's own stats, token ids, raw text and finish reason from a usage object
    (asked for with `USAGE_FIELD`).

    Raises:
        ServerError: the server did not send them.
    """
    extra = (usage or {}).get("mlxcache")
    if not isinstance(extra, dict):
        raise ServerError(f"the server at {url} sent no stats for the request")
    return extra


class ChatRunner:
    """A chat's turns (`modes.chat.Runner`) as streamed chat completions on `server`, whose
    model is `model`: the content as it comes (a thinking section apart from the answer, as
    the server sends it), then `Done` with the request's own result from the usage. Leaving
    early closes the connection, and the server cancels the request. `fields`: more of
    each request's fields (e.g. its `draft`)."""

    def __init__(self, server: Server, model: str, fields: dict[str, Any] | None = None) -> None:
        self.server = server
        self.model = model
        self.fields = fields or {}

    def reply(
        self, messages: list[dict[str, str]], params: SamplingParams, stop: tuple[str, ...]
    ) -> Iterator[Event]:
        body = {
            "model": self.model,
            **sampling_fields(params),  # now: a setting no request carries raises here
            **self.fields,
            "stop": list(stop),
            "messages": messages,
            "stream_options": {"include_usage": True},
        }
        return self._events(body)

    def _events(self, body: dict[str, Any]) -> Iterator[Event]:
        usage = None
        for event in self.server.stream("/v1/chat/completions", body):
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                for key in ("reasoning", "content"):
                    if delta.get(key):
                        yield Token(0, -1, delta[key])  # text only: the ids come in the usage
            usage = event.get("usage") or usage
        yield Done(0, result_of(usage_of(usage, self.server.url)))


def result_of(extra: dict[str, Any]) -> Result:
    """The `Result` a request's usage tells (`usage_of`)."""
    known = {f.name for f in fields(Stats)}
    stats = Stats(**{k: v for k, v in extra["stats"].items() if k in known})
    return Result(extra["text"], list(extra["tokens"]), extra["finish_reason"], stats)


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """Every sampling field of `params` as request fields (the server's own defaults play
    no part), and the flag that asks for the request's usage.

    Raises:
        UserInputError: a setting no request can carry (`repetition_context`).
    """
    from mlxcache.sampling import SamplingParams

    if params.repetition_context != SamplingParams().repetition_context:
        raise UserInputError(
            Worded(Setting("repetition_context"), " runs in-process only (no request sets it)")
        )
    return {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        USAGE_FIELD: True,
    }


def tool_choice_field(choice: ToolChoice) -> str | dict[str, Any]:
    """A tool choice as the request's `tool_choice`."""
    if choice.name is None:
        return choice.mode
    return {"type": "function", "function": {"name": choice.name}}

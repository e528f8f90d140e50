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

import contextlib
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from mlxcache.config import ENV_API_KEY, ENV_SERVER_DEADLINE, ENV_SERVER_TIMEOUT
from mlxcache.errors import (
    GenerationError,
    QueueFullError,
    ServerError,
    UserInputError,
)
from mlxcache.events import Done, Event, Result, Stats, Token
from mlxcache.request_spec import RequestSpec, to_wire
from mlxcache.wire import model_source, published

if TYPE_CHECKING:
    from mlxcache.modes.tools import ToolCall, ToolChoice

CONNECT_TIMEOUT_S = 10.0
"""Bound on connecting (a host that drops packets)."""
IDLE_TIMEOUT_S = 120.0
"""Bound on a silence of the server (`$MLXCACHE_SERVER_TIMEOUT`): every reply is streamed,
and a server of ours sends a keep-alive comment every 10 s while a request waits or
prefills, so a server silent this long is stuck or is not one of ours."""
MAX_LINE = 16 << 20
"""The longest line of a streamed reply read (a server's event: far less)."""
MAX_BODY = 64 << 20
"""The largest JSON body read."""


def _seconds(name: str, default: float | None) -> float | None:
    """A positive number of seconds from the environment variable `name`.

    Raises:
        UserInputError: it is set but is not one.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise UserInputError(f"${name} must be a number of seconds > 0, got {raw!r}")
    return value


@dataclass(frozen=True, slots=True)
class Wanted:
    """What a command would run in-process: its model spec and cache settings."""

    spec: str
    block_size: int
    cache: bool
    kv: str = "full precision"
    """The KV quantization (`wire.kv_label`)."""
    tailoring: str = ""
    """Its adapter and chat template (`wire.tailoring`; "" for neither)."""

    def identity(self) -> dict[str, Any]:
        from mlxcache import __version__

        return {
            **published(self.spec),
            "block_size": self.block_size,
            "cache": self.cache,
            "kv": self.kv,
            "tailoring": self.tailoring,
            "exact": True,
            "version": __version__,
        }


_WHAT = {
    "digest": "model",
    "stamp": "model files (changed since the server loaded them)",
    "block_size": "block size",
    "cache": "prompt cache on",
    "kv": "KV quantization (--kv-bits)",
    "tailoring": "adapter and chat template (--adapter, --chat-template)",
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
        elif name == "tailoring":  # "": none at all
            theirs, ours = found.get(name) or "none", mine[name] or "none"
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
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise UserInputError(f"--server {url!r}: {exc}") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserInputError(f"--server must be an http://HOST:PORT address, got {url!r}")
        if api_key is not None and any(c in api_key for c in "\r\n\0"):
            raise UserInputError(f"${ENV_API_KEY} must be one line (it holds a line break)")
        self.url = url.rstrip("/")
        self._base = parts.path.rstrip("/")
        self._key = api_key
        self._idle = _seconds(ENV_SERVER_TIMEOUT, IDLE_TIMEOUT_S)
        self._deadline_s = _seconds(ENV_SERVER_DEADLINE, None)
        self._until: float | None = None  # the running request's deadline (monotonic)
        self._timer: threading.Timer | None = None  # cuts the request off at `_until`
        self._expired = False  # the deadline cut the running request's socket
        kind = (
            http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        )
        self._conn = kind(parts.hostname, port, timeout=CONNECT_TIMEOUT_S)

    def close(self) -> None:
        self._disarm()
        self._conn.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait(self) -> None:
        """Bound the next read: by the idle timeout, and by what is left of the deadline.

        Raises:
            ServerError: the deadline has passed.
        """
        timeout = self._idle
        if self._until is not None:
            left = self._until - time.monotonic()
            if left <= 0:
                raise self._late()
            timeout = left if timeout is None else min(timeout, left)
        if self._conn.sock is not None:
            self._conn.sock.settimeout(timeout)

    def _arm(self) -> None:
        """Shut the socket down when the deadline passes, on the wall clock: a read blocked
        in the kernel wakes then, where a per-read timeout never fires (a server trickling
        a byte every second) and the checks between reads come too late."""
        self._disarm()
        if self._until is None or self._conn.sock is None:
            return
        left = max(0.0, self._until - time.monotonic())
        self._timer = threading.Timer(left, self._cut, (self._conn.sock,))
        self._timer.daemon = True
        self._timer.start()

    def _cut(self, sock: socket.socket) -> None:
        if threading.current_thread() is not self._timer:
            return  # disarmed meanwhile: its request ended in time
        self._expired = True
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _past(self) -> bool:
        """Whether the running request's deadline has passed (a read failed or ended
        because the deadline cut it off, or is about to)."""
        return self._expired or (self._until is not None and time.monotonic() >= self._until)

    def _stopped(self, exc: Exception) -> ServerError:
        """The error for a read that failed with `exc`."""
        if isinstance(exc, TimeoutError):
            return self._silent()
        self._conn.close()
        if self._past():
            return self._late()
        return ServerError(f"the server at {self.url} stopped replying: {exc}")

    def _late(self) -> ServerError:
        self._disarm()
        self._conn.close()
        return ServerError(
            f"the server at {self.url} did not finish within ${ENV_SERVER_DEADLINE} "
            f"({self._deadline_s:g} s)"
        )

    def _silent(self) -> ServerError:
        self._conn.close()
        if self._past():
            return self._late()
        return ServerError(
            f"the server at {self.url} sent nothing for {self._idle:g} s "
            f"(${ENV_SERVER_TIMEOUT} sets how long to wait)"
        )

    def _send(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        headers: dict[str, str | bytes] = {"Accept": "application/json, text/event-stream"}
        if self._key:
            # As UTF-8 bytes, as the server compares them (http.client would send latin-1).
            headers["Authorization"] = b"Bearer " + self._key.encode()
        data = None
        if body is not None:
            data = json.dumps(body, ensure_ascii=False).encode()
            headers["Content-Type"] = "application/json"
        self._disarm()
        if self._expired:  # cut as its request ended in time: the socket is shut down
            self._conn.close()
            self._expired = False
        self._until = None if self._deadline_s is None else time.monotonic() + self._deadline_s
        try:
            if self._conn.sock is None:
                self._conn.connect()
            self._arm()
            self._wait()
            self._conn.request(method, self._base + path, data, headers)
            response = self._conn.getresponse()
        except TimeoutError as exc:
            raise self._silent() from exc
        except (OSError, http.client.HTTPException) as exc:
            self._conn.close()
            if self._past():
                raise self._late() from exc
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
            message = json.loads(self._read(response))["error"]["message"]
            if not isinstance(message, str):
                raise TypeError(message)
        except (ServerError, ValueError, KeyError, TypeError):
            message = f"HTTP {response.status} {response.reason}"
        if response.status == 401:
            return UserInputError(f"the server at {self.url} needs its API key: set ${ENV_API_KEY}")
        if response.status == 429:
            return QueueFullError(f"the server at {self.url} is busy: {message}")
        if response.status < 500:
            return UserInputError(message)
        return GenerationError(message)

    def _read(self, response: Any) -> bytes:
        """A whole body, bounded in size and in silence."""
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                self._wait()
                chunk = response.read(1 << 16)
                if not chunk:
                    if self._expired:  # the deadline's cut ended it
                        raise self._late()
                    self._disarm()  # the request is over: the connection may serve the next
                    return b"".join(chunks)
                size += len(chunk)
                if size > MAX_BODY:
                    self._conn.close()
                    raise ServerError(
                        f"the server at {self.url} sent a reply over {MAX_BODY >> 20} MB"
                    )
                chunks.append(chunk)
        except (OSError, http.client.HTTPException) as exc:
            raise self._stopped(exc) from exc

    def get(self, path: str) -> dict[str, Any]:
        """The JSON object at `path`."""
        return self._json(self._send("GET", path, None))

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The chat completion that answers `body`, as a non-streamed reply has it. It is
        streamed (so a silent server is told from a long prefill: `IDLE_TIMEOUT_S`) and put
        together (`chat_reply`)."""
        body = {**body, "stream_options": {"include_usage": True}}
        return chat_reply(self.stream(path, body), self.url)

    def _json(self, response: Any) -> dict[str, Any]:
        raw = self._read(response)
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ServerError(f"the server at {self.url} sent no JSON reply: {exc}") from exc
        return _dict(doc, self.url, "its reply")

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The chunks of a streamed completion (chat or text) answering `body`, as they
        come, until `[DONE]`, each of the shape `chunk` checks (so every command reads them
        without checking again); leaving early closes the connection (the server cancels
        the request)."""
        response = self._send("POST", path, {**body, "stream": True})
        done = False
        try:
            while True:
                try:
                    self._wait()
                    line = response.readline(MAX_LINE + 1)
                    if self._expired:  # the deadline's cut ended the read, maybe mid-line
                        raise self._late()
                    if line.rstrip(b"\r\n") == b"data: [DONE]":
                        # Read the body to its end: the connection then serves the next
                        # request (a chat's next turn).
                        self._read(response)
                        done = True
                        return
                except (OSError, http.client.HTTPException) as exc:
                    raise self._stopped(exc) from exc
                if not line:
                    raise ServerError(f"the server at {self.url} ended the reply early")
                if len(line) > MAX_LINE:
                    raise ServerError(
                        f"the server at {self.url} sent a line over {MAX_LINE >> 20} MB"
                    )
                event = self._event(line)
                if event is not None:
                    yield chunk(event, self.url)
        finally:
            self._disarm()
            if not done:  # interrupted or failed: a half-read response cannot be reused
                self._conn.close()

    def _event(self, line: bytes) -> dict[str, Any] | None:
        """A `data:` line's event (None for blank lines and comments), checked.

        Raises:
            GenerationError: an error event (the request failed on the server).
            ServerError: not an event of ours.
        """
        try:
            text = line.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            raise ServerError(f"the server at {self.url} sent an event that is not UTF-8") from exc
        if not text.startswith("data: "):
            return None  # blank separators and keepalive comments
        try:
            event = json.loads(text[len("data: ") :])
        except ValueError as exc:
            raise ServerError(f"the server at {self.url} sent an event that is not JSON") from exc
        event = _dict(event, self.url, "an event")
        if "error" in event:
            error = event["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise GenerationError(str(message or "the request failed"))
        return event

    def card(self, model: str | None = None) -> dict[str, Any]:
        """The model card of the server's model, with its identity (`identity`).

        Raises:
            ServerError: the server publishes no identity (not mlxcache, or too old).
        """
        cards = self.get("/v1/models").get("data") or []
        if isinstance(cards, list):  # an alias's card (`alias_of`) repeats its model's
            cards = [c for c in cards if not (isinstance(c, dict) and "alias_of" in c)]
        if (
            not isinstance(cards, list)
            or len(cards) != 1
            or not isinstance(cards[0], dict)
            or not isinstance(cards[0].get("mlxcache"), dict)
        ):
            raise ServerError(
                f"the server at {self.url} is not an mlxcache server this version can use"
            )
        card: dict[str, Any] = cards[0]
        return card


def chat_reply(events: Iterable[dict[str, Any]], url: str) -> dict[str, Any]:
    """A streamed chat completion's chunks, each checked (`chunk`, as `Server.stream`
    yields them), put together as the non-streamed reply has it: the message's content,
    reasoning and tool calls, finish reason, usage.

    Raises:
        ServerError: a call of another shape (`url`: the server that sent it).
    """
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    finish, usage = None, None
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            for key in ("content", "reasoning"):
                if delta.get(key) is not None:
                    message[key] = message.get(key, "") + delta[key]
            for call in delta.get("tool_calls") or ():
                _add_call(calls, _dict(call, url, "a call"), url)
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    if calls:
        if not all(c["function"]["name"] for c in calls.values()):
            raise ServerError(f"the server at {url} sent a call without a name")
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return {"choices": [{"message": message, "finish_reason": finish}], "usage": usage}


_TEXTS = ("content", "reasoning", "text", "finish_reason")
"""A chunk's fields, in a choice or its delta, that are text when present."""


def chunk(event: dict[str, Any], url: str) -> dict[str, Any]:
    """`event`, once it has a completion chunk's shape: `choices` a list of objects, each
    one's `delta` an object, their texts strings, `tool_calls` a list, `usage` an object
    (each may be absent or null). The one check of a streamed chunk, for every command.

    Raises:
        ServerError: a chunk of another shape (`url`: the server that sent it).
    """
    for choice in _list(event.get("choices"), url, "choices"):
        choice = _dict(choice, url, "a choice")
        delta = choice.get("delta")
        parts = [choice, _dict(delta, url, "a delta") if delta is not None else {}]
        if any(not isinstance(p.get(k), str | None) for p in parts for k in _TEXTS):
            raise ServerError(f"the server at {url} sent a choice whose text is not a string")
        _list(parts[1].get("tool_calls"), url, "tool_calls")
    if not isinstance(event.get("usage"), dict | None):
        raise ServerError(f"the server at {url} sent a usage that is not a JSON object")
    return event


def _add_call(calls: dict[int, dict[str, Any]], call: dict[str, Any], url: str) -> None:
    """One `tool_calls` entry of a delta into the calls so far: a call's id and name come
    first and its arguments in pieces (OpenAI's streaming), or all at once; an entry
    without an index is the next call."""
    function = _dict(call.get("function"), url, "a call")
    index = call.get("index", len(calls))
    pieces = [function.get(k) for k in ("name", "arguments")]
    if not isinstance(index, int) or not all(p is None or isinstance(p, str) for p in pieces):
        raise ServerError(f"the server at {url} sent a call in another shape")
    got = calls.setdefault(
        index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
    )
    if isinstance(call.get("id"), str):
        got["id"] = call["id"]
    for key, piece in zip(("name", "arguments"), pieces, strict=True):
        got["function"][key] += piece or ""


def reply_calls(message: dict[str, Any], extra: dict[str, Any], url: str) -> tuple[ToolCall, ...]:
    """The calls of a reply `Server.post` put together, each read as a `ToolCall`: the
    first `tool_calls` of them, as the request's usage (`usage_of`) counts the answer's;
    calls the stream began beyond those (cut off, unreadable) are not the reply's.

    Raises:
        ServerError: a call's arguments are not a JSON object.
    """
    # Here, not at the top: the tools mode brings the schema and grammar code, which a
    # plain `generate --server` never needs (start-up, issue 22).
    from mlxcache.modes.tools import ToolCall, call_arguments

    sent = message.get("tool_calls") or []
    kept = extra.get("tool_calls")
    out = []
    for call in sent[: kept if isinstance(kept, int) else len(sent)]:
        args = call_arguments(call["function"]["arguments"])
        if isinstance(args, str):
            raise ServerError(f"the server at {url} sent a call whose {args}")
        out.append(ToolCall(call["function"]["name"], args))
    return tuple(out)


def usage_of(usage: dict[str, Any] | None, url: str) -> dict[str, Any]:
    """The request's own stats, token ids, raw text and finish reason from a usage object
    (asked for with `USAGE_FIELD`).

    Raises:
        ServerError: the server did not send them.
    """
    extra = usage.get("mlxcache") if isinstance(usage, dict) else None
    if not isinstance(extra, dict):
        raise ServerError(f"the server at {url} sent no stats for the request")
    stats, tokens = extra.get("stats"), extra.get("tokens")
    well_formed = (
        isinstance(stats, dict)
        and all(
            isinstance(stats.get(k), int)
            for k in ("prompt_tokens", "cached_tokens", "generated_tokens")
        )
        and isinstance(tokens, list)
        and all(isinstance(t, int) for t in tokens)
        and isinstance(extra.get("text"), str)
        and isinstance(extra.get("finish_reason"), str)
    )
    if not well_formed:
        raise ServerError(f"the server at {url} sent the request's stats in another shape")
    return extra


def _dict(value: Any, url: str, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ServerError(f"the server at {url} sent {what} that is not a JSON object")
    return value


def _list(value: Any, url: str, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ServerError(f"the server at {url} sent {what} that is not a list")
    return value


class ChatRunner:
    """A chat's turns (`modes.chat.Runner`) as streamed chat completions on `server`, whose
    model is `model`: the content as it comes (a thinking section apart from the answer, as
    the server sends it), then `Done` with the request's own result from the usage. Leaving
    early closes the connection, and the server cancels the request. `draft`: each
    request's (None: the server's)."""

    def __init__(self, server: Server, model: str, draft: str | None = None) -> None:
        self.server = server
        self.model = model
        self.draft = draft

    def reply(self, request: RequestSpec) -> Iterator[Event]:
        sent = replace(request, draft=self.draft, model=self.model)
        return self._events(to_wire(sent))  # now: a setting no request carries raises here

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


def tool_choice_field(choice: ToolChoice) -> str | dict[str, Any]:
    """A tool choice as the request's `tool_choice`."""
    if choice.name is None:
        return choice.mode
    return {"type": "function", "function": {"name": choice.name}}

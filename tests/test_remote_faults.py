"""The `--server` client against servers that misbehave: silent, trickling, endless lines,
huge bodies, replies of other shapes. Each ends in one line and exit 1 (bad input: 2),
never a hang or a traceback. A fake server in a thread plays each fault."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxcache.errors import GenerationError, ServerError, UserInputError
from mlxcache.modes.tools import ToolCall
from mlxcache.remote import Server, Wanted, reply_calls, usage_of
from mlxcache_cli.main import app

runner = CliRunner()
Handler = Callable[[socket.socket, bytes], None]


@pytest.fixture
def fake() -> Iterator[Callable[[Handler], str]]:
    """Serve one behaviour on a free port (each connection: the request's bytes, then the
    handler); the listener is closed when the test ends."""
    listeners: list[socket.socket] = []

    def start(handler: Handler) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        listeners.append(sock)

        def loop() -> None:
            while True:
                try:
                    conn, _ = sock.accept()
                except OSError:
                    return
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

        def serve(conn: socket.socket) -> None:
            with conn, contextlib.suppress(OSError):
                handler(conn, whole_request(conn))

        threading.Thread(target=loop, daemon=True).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    try:
        yield start
    finally:
        for sock in listeners:
            sock.close()


def whole_request(conn: socket.socket) -> bytes:
    """Read the request to its last body byte: a socket closed with bytes unread sends a
    reset, which would race the reply the handler sent."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(1 << 16)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCACHE_SERVER_TIMEOUT", "1")


def reply(status: str, body: bytes, kind: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def sse(*lines: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    return head + b"".join(lines)


def silent(conn: socket.socket, _request: bytes) -> None:
    time.sleep(30)


def trickle(conn: socket.socket, _request: bytes) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99\r\n\r\n")
    time.sleep(30)


def endless_line(conn: socket.socket, _request: bytes) -> None:
    conn.sendall(sse(b"data: "))
    chunk = b"x" * (1 << 20)
    for _ in range(40):  # 40 MB, no line end
        conn.sendall(chunk)


def huge_body(conn: socket.socket, _request: bytes) -> None:
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 400000000\r\n\r\n"
    )
    chunk = b" " * (1 << 20)
    for _ in range(100):
        conn.sendall(chunk)


def answers(body: bytes, kind: str = "application/json") -> Handler:
    return lambda conn, _request: conn.sendall(reply("200 OK", body, kind))


def streams(*lines: bytes) -> Handler:
    return lambda conn, _request: conn.sendall(sse(*lines))


def test_a_silent_server_is_one_error_not_a_hang(fake: Callable[[Handler], str]) -> None:
    url = fake(silent)
    start = time.monotonic()
    with pytest.raises(ServerError, match="sent nothing for 1 s"):
        Server(url).get("/v1/models")
    assert time.monotonic() - start < 20
    with pytest.raises(ServerError, match="sent nothing for 1 s"):
        list(Server(url).stream("/v1/chat/completions", {}))


def test_a_trickling_body_and_a_deadline(
    fake: Callable[[Handler], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = fake(trickle)
    with pytest.raises(ServerError, match="sent nothing for 1 s"):
        Server(url).get("/v1/models")

    # Keep-alive comments every half second: never silent, but the deadline ends it.
    def alive(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(sse())
        for _ in range(60):
            conn.sendall(b": keepalive\n\n")
            time.sleep(0.5)

    monkeypatch.setenv("MLXCACHE_SERVER_DEADLINE", "2")
    with pytest.raises(
        ServerError, match=r"did not finish within \$MLXCACHE_SERVER_DEADLINE \(2 s\)"
    ):
        list(Server(fake(alive)).stream("/v1/chat/completions", {}))
    monkeypatch.setenv("MLXCACHE_SERVER_DEADLINE", "soon")
    with pytest.raises(UserInputError, match="MLXCACHE_SERVER_DEADLINE must be a number"):
        Server(url)


def test_reads_are_bounded(fake: Callable[[Handler], str]) -> None:
    with pytest.raises(ServerError, match="a line over 16 MB"):
        list(Server(fake(endless_line)).stream("/v1/chat/completions", {}))
    with pytest.raises(ServerError, match="a reply over 64 MB"):
        Server(fake(huge_body)).get("/v1/models")


@pytest.mark.parametrize(
    ("handler", "message"),
    [
        (answers(b"[1, 2]"), "its reply that is not a JSON object"),
        (answers(b"not json"), "sent no JSON reply"),
        (answers(b'{"data": {"id": 1}}'), "is not an mlxcache server"),
        (answers(b'{"data": [7]}'), "is not an mlxcache server"),
    ],
)
def test_a_model_list_of_another_shape(
    fake: Callable[[Handler], str], handler: Handler, message: str
) -> None:
    with pytest.raises(ServerError, match=message):
        Server(fake(handler)).card()


@pytest.mark.parametrize(
    ("lines", "error", "message"),
    [
        ((b"data: {oops\n\n",), ServerError, "an event that is not JSON"),
        ((b"data: \xff\xfe\n\n",), ServerError, "an event that is not UTF-8"),
        ((b"data: [1]\n\n",), ServerError, "an event that is not a JSON object"),
        ((b'data: {"error": "boom"}\n\n',), GenerationError, "boom"),
        (
            (b'data: {"choices": {"delta": 1}}\n\n', b"data: [DONE]\n\n"),
            ServerError,
            "choices that is not a list",
        ),
        (
            (b'data: {"choices": [{"delta": "x"}]}\n\n', b"data: [DONE]\n\n"),
            ServerError,
            "a delta that is not",
        ),
        (
            (
                b'data: {"choices": [{"delta": {"tool_calls": [{"function": {"name": 1}}]}}]}\n\n',
                b"data: [DONE]\n\n",
            ),
            ServerError,
            "a call in another shape",
        ),
        ((b'data: {"choices": []}\n\n',), ServerError, "ended the reply early"),
    ],
)
def test_events_of_another_shape(
    fake: Callable[[Handler], str], lines: tuple[bytes, ...], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Server(fake(streams(*lines))).post("/v1/chat/completions", {})


def delta_event(*calls: dict) -> bytes:
    event = {"choices": [{"delta": {"tool_calls": list(calls)}}]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def test_calls_streamed_in_pieces_or_whole_are_put_together(
    fake: Callable[[Handler], str],
) -> None:
    """OpenAI's streaming (id and name first, the arguments in pieces, by index) and a
    server sending each call whole without an index give the same message."""
    first = {"index": 0, "id": "c0", "type": "function", "function": {"name": "f", "arguments": ""}}
    pieces = (
        delta_event(first),
        delta_event({"index": 0, "function": {"arguments": '{"a": '}}),
        delta_event({"index": 1, "id": "c1", "function": {"name": "g", "arguments": "{}"}}),
        delta_event({"index": 0, "function": {"arguments": "1}"}}),
        b"data: [DONE]\n\n",
    )
    whole = (
        delta_event({"id": "c0", "function": {"name": "f", "arguments": '{"a": 1}'}}),
        delta_event({"id": "c1", "function": {"name": "g", "arguments": "{}"}}),
        b"data: [DONE]\n\n",
    )
    want = [
        {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{}"}},
    ]
    for lines in (pieces, whole):
        got = Server(fake(streams(*lines))).post("/v1/chat/completions", {})
        assert got["choices"][0]["message"]["tool_calls"] == want
    nameless = (delta_event({"index": 0, "function": {"arguments": "{}"}}), b"data: [DONE]\n\n")
    with pytest.raises(ServerError, match="a call without a name"):
        Server(fake(streams(*nameless))).post("/v1/chat/completions", {})
    begun = {"tool_calls": [*want, {"function": {"name": "h", "arguments": '{"a": '}}]}
    assert reply_calls(begun, {"tool_calls": 2}, "u") == (
        ToolCall("f", {"a": 1}),
        ToolCall("g", {}),
    )
    for counted in ({}, {"tool_calls": "2"}):  # the whole stream's calls: one is not JSON
        with pytest.raises(ServerError, match="sent a call whose arguments are not JSON"):
            reply_calls(begun, counted, "http://x")


@pytest.mark.parametrize(
    "usage",
    [
        None,
        {"mlxcache": "x"},
        {"mlxcache": {"stats": {}, "tokens": [], "text": "", "finish_reason": "stop"}},
        {
            "mlxcache": {
                "stats": {"prompt_tokens": 1, "cached_tokens": 0, "generated_tokens": 1},
                "tokens": ["a"],
                "text": "",
                "finish_reason": "stop",
            }
        },
    ],
)
def test_usage_of_another_shape_is_one_error(usage: object) -> None:
    with pytest.raises(ServerError, match="the server at u sent"):
        usage_of(usage, "u")  # type: ignore[arg-type]


def test_bad_addresses_and_keys_are_bad_input() -> None:
    with pytest.raises(UserInputError, match="Invalid IPv6 URL"):
        Server("http://[::1")
    with pytest.raises(UserInputError, match="must be one line"):
        Server("http://127.0.0.1:9", "key\nX-Other: 1")


def test_a_non_ascii_key_is_sent_as_utf8(fake: Callable[[Handler], str]) -> None:
    seen: list[bytes] = []

    def record(conn: socket.socket, request: bytes) -> None:
        seen.append(request)
        conn.sendall(reply("200 OK", b'{"data": []}'))

    with pytest.raises(ServerError):
        Server(fake(record), "clé").card()
    assert b"Authorization: Bearer cl\xc3\xa9\r\n" in seen[0]


@pytest.mark.parametrize("command", [["generate", "hi"], ["json", "--schema", "{}", "hi"]])
def test_commands_through_a_silent_server_end_in_one_line(
    fake: Callable[[Handler], str], tiny_gguf: Path, command: list[str]
) -> None:
    url = fake(silent)
    result = runner.invoke(app, [*command, "-m", str(tiny_gguf), "--server", url])
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr == (
        f"error: the server at {url} sent nothing for 1 s ($MLXCACHE_SERVER_TIMEOUT sets how "
        "long to wait)\n"
    )


def test_a_stream_that_fails_leaves_no_golden(
    fake: Callable[[Handler], str], tiny_gguf: Path, tmp_path: Path
) -> None:
    """regress record through a server whose model card matches and whose reply stalls."""
    from mlxcache.config import default_block_size

    card = {
        "data": [
            {
                "id": "m",
                "mlxcache": {
                    **Wanted(str(tiny_gguf), default_block_size(), True).identity(),
                    "key": "k",
                    "mlx": "0",
                    "mlx_lm": "0",
                },
            }
        ]
    }

    def handler(conn: socket.socket, request: bytes) -> None:
        while request.startswith(b"GET"):  # the card, on a connection kept for the request
            conn.sendall(reply("200 OK", json.dumps(card).encode()))
            request = conn.recv(1 << 16)
        conn.sendall(sse(b": keepalive\n\n"))
        time.sleep(30)

    suite = tmp_path / "s.yaml"
    suite.write_text(f"model: {tiny_gguf}\ncases:\n  - {{name: a, kind: plain, prompt: hi}}\n")
    out = tmp_path / "golden.json"
    result = runner.invoke(
        app, ["regress", "record", str(suite), "-o", str(out), "--server", fake(handler)]
    )
    assert result.exit_code == 1 and "sent nothing for 1 s" in result.stderr
    assert not out.exists()


def test_serve_refuses_a_key_no_client_can_send(tiny_gguf: Path) -> None:
    result = runner.invoke(app, ["serve", "-m", str(tiny_gguf), "--api-key", "a\nb"])
    assert result.exit_code == 2
    assert result.stderr == "error: --api-key must be one line (it holds a line break)\n"


def matching(tiny_gguf: Path, *lines: bytes) -> Handler:
    """A server whose model card matches a command on `tiny_gguf` (defaults), then streams
    `lines` to the request."""
    from mlxcache.config import default_block_size

    identity = Wanted(str(tiny_gguf), default_block_size(), True).identity()
    card = {"data": [{"id": "m", "mlxcache": {**identity, "key": "k", "mlx": "0", "mlx_lm": "0"}}]}

    def handler(conn: socket.socket, request: bytes) -> None:
        while request.startswith(b"GET"):  # the card, on a connection kept for the request
            conn.sendall(reply("200 OK", json.dumps(card).encode()))
            request = conn.recv(1 << 16)
        conn.sendall(sse(*lines))

    return handler


BAD_CHUNKS = [
    (b'{"choices": "abc"}', "choices that is not a list"),
    (b'{"choices": ["abc"]}', "a choice that is not a JSON object"),
    (b'{"choices": [{"delta": {"content": 5}}]}', "a choice whose text is not a string"),
    (b'{"choices": [{"text": ["x"]}]}', "a choice whose text is not a string"),
    (b'{"choices": [{"delta": {"tool_calls": "x"}}]}', "tool_calls that is not a list"),
    (b'{"choices": [], "usage": 7}', "a usage that is not a JSON object"),
]


@pytest.mark.parametrize(
    "command",
    [
        ["generate", "hi"],
        ["generate", "--raw", "hi"],
        ["json", "--schema", "{}", "hi"],
        ["tools", "--tools", '[{"name": "f", "parameters": {"type": "object"}}]', "hi"],
        ["chat"],
    ],
    ids=lambda c: " ".join(c[:2]),
)
@pytest.mark.parametrize(("event", "message"), BAD_CHUNKS, ids=[m for _, m in BAD_CHUNKS])
def test_every_command_checks_each_streamed_chunk(
    fake: Callable[[Handler], str], tiny_gguf: Path, command: list[str], event: bytes, message: str
) -> None:
    """A chunk of another shape is one error line for every command through a server,
    never a traceback (issue 53, item 11)."""
    url = fake(matching(tiny_gguf, b"data: " + event + b"\n\n", b"data: [DONE]\n\n"))
    result = runner.invoke(app, [*command, "-m", str(tiny_gguf), "--server", url], input="hi\n")
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert result.exit_code == (2 if command == ["chat"] else 1), result.stderr  # chat: piped
    assert result.stderr.splitlines()[-1] == f"error: the server at {url} sent {message}"


def trickling(head: bytes) -> Handler:
    """Sends `head`, then a byte every 0.2 s for a minute: never silent for a second."""

    def handler(conn: socket.socket, _request: bytes) -> None:
        conn.sendall(head)
        for _ in range(300):
            conn.sendall(b"x")
            time.sleep(0.2)

    return handler


@pytest.mark.parametrize(
    ("head", "call"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\n", lambda s: s.get("/v1/models")),
        (sse(b"data: "), lambda s: list(s.stream("/v1/chat/completions", {}))),
        (b"HTTP/1.1 200 OK\r\nX-Slow: ", lambda s: s.get("/v1/models")),  # its headers
    ],
    ids=["body", "event", "headers"],
)
def test_the_deadline_bounds_a_trickling_request_on_the_wall_clock(
    fake: Callable[[Handler], str],
    monkeypatch: pytest.MonkeyPatch,
    head: bytes,
    call: Callable[[Server], object],
) -> None:
    """A byte every 0.2 s is never a silence of 1 s and never ends a read (a line, a
    body): the deadline alone ends the request, when it passes (issue 53, item 12)."""
    monkeypatch.setenv("MLXCACHE_SERVER_DEADLINE", "1.5")
    server = Server(fake(trickling(head)))
    start = time.monotonic()
    with pytest.raises(ServerError, match=r"did not finish within \$MLXCACHE_SERVER_DEADLINE"):
        call(server)
    assert time.monotonic() - start < 30  # the trickle lasts a minute


def test_a_request_in_time_leaves_the_connection_to_the_next(
    fake: Callable[[Handler], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline's watch ends with its request: a kept connection serves the next
    request after the first's deadline has passed."""
    monkeypatch.setenv("MLXCACHE_SERVER_DEADLINE", "1")

    def twice(conn: socket.socket, _request: bytes) -> None:
        for _ in range(2):
            conn.sendall(reply("200 OK", b'{"data": []}'))
            conn.recv(1 << 16)  # the next request

    server = Server(fake(twice))
    assert server.get("/v1/models") == {"data": []}
    time.sleep(1.5)
    assert server.get("/v1/models") == {"data": []}


def test_a_server_s_card_is_its_model_s_not_an_alias_s(fake: Callable[[Handler], str]) -> None:
    """A server with --alias lists a card per alias (`alias_of`): the client takes the
    served model's card; two models' cards are still refused (no one identity)."""
    mine = {"id": "m", "mlxcache": {"key": "k"}}
    alias = {"id": "gpt-5", "alias_of": "m", "mlxcache": {"key": "k"}}
    assert Server(fake(answers(json.dumps({"data": [mine, alias]}).encode()))).card() == mine
    two = {"data": [mine, {"id": "n", "mlxcache": {"key": "j"}}]}
    with pytest.raises(ServerError, match="not an mlxcache server this version can use"):
        Server(fake(answers(json.dumps(two).encode()))).card()

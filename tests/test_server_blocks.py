"""One block stream for chat, Messages and Responses (server/blocks.py): for scripted
replies (thinking, text, calls, a call cut off, a failure), each route's stream adds up to
its unstreamed reply; a client that has a stream's last event is logged with what it got,
however soon it leaves; a stream broken by a server fault is logged as an error."""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from asgi import call

from mlxcache.engine import Engine, Request
from mlxcache.events import Done, Event, Result, Stats, Token
from mlxcache.model import LoadedModel
from mlxcache.server import blocks
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.server.stream import Outcome

# The prompt opens the thinking section (DeepSeek-R1's way): a reply is reasoning until
# `</think>`; with tools and no tool format of its own, calls are Hermes' <tool_call>.
OPENS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n"
    "{% endif %}"
)
CALL = '<tool_call>\n{"name": "ping", "arguments": {"n": 1, "s": "x y"}}\n</tool_call>'
CUT = '\n<tool_call>\n{"name": "ping", "arguments": {"n": 2'
REPLIES = {
    "text": ("</think>Hello there", "stop"),
    "thinking then text": ("hmm ok</think>Answer here", "stop"),
    "thinking cut off": ("hmm ok", "length"),
    "thinking alone": ("hmm ok</think>", "stop"),
    "a call": ("</think>" + CALL, "stop"),
    "text then a call": ("</think>Sure." + CALL, "stop"),
    "a call, the next cut off": ("</think>" + CALL + CUT, "length"),
    "thinking then a call": ("plan</think>" + CALL, "stop"),
    "thinking, a call, the next cut off": ("plan</think>" + CALL + CUT, "length"),
}
PARAMETERS = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}
HI = [{"role": "user", "content": "hi"}]
ROUTES = {
    "/v1/chat/completions": {
        "messages": HI,
        "tools": [{"type": "function", "function": {"name": "ping", "parameters": PARAMETERS}}],
    },
    "/v1/messages": {
        "messages": HI,
        "max_tokens": 50,
        "tools": [{"name": "ping", "input_schema": PARAMETERS}],
    },
    "/v1/responses": {
        "input": "hi",
        "tools": [{"type": "function", "name": "ping", "parameters": PARAMETERS}],
    },
}
LAST = {
    "/v1/chat/completions": b"data: [DONE]\n\n",
    "/v1/messages": b"event: message_stop\n",
    "/v1/responses": b"event: response.completed\n",
}
"""Each route's last event."""


class Scripted:
    """A worker whose every request replies `text`, three characters a token."""

    waiting = 0

    def __init__(self, text: str, finish: str, error: str | None = None) -> None:
        self.text, self.finish, self.error = text, finish, error
        self.engine: Engine | None = None

    def submit(self, request: Request, sink: Callable[[Event], None]) -> Any:
        pieces = [self.text[i : i + 3] for i in range(0, len(self.text), 3)]
        stats = Stats(prompt_tokens=len(request.tokens), generated_tokens=len(pieces))
        result = Result(self.text, list(range(len(pieces))), self.finish, stats, self.error)

        def run() -> None:
            for i, piece in enumerate(pieces):
                sink(Token(0, i, piece))
            sink(Done(0, result))

        threading.Thread(target=run, daemon=True).start()
        return SimpleNamespace(cancel=lambda: None)

    def warm(self, tokens: list[int]) -> None:
        return None

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        return fn(self.engine)


@pytest.fixture
def opens(wide: LoadedModel) -> Iterator[LoadedModel]:
    hf = wide.tokenizer._tokenizer
    saved, hf.chat_template = hf.chat_template, OPENS
    try:
        yield wide
    finally:
        hf.chat_template = saved


def app_of(model: LoadedModel, worker: Any, log: io.StringIO | None = None) -> Any:
    engine = worker.engine = Engine(model, warm_ahead=False)
    return create_app(engine, worker, Settings(model.name), RequestLog(stream=log or io.StringIO()))


def _anonymous(doc: Any, rid: str) -> Any:
    """`doc` with its reply's id (and the ids made of it) written `ID`."""
    return json.loads(json.dumps(doc).replace(rid.partition("-")[2], "ID"))


def _chat(events: list[str]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    calls: dict[int, dict[str, Any]] = {}
    for e in events[:-1]:
        chunk = json.loads(e)
        if not chunk["choices"]:
            continue
        choice = chunk["choices"][0]
        for key in ("content", "reasoning"):
            if choice["delta"].get(key):
                message[key] = message.get(key, "") + choice["delta"][key]
        for c in choice["delta"].get("tool_calls", ()):
            call_ = calls.setdefault(c["index"], {"function": {"arguments": ""}})
            call_.update({k: v for k, v in c.items() if k not in ("index", "function")})
            call_["function"]["name"] = c["function"].get("name", call_["function"].get("name"))
            call_["function"]["arguments"] += c["function"]["arguments"]
        finish = choice["finish_reason"] or None
    whole = [calls[i] for i in sorted(calls) if _reads(calls[i]["function"]["arguments"])]
    if whole:  # a call cut off stays as it was sent; the answer leaves it out
        message["content"] = message["content"] or None
        message["tool_calls"] = whole
    return {"message": message, "finish_reason": finish}


def _messages(events: list[str]) -> list[dict[str, Any]]:
    """The content blocks the stream built."""
    content: list[dict[str, Any]] = []
    for e in events:
        doc = json.loads(e)
        if doc["type"] == "content_block_start":
            assert doc["index"] == len(content)
            content.append({**doc["content_block"], "partial": ""})
        elif doc["type"] == "content_block_delta":
            block, delta = content[doc["index"]], doc["delta"]
            for key in ("text", "thinking"):
                if key in delta:
                    block[key] += delta[key]
            block["partial"] += delta.get("partial_json", "")
    for block in content:
        partial = block.pop("partial")
        if block["type"] == "thinking":
            block["signature"] = ""
        if block["type"] == "tool_use":
            block["input"] = json.loads(partial) if _reads(partial) else None
    return [b for b in content if b.get("input", {}) is not None]  # cut off: left out


def _output(events: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The output items done, in output index order, and the final Response."""
    docs = [json.loads(e) for e in events]
    items = {d["output_index"]: d["item"] for d in docs if d["type"] == "response.output_item.done"}
    assert sorted(items) == list(range(len(items)))
    done = [items[i] for i in range(len(items)) if items[i].get("status") != "incomplete"]
    return done, docs[-1]["response"]


def _reads(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("name", REPLIES)
def test_a_stream_adds_up_to_its_unstreamed_reply(opens: LoadedModel, name: str, path: str) -> None:
    text, finish = REPLIES[name]
    app = app_of(opens, Scripted(text, finish))
    body = {"model": opens.name, **ROUTES[path]}
    plain = call(app, "POST", path, body).json()
    plain = _anonymous(plain, plain["id"])
    streamed = call(app, "POST", path, {**body, "stream": True}).events()
    first = json.loads(streamed[0])
    rid = first.get("id") or first.get("message", first.get("response", {})).get("id")
    events = [_anonymous(json.loads(e), rid) for e in streamed if e != "[DONE]"]
    texts = [json.dumps(e) for e in events]
    if path == "/v1/chat/completions":
        want = {k: plain["choices"][0][k] for k in ("message", "finish_reason")}
        assert _chat([*texts, "[DONE]"]) == want
    elif path == "/v1/messages":
        assert _messages(texts) == plain["content"]
        assert events[-2]["delta"]["stop_reason"] == plain["stop_reason"]
    else:
        items, final = _output(texts)
        assert items == plain["output"] == final["output"]
        assert final["status"] == plain["status"]


def test_a_call_cut_off_is_left_out_of_the_answer_and_said_so_in_the_stream(
    opens: LoadedModel,
) -> None:
    """The cases above leave a cut call out of both sides: the answer keeps the whole
    call only; the Responses stream ends the cut one `incomplete`."""
    text, finish = REPLIES["a call, the next cut off"]
    app = app_of(opens, Scripted(text, finish))
    body = {"model": opens.name, **ROUTES["/v1/responses"]}
    plain = call(app, "POST", "/v1/responses", body).json()
    assert [(o["type"], o["status"]) for o in plain["output"]] == [("function_call", "completed")]
    streamed = [
        json.loads(e) for e in call(app, "POST", "/v1/responses", {**body, "stream": True}).events()
    ]
    done = [e["item"]["status"] for e in streamed if e["type"] == "response.output_item.done"]
    assert done == ["completed", "incomplete"]


async def _read_the_end_then_leave(app: Any, path: str, body: dict[str, Any]) -> bytes:
    """A client that reads until the stream's last event and leaves at once: the server's
    send of that event returns only once the client's leaving has cancelled the reply (a
    connection lost before the app resumes), so its generator never runs past the last
    event."""
    gone = asyncio.Event()
    got: list[bytes] = []
    incoming = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        got.append(message.get("body", b""))
        if LAST[path] in b"".join(got):
            gone.set()
            await asyncio.Event().wait()  # cancelled when the server sees the client gone

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    await app({**scope, "query_string": b""}, receive, send)
    assert gone.is_set()
    return b"".join(got)


def _logged_as_received(model: LoadedModel, path: str) -> tuple[str, list[str]]:
    """The log line and /metrics of a stream whose client left once it had the end."""
    log = io.StringIO()
    app = app_of(model, Scripted("</think>Hello there", "stop"), log)
    body = {"model": model.name, **ROUTES[path], "stream": True}
    asyncio.run(_read_the_end_then_leave(app, path, body))
    metrics = call(app, "GET", "/metrics").body.decode().splitlines()
    return log.getvalue().splitlines()[0], metrics


@pytest.mark.parametrize("path", ROUTES)
def test_a_client_that_read_the_last_event_is_logged_with_its_counts(
    opens: LoadedModel, path: str
) -> None:
    """Issue 53 item 9: the client has the whole stream and leaves before the server's
    generator runs again; the log and /metrics say what it received: 200, its token
    counts, its finish. The outcome is noted before the text of the end is rendered
    (`blocks.rendered`), so this holds however the client's leaving and the server's
    ending interleave."""
    line, metrics = _logged_as_received(opens, path)
    assert f'mlxcache_requests_total{{path="{path}",status="200"}} 1' in metrics
    assert "mlxcache_generated_tokens_total 7" in metrics
    assert [m for m in metrics if m.startswith("mlxcache_completions_total")] == [
        'mlxcache_completions_total{finish_reason="stop"} 1'
    ]
    assert re.search(rf" POST {path} 200 prompt=\d+ cached=0 generated=7 .* finish=stop$", line)


def test_the_log_check_sees_an_outcome_noted_after_the_last_event(
    opens: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above has teeth: a stream that noted its outcome only after its last
    event (the order this design rules out) is logged as a client gone, counts lost."""

    async def late(*args: Any) -> AsyncIterator[str | Outcome]:
        outcome = None
        async for item in rendered(*args):
            if isinstance(item, Outcome):
                outcome = item
                continue
            yield item
            if outcome is not None and item == "data: [DONE]\n\n":
                yield outcome

    rendered = blocks.rendered
    monkeypatch.setattr("mlxcache.server.chat_api.rendered", late)
    line, metrics = _logged_as_received(opens, "/v1/chat/completions")
    assert "finish=disconnected" in line and "generated=" not in line
    assert "mlxcache_generated_tokens_total 0" in metrics
    assert 'mlxcache_completions_total{finish_reason="disconnected"} 1' in metrics


def test_a_response_whose_client_left_at_once_can_be_followed_up(opens: LoadedModel) -> None:
    """A Responses client that has `response.completed` may leave and send
    `previous_response_id` at once: the response was stored before that event went out."""
    app = app_of(opens, Scripted("</think>Hello there", "stop"))
    body = {"model": opens.name, "input": "hi", "stream": True}
    sent = asyncio.run(_read_the_end_then_leave(app, "/v1/responses", body))
    rid = re.search(rb'"id": "(resp-\w+)"', sent).group(1).decode()  # type: ignore[union-attr]
    follow = {"model": opens.name, "input": "and?", "previous_response_id": rid}
    reply = call(app, "POST", "/v1/responses", follow)
    assert reply.status == 200, reply.body
    assert reply.json()["previous_response_id"] == rid


@pytest.mark.parametrize("path", ROUTES)
def test_a_stream_broken_by_a_server_fault_is_logged_as_an_error(
    opens: LoadedModel, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault of the server's own mid-stream (here: reading the answer) is an error in
    the log and /metrics, not a client gone; the client's stream ends in the route's error
    event."""

    def broken(self: Any, text: str, finish_reason: str) -> Any:
        raise ValueError("no answer")

    monkeypatch.setattr("mlxcache.server.prepare.Plan.answer", broken)
    log = io.StringIO()
    app = app_of(opens, Scripted("</think>Hello there", "stop"), log)
    reply = call(app, "POST", path, {"model": opens.name, **ROUTES[path], "stream": True})
    line = log.getvalue().splitlines()[0]
    assert "disconnected" not in line
    assert line.endswith("finish=error error=internal error: ValueError: no answer"), line
    last = reply.events()[-2 if path == "/v1/chat/completions" else -1]  # chat: then [DONE]
    assert "internal error: ValueError: no answer" in last
    metrics = call(app, "GET", "/metrics").body.decode().splitlines()
    assert 'mlxcache_completions_total{finish_reason="error"} 1' in metrics


def test_a_text_completion_stream_broken_by_a_server_fault_is_logged_as_an_error(
    opens: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any stream (here /v1/completions, which renders no blocks): the fault reaches the
    server (a traceback in its log, the connection closed), and the request's log line
    says it failed, not that its client left."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("no chunk")

    monkeypatch.setattr("mlxcache.server.openai_format.Envelope.completion_chunk", broken)
    log = io.StringIO()
    app = app_of(opens, Scripted("Hello there", "stop"), log)
    body = {"model": opens.name, "prompt": "hi", "stream": True}
    with pytest.raises(ValueError, match="no chunk"):
        call(app, "POST", "/v1/completions", body)
    line = log.getvalue().splitlines()[0]
    assert " POST /v1/completions 200 " in line, line
    assert line.endswith("finish=error error=internal error: ValueError: no chunk"), line
    metrics = call(app, "GET", "/metrics").body.decode().splitlines()
    assert 'mlxcache_completions_total{finish_reason="error"} 1' in metrics


def test_a_stream_whose_answer_cannot_be_kept_ends_in_an_error_event(
    opens: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault while the end is made (here: the Response cannot be stored) is said to the
    client in the route's error event, not a stream cut short: the end is not the client's
    until its text was sent."""

    def broken(self: Any, rid: str, conversation: Any) -> None:
        raise ValueError("no room")

    monkeypatch.setattr("mlxcache.server.responses_api.Store.put", broken)
    log = io.StringIO()
    app = app_of(opens, Scripted("Hello there", "stop"), log)
    path = "/v1/responses"
    reply = call(app, "POST", path, {"model": opens.name, **ROUTES[path], "stream": True})
    assert "internal error: ValueError: no room" in reply.events()[-1]
    assert "response.completed" not in reply.body.decode()
    line = log.getvalue().splitlines()[0]
    assert line.endswith("finish=error error=internal error: ValueError: no room"), line

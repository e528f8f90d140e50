"""`mlxcache serve` end to end: the real `openai` client against a server in a child process.

Every reply is compared with what the library gives on the same rendered prompt, sampling
and seed (a reference engine in this process, no cache): streamed, non-streamed,
concurrent, cached, and after a restart from the disk tier, the bytes are the same.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.client import HTTPConnection, HTTPResponse
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import mlx.core as mx
import openai
import pytest
from tinymodel import write_tiny_gguf

from mlxcache.bench.serve_bench import idle_report
from mlxcache.engine import Engine, Request
from mlxcache.events import Token
from mlxcache.model import load
from mlxcache.modes import json_mode
from mlxcache.modes.json_mode import JsonTask
from mlxcache.modes.tool_chat import ToolsTask
from mlxcache.modes.tools import ToolChoice, parse_tools
from mlxcache.sampling import SamplingParams
from mlxcache.server.process import MlxcacheServer as ServerProcess
from mlxcache.server.process import running

pytestmark = pytest.mark.slow  # a server in a child process per test

BLOCK = 16
MAX_TOKENS = 24
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("srv-model") / "tiny4k.gguf"
    write_tiny_gguf(path, context=4096)  # room for the tools' system message
    return path


@pytest.fixture(scope="module")
def ref(model: Path, cache_root: Path) -> Engine:
    """The library, no cache: what every reply must equal."""
    return Engine(load(str(model), cache_root=cache_root), block_size=BLOCK)


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    cache = tmp_path_factory.mktemp("srv-cache")
    log = cache / "requests.jsonl"
    args = ["--block-size", str(BLOCK), "--max-tokens", str(MAX_TOKENS), "--cache-dir", str(cache)]
    # No warm-ahead here: its lanes pin entries while they run, in idle time.
    with running(model, *args, "--no-warm-ahead", "--log-file", str(log)) as srv:
        yield srv


class Reply:
    """A raw HTTP reply (stdlib http.client: exact bytes, no client-side handling)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status_code, self.headers, self.content = status, headers, body

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode()


def connect(srv: ServerProcess) -> HTTPConnection:
    url = urlsplit(srv.url)
    return HTTPConnection(url.hostname or "127.0.0.1", url.port)


def request(
    srv: ServerProcess, method: str, path: str, body: bytes | str | None = None, **headers: str
) -> Reply:
    conn = connect(srv)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def stream(conn: HTTPConnection, path: str, body: dict[str, Any]) -> HTTPResponse:
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return resp


def events(resp: HTTPResponse) -> Iterator[str]:
    """The `data:` payloads of an SSE response, as they arrive."""
    for raw in resp:
        line = raw.decode().rstrip("\n")
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def client(srv: ServerProcess, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def params(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, **kw})


def chat_ref(ref: Engine, messages: list[dict[str, Any]], p: SamplingParams) -> str:
    return ref.complete(Request(ref.encoder.encode_chat(messages), p)).text


def chat_both(srv: ServerProcess, **kw: Any) -> tuple[Any, str, list[Any]]:
    """The non-streamed reply, and the streamed content and chunks of the same request."""
    c = client(srv)
    plain = c.chat.completions.create(model=srv.model, **kw)
    chunks = list(
        c.chat.completions.create(
            model=srv.model, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return plain, text, chunks


@pytest.mark.check  # the fast tier's server smoke
def test_chat_streamed_and_plain_equal_the_library(server: ServerProcess, ref: Engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    for kw, p in [
        ({}, params()),
        ({"temperature": 0.9, "seed": 7}, params(temperature=0.9, seed=7)),
    ]:
        plain, streamed, chunks = chat_both(server, messages=messages, **kw)
        expected = chat_ref(ref, messages, p)
        assert plain.choices[0].message.content == streamed == expected
        assert plain.choices[0].finish_reason == chunks[-2].choices[0].finish_reason
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens == plain.usage.prompt_tokens
        assert usage.completion_tokens == plain.usage.completion_tokens
        assert plain.usage.prompt_tokens == len(ref.encoder.encode_chat(messages))


def test_content_parts_developer_role_and_max_completion_tokens(
    server: ServerProcess, ref: Engine
) -> None:
    parts = [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]
    reply = client(server).chat.completions.create(
        model=server.model,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": parts},
        ],
        max_completion_tokens=5,
    )
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    assert reply.choices[0].message.content == chat_ref(ref, messages, params(max_tokens=5))


def test_stop_strings_cut_streamed_and_plain_alike(server: ServerProcess, ref: Engine) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    full = chat_ref(ref, messages, params())
    stop = full[3:5]  # something the reply does contain
    plain, streamed, _ = chat_both(server, messages=messages, stop=[stop, "\x00never"])
    ids = ref.encoder.encode_chat(messages)
    expected = ref.complete(Request(ids, params(), stop_strings=(stop, "\x00never")))
    assert plain.choices[0].message.content == streamed == expected.text
    assert expected.text == full[: full.index(stop)]
    assert plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == expected.stats.generated_tokens


def test_completions_equal_the_library(server: ServerProcess, ref: Engine) -> None:
    c = client(server)
    plain = c.completions.create(model=server.model, prompt="Once upon a time", max_tokens=12)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(
            model=server.model, prompt="Once upon a time", max_tokens=12, stream=True
        )
        if ch.choices
    )
    ids = ref.encoder.encode("Once upon a time")
    expected = ref.complete(Request(ids, params(max_tokens=12))).text
    assert plain.choices[0].text == streamed == expected
    assert plain.usage.prompt_tokens == len(ids)


def json_ref(ref: Engine, prompt: str) -> str:
    task = JsonTask.create(SCHEMA, strict=True)
    ids = json_mode.encode(ref, task.messages(prompt))
    return ref.complete(json_mode.request(ref, ids, task, params(max_tokens=40))).text


def json_kw(prompt: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 40,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": SCHEMA, "strict": True},
        },
    }


def test_json_schema_equals_json_mode(server: ServerProcess, ref: Engine) -> None:
    plain, streamed, _ = chat_both(server, **json_kw("Where?"))
    expected = json_ref(ref, "Where?")
    assert plain.choices[0].message.content == streamed == expected
    assert set(json.loads(expected)) == {"city", "ok"}


def tools_ref(ref: Engine, prompt: str, choice: ToolChoice) -> Any:
    task = ToolsTask(parse_tools(TOOLS), choice)
    ids = task.encode(ref, [{"role": "user", "content": prompt}])
    return task.read(ref.complete(task.request(ref, ids, params(max_tokens=120))))


def tools_kw(prompt: str, choice: Any = "required") -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 120,
        "tools": TOOLS,
        "tool_choice": choice,
        "parallel_tool_calls": False,
    }


def streamed_calls(chunks: list[Any]) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            got = calls.setdefault(d.index, ["", "", ""])
            got[0] += d.id or ""
            got[1] += d.function.name or ""
            got[2] += d.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)]  # type: ignore[misc]


def test_tool_calls_equal_tools_mode(server: ServerProcess, ref: Engine) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, mode in [
        ("required", ToolChoice("required")),
        (named, ToolChoice("function", "get_weather")),
        ("auto", ToolChoice("auto")),  # text (streamed stripped), maybe then a call
    ]:
        plain, streamed_text, chunks = chat_both(server, **tools_kw("Weather in Paris?", choice))
        expected = tools_ref(ref, "Weather in Paris?", mode)
        msg = plain.choices[0].message
        finish = plain.choices[0].finish_reason
        assert finish == chunks[-2].choices[0].finish_reason
        assert (finish == "tool_calls") == bool(expected.calls) == (choice != "auto")
        got = [(c.id, c.function.name, c.function.arguments) for c in msg.tool_calls or ()]
        assert [(n, json.loads(a)) for _, n, a in got] == [
            (c.name, c.arguments) for c in expected.calls
        ]
        assert [(n, a) for _, n, a in streamed_calls(chunks)] == [(n, a) for _, n, a in got]
        # The arguments came as they were written, a few tokens a chunk.
        pieces = [
            d.function.arguments
            for ch in chunks
            if ch.choices
            for d in ch.choices[0].delta.tool_calls or ()
            if d.function.arguments
        ]
        assert len(pieces) > 3 if got else pieces == []
        assert all(i.startswith("call_") for i, _, _ in got + streamed_calls(chunks))
        assert (msg.content or "") == streamed_text == expected.content


def test_tool_results_continue_the_conversation(server: ServerProcess, ref: Engine) -> None:
    first = client(server).chat.completions.create(model=server.model, **tools_kw("Weather?"))
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
    ]
    reply = client(server).chat.completions.create(
        model=server.model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=10
    )
    task = ToolsTask(parse_tools(TOOLS), ToolChoice("none"))
    conv = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"name": call.function.name, "arguments": json.loads(call.function.arguments)}
            ],
        },
        {"role": "tool", "name": call.function.name, "content": '{"temp_c": 21}'},
    ]
    ids = task.encode(ref, conv)
    expected = task.read(ref.complete(task.request(ref, ids, params(max_tokens=10))))
    assert reply.choices[0].message.content == expected.content


def test_four_clients_at_once_each_get_what_they_get_alone(server: ServerProcess) -> None:
    turn2 = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "And then?"},
    ]
    jobs: list[dict[str, Any]] = [
        {
            "messages": [{"role": "user", "content": "Tell me a story"}],
            "temperature": 0.7,
            "seed": 1,
        },
        json_kw("Where now?"),
        tools_kw("Weather in Rome?"),
        {"messages": turn2},
    ]

    def ask(kw: dict[str, Any]) -> str:
        reply = client(server).chat.completions.create(model=server.model, **kw)
        return reply.choices[0].message.model_dump_json(exclude={"tool_calls": {"__all__": {"id"}}})

    alone = [ask(kw) for kw in jobs]
    together: list[str | None] = [None] * len(jobs)

    def run(i: int) -> None:
        together[i] = ask(jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_openai_client_gets_logprobs_and_a_model_card(server: ServerProcess, ref: Engine) -> None:
    c = client(server)
    messages = [{"role": "user", "content": "Hello"}]
    kw: dict[str, Any] = {
        "messages": messages,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 2,
    }
    plain = c.chat.completions.create(model=server.model, **kw)
    streamed = list(c.chat.completions.create(model=server.model, stream=True, **kw))
    expected = [
        e
        for e in ref.generate(
            Request(ref.encoder.encode_chat(messages), params(max_tokens=6), logprobs=2)
        )
        if isinstance(e, Token) and e.logprob is not None
    ]
    assert plain.choices[0].logprobs is not None and plain.choices[0].logprobs.content
    content = plain.choices[0].logprobs.content
    assert [t.logprob for t in content] == [e.logprob for e in expected]
    assert [[a.logprob for a in t.top_logprobs] for t in content] == [
        [v for _, v in e.top_logprobs] for e in expected
    ]
    assert [
        t
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content or ()
    ] == content
    text = c.completions.create(model=server.model, prompt="Once upon", max_tokens=4, logprobs=1)
    assert text.choices[0].logprobs is not None
    ids = ref.encoder.encode("Once upon")
    expected = [
        e
        for e in ref.generate(Request(ids, params(max_tokens=4), logprobs=1))
        if isinstance(e, Token) and e.logprob is not None
    ]
    assert text.choices[0].logprobs.token_logprobs == [e.logprob for e in expected]
    assert c.models.retrieve(server.model).id == server.model
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")
    metrics = request(server, "GET", "/metrics")
    assert metrics.status_code == 200
    assert "mlxcache_generated_tokens_total " in metrics.text


def test_models_health_and_cache(server: ServerProcess) -> None:
    c = client(server)
    assert [m.id for m in c.models.list().data] == [server.model]
    health = request(server, "GET", "/health").json()
    assert health["status"] == "ok" and health["model"] == server.model
    report = idle_report(server.url)  # warm-ahead lanes pin what they resume from while they run
    assert report["block_size"] == BLOCK
    assert (report["pinned_entries"], report["busy"], report["waiting"]) == (0, False, 0)
    # What the probe found on this device: on MLX's CPU backend, decode KV is kept and
    # requests decode as one batch.
    on_cpu = mx.default_device() == mx.cpu
    assert report["decode_kv"] == ("kept" if on_cpu else "re-prefilled")
    assert report["batched_decode"] == on_cpu


def test_repeated_conversation_is_cached_with_the_cold_bytes_and_resumes_after_restart(
    model: Path, ref: Engine, tmp_path: Path
) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant. " * 4},
        {"role": "user", "content": "Hi there"},
    ]
    expected = chat_ref(ref, messages, params())
    args = [
        "--block-size",
        str(BLOCK),
        "--max-tokens",
        str(MAX_TOKENS),
        "--cache-dir",
        str(tmp_path),
    ]
    with running(model, *args) as srv:  # warm-ahead on: each reply queues its next turn
        c = client(srv)
        cold = c.chat.completions.create(model=srv.model, messages=messages)
        warm = c.chat.completions.create(model=srv.model, messages=messages)
        call = c.chat.completions.create(model=srv.model, **tools_kw("Weather in Oslo?"))
        json_reply = c.chat.completions.create(model=srv.model, **json_kw("Where?"))
    with running(model, *args) as srv:
        resumed = client(srv).chat.completions.create(model=srv.model, messages=messages)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    prompt = cold.usage.prompt_tokens
    # The same conversation again resumes whole (its tail is remembered in memory); a
    # restarted server resumes its full blocks from disk.
    assert warm.usage.prompt_tokens_details.cached_tokens == prompt
    assert resumed.usage.prompt_tokens_details.cached_tokens == prompt // BLOCK * BLOCK
    assert [r.choices[0].message.content for r in (cold, warm, resumed)] == [expected] * 3
    [got] = call.choices[0].message.tool_calls
    [want] = tools_ref(ref, "Weather in Oslo?", ToolChoice("required")).calls
    assert (got.function.name, json.loads(got.function.arguments)) == (want.name, want.arguments)
    assert json_reply.choices[0].message.content == json_ref(ref, "Where?")


def test_client_gone_mid_stream_frees_its_lane(server: ServerProcess, ref: Engine) -> None:
    body = {"model": server.model, "prompt": "abab", "max_tokens": 2000, "stream": True}
    conn = connect(server)
    try:
        rid = json.loads(next(events(stream(conn, "/v1/completions", body))))["id"]
    finally:
        conn.close()  # gone after the first chunk
    # The server logs the request once its handler is done (the lane cancelled before).
    line = server.wait_for(re.compile(re.escape(rid) + r" .*")).group(0)
    assert "finish=disconnected" in line
    assert idle_report(server.url)["pinned_entries"] == 0
    reply = client(server).completions.create(model=server.model, prompt="abab", max_tokens=4)
    expected = ref.complete(Request(ref.encoder.encode("abab"), params(max_tokens=4))).text
    assert reply.choices[0].text == expected


def test_client_gone_before_a_plain_reply_cancels_it(server: ServerProcess) -> None:
    body = {"model": server.model, "prompt": "ab", "max_tokens": 2000, "user": "gone-plain"}
    conn = connect(server)
    conn.request("POST", "/v1/completions", body=json.dumps(body))
    conn.close()  # never reads the reply
    line = server.wait_for(re.compile(r"POST /v1/completions 499 .*")).group(0)
    assert "finish=disconnected" in line
    # The log line comes from the route; the worker drops the lane just after it.
    report = idle_report(server.url)
    for _ in range(600):
        if not report["busy"]:
            break
        time.sleep(0.05)
        report = idle_report(server.url)
    assert (report["pinned_entries"], report["busy"]) == (0, False)


def test_every_request_is_logged(server: ServerProcess, tmp_path: Path) -> None:
    reply = client(server).chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Log me"}], max_tokens=3
    )
    line = server.wait_for(re.compile(re.escape(reply.id) + r" POST /v1/chat/completions 200 .*"))
    assert f"prompt={reply.usage.prompt_tokens} " in line.group(0)
    assert f"generated={reply.usage.completion_tokens} " in line.group(0)
    post(server, "/v1/chat/completions", chat_body(server, n=3))
    # Refused before an id was given: "-" stands for it.
    server.wait_for(re.compile(r"^- POST /v1/chat/completions 400 .*error=n must be 1"))


# -- errors -------------------------------------------------------------------------------


def post(srv: ServerProcess, path: str, content: bytes | str, **headers: str) -> Reply:
    return request(srv, "POST", path, content, **headers)


def error_of(r: Reply, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "\n" not in err["message"] and "Traceback" not in err["message"]
    return err


def chat_body(srv: ServerProcess, **kw: Any) -> str:
    return json.dumps({"model": srv.model, "messages": [{"role": "user", "content": "x"}], **kw})


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"max_tokens": "many"}, "max_tokens", "invalid_value"),
        ({"temperature": -1}, "temperature", "invalid_value"),
        ({"n": 2}, "n", "invalid_value"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": [{"role": "pirate", "content": "x"}]}, "messages.0.role", "invalid_value"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objec"}},
                }
            },
            None,
            "invalid_value",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            None,
            "invalid_value",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "invalid_value",
        ),
        ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"prompt": "hi"}, "prompt", "invalid_value"),  # and messages: which to continue?
        (
            {"messages": [{"role": "user", "content": "word " * 5000}]},
            "messages",
            "context_length_exceeded",
        ),
    ],
)
def test_bad_requests_get_400_with_one_line(
    server: ServerProcess, extra: dict[str, Any], param: str | None, code: str
) -> None:
    err = error_of(post(server, "/v1/chat/completions", chat_body(server, **extra)), 400)
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")


def test_malformed_json_unknown_model_and_route(server: ServerProcess) -> None:
    assert error_of(post(server, "/v1/chat/completions", "{bad"), 400)["code"] == "invalid_json"
    assert error_of(post(server, "/v1/completions", b"\xff"), 400)["code"] == "invalid_json"
    body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]})
    assert error_of(post(server, "/v1/chat/completions", body), 404)["code"] == "model_not_found"
    assert error_of(request(server, "GET", "/v1/nothing"), 404)["code"] == "not_found"
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=server.model, messages=[], max_tokens=1)


def test_api_key_and_body_limit(model: Path) -> None:
    args = ["--max-body", "2K", "--cors-origin", "http://localhost:3000"]
    with running(model, *args, env={"MLXCACHE_API_KEY": "sekret"}) as srv:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = post(srv, "/v1/chat/completions", chat_body(srv, max_tokens=1), **headers)
            assert error_of(r, 401)["code"] == "invalid_api_key"
        assert request(srv, "GET", "/v1/models").status_code == 401
        assert request(srv, "GET", "/v1/models", Authorization="bearer sekret").status_code == 200
        assert request(srv, "GET", "/health").status_code == 200
        preflight = request(
            srv,
            "OPTIONS",
            "/v1/chat/completions",
            Origin="http://localhost:3000",
            **{"Access-Control-Request-Method": "POST"},
        )
        assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
        with pytest.raises(openai.AuthenticationError):
            client(srv).models.list()
        ok = client(srv, "sekret").chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
        assert ok.usage.completion_tokens == 2
        big = chat_body(srv, stop=["x" * 4000])
        r = post(srv, "/v1/chat/completions", big, Authorization="Bearer sekret")
        assert error_of(r, 413)["code"] == "request_too_large"


def test_a_busy_port_is_one_line_and_exit_2(model: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["serve", "--model", str(model), "--port", str(port)]
        done = subprocess.run(
            [sys.executable, "-m", "mlxcache_cli", *args], capture_output=True, text=True
        )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1:] == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]


def test_sigterm_drains_a_running_stream(model: Path, ref: Engine) -> None:
    srv = ServerProcess(["--model", str(model), "--block-size", str(BLOCK)])
    try:
        body = {"model": srv.model, "prompt": "abab", "max_tokens": 64, "stream": True}
        conn = connect(srv)
        try:
            payloads = events(stream(conn, "/v1/completions", body))
            got = [next(payloads)]
            srv.proc.terminate()  # mid-stream: the reply still completes
            got += list(payloads)
        finally:
            conn.close()
        # A supervisor repeating itself, until the process is gone, changes nothing (the
        # default SIGTERM that uvicorn puts back would kill the drain with -15).
        deadline = time.monotonic() + 120  # only a guard against a hang
        while srv.proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.002)
        assert got[-1] == "[DONE]"
        text = "".join(
            json.loads(x)["choices"][0]["text"] for x in got[:-1] if json.loads(x)["choices"]
        )
        assert text == ref.complete(Request(ref.encoder.encode("abab"), params(max_tokens=64))).text
    finally:
        assert srv.stop() == 0


def test_a_stop_says_what_it_waits_for_and_what_was_served(model: Path) -> None:
    """SIGTERM while a long reply streams (1,000 tokens: seconds, where the server begins to
    stop within a tick of its loop): a line as the stop begins, naming the request in flight,
    and one as it ends, after the request's own log line."""
    srv = ServerProcess(["--model", str(model), "--block-size", str(BLOCK)])
    try:
        body = {"model": srv.model, "prompt": "abab", "max_tokens": 1000, "stream": True}
        conn = connect(srv)
        try:
            payloads = events(stream(conn, "/v1/completions", body))
            next(payloads)
            srv.proc.terminate()
            assert list(payloads)[-1] == "[DONE]"
        finally:
            conn.close()
    finally:
        assert srv.stop() == 0
    logged = next(i for i, line in enumerate(srv.lines) if "POST /v1/completions" in line)
    assert "generated=1000 " in srv.lines[logged]  # greedy: the same reply every run
    assert srv.lines[logged - 1 :] == [
        "mlxcache: stopping, finishing 1 request in flight",
        srv.lines[logged],
        "mlxcache: stopped, 1 request served (1 finished after the stop began)",
    ]


def test_streams_ended_every_way_leave_no_task_exception(server: ServerProcess) -> None:
    """Clients that close the moment `[DONE]` arrives (as SDKs do), that read the body to
    its end, and that leave after the first chunk: the server's log shows a line per
    request and no asyncio "Task exception was never retrieved" (nor any traceback)."""
    before = len(server.lines)
    ids: list[str] = []
    for i in range(60):
        body = {
            "model": server.model,
            "stream": True,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": f"count {i}"}],
        }
        conn = connect(server)
        try:
            items = events(stream(conn, "/v1/chat/completions", body))
            ids.append(json.loads(next(items))["id"])
            if i % 3 == 0:
                assert "[DONE]" in list(items)  # read up to [DONE], then close at once
            elif i % 3 == 1:
                assert list(items)[-1] == "[DONE]"  # and the body's end after it
        finally:
            conn.close()  # i % 3 == 2: gone after the first chunk
    for rid in ids:  # every handler is done once its request is logged
        server.wait_for(re.compile(re.escape(rid) + " "))
    idle_report(server.url)
    logged = server.lines[before:]
    assert not [line for line in logged if "exception" in line.lower() or "Traceback" in line]

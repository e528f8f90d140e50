"""What agents send gets exactly what the APIs promise (issue 53), through the real
`anthropic` and `openai` SDKs against a real `mlxcache serve`, streamed and not: Responses'
instructions beside developer items and not carried over, complete tool calls kept when
`max_tokens` cuts a later one (on every route, streamed and unstreamed agreeing), Messages'
`message_start` usage, ignored fields named, errors naming the route's own field, what the
real APIs refuse, a stream's log after `[DONE]`, and a client gone before the first byte.

The model is a tiny random one (seed 1) that, asked for a call, writes call after call."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from test_server_agents import ASK, WEATHER
from tinymodel import write_tiny_gguf

from mlxcache.server.process import MlxcacheServer, running

pytestmark = pytest.mark.slow  # a server in a child process

BLOCK = 16
CLAUDE, GPT = "claude-sonnet-4-5", "gpt-5"
CUT = 120
"""Tokens that hold the model's first call whole (83 tokens) and cut its second."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlxcacheServer]:
    folder = tmp_path_factory.mktemp("fidelity")
    write_tiny_gguf(folder / "calls.gguf", context=4096, seed=1)
    args = ["--block-size", str(BLOCK), "--cache-dir", str(folder / "cache"), "--no-warm-ahead"]
    with running(folder / "calls.gguf", *args, "-n", "24", "--alias", CLAUDE, "--alias", GPT) as s:
        yield s


def claude(srv: MlxcacheServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)


def oai(srv: MlxcacheServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def chat_reply(srv: MlxcacheServer, **fields: Any) -> Any:
    return oai(srv).chat.completions.create(model=GPT, **fields)


def last_response(stream: Any) -> Any:
    """A Responses stream's final Response (cut by max_output_tokens or not)."""
    ends = ("response.completed", "response.incomplete")
    return next(e.response for e in stream if e.type in ends)


# -- 1, 2: Responses' instructions ----------------------------------------------------------


def test_responses_keeps_developer_items_after_the_instructions(server: MlxcacheServer) -> None:
    items = [
        {"role": "developer", "content": "Sandbox: read-only."},
        {"role": "user", "content": ASK},
        {"role": "system", "content": "Be brief."},
    ]
    want = chat_reply(
        server,
        messages=[{"role": "system", "content": "You are terse."}, *items],
        max_tokens=12,
    )
    client = oai(server)
    fields: dict[str, Any] = {"model": GPT, "instructions": "You are terse.", "input": items}
    got = client.responses.create(**fields, max_output_tokens=12)
    assert got.usage is not None and got.usage.input_tokens == want.usage.prompt_tokens
    assert got.output_text == want.choices[0].message.content
    with client.responses.stream(**fields, max_output_tokens=12) as stream:
        final = last_response(stream)
    assert final.output_text == got.output_text
    assert final.usage is not None and final.usage.input_tokens == got.usage.input_tokens


def test_previous_response_id_does_not_carry_the_instructions(server: MlxcacheServer) -> None:
    client = oai(server)
    first = client.responses.create(
        model=GPT, instructions="Answer in French.", input=ASK, max_output_tokens=6
    )
    second = client.responses.create(
        model=GPT, previous_response_id=first.id, input="And another?", max_output_tokens=6
    )
    want = chat_reply(
        server,
        messages=[
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"},
        ],
        max_tokens=6,
    )
    assert second.instructions is None
    assert second.usage is not None and second.usage.input_tokens == want.usage.prompt_tokens
    assert second.output_text == want.choices[0].message.content


# -- 3: a complete call kept when max_tokens cuts the next ----------------------------------


def test_chat_keeps_the_complete_call_before_a_cut_one(server: MlxcacheServer) -> None:
    fields: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": WEATHER}],
        "tool_choice": "required",
        "max_tokens": CUT,
    }
    got = chat_reply(server, **fields)
    choice = got.choices[0]
    assert choice.finish_reason == "length" and got.usage.completion_tokens == CUT
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {
        "city"
    }
    streamed: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in oai(server).chat.completions.create(model=GPT, stream=True, **fields):
        for c in chunk.choices[0].delta.tool_calls or ():
            entry = streamed.setdefault(c.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += c.id or ""
            entry["name"] += (c.function and c.function.name) or ""
            entry["arguments"] += (c.function and c.function.arguments) or ""
        finish = chunk.choices[0].finish_reason or finish
    # The same complete call (the cut one had not got its name yet: nothing of it went out).
    assert finish == "length" and sorted(streamed) == [0]
    assert (streamed[0]["name"], streamed[0]["arguments"]) == (
        call.function.name,
        call.function.arguments,
    )


def test_messages_keep_the_complete_tool_use_before_a_cut_one(server: MlxcacheServer) -> None:
    tool = {"name": WEATHER["name"], "input_schema": WEATHER["parameters"]}
    fields: dict[str, Any] = {
        "model": CLAUDE,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "tool_choice": {"type": "any"},
        "max_tokens": CUT,
    }
    client = claude(server)
    got = client.messages.create(**fields)
    assert got.stop_reason == "max_tokens"
    [use] = got.content
    assert use.type == "tool_use" and use.name == "get_weather" and set(use.input) == {"city"}
    with client.messages.stream(**fields) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    first = final.content[0]
    assert first.type == "tool_use" and (first.name, first.input) == (use.name, use.input)
    assert [b.type for b in final.content] == ["tool_use"]


def test_responses_keep_the_complete_call_before_a_cut_one(server: MlxcacheServer) -> None:
    fields: dict[str, Any] = {
        "model": GPT,
        "input": "Weather in Paris?",
        "tools": [{"type": "function", **WEATHER}],
        "tool_choice": "required",
        "max_output_tokens": CUT,
    }
    client = oai(server)
    got = client.responses.create(**fields)
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens"
    [call] = got.output
    assert call.type == "function_call" and set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(**fields) as stream:
        seen = list(stream)
    done = [e.item for e in seen if e.type == "response.output_item.done"]
    final = next(e.response for e in seen if e.type == "response.incomplete")
    [again] = final.output
    assert (again.type, again.name, again.arguments) == ("function_call", call.name, call.arguments)
    assert [(i.type, i.status) for i in done] == [("function_call", "completed")]  # type: ignore[union-attr]


# -- 4: message_start's usage ---------------------------------------------------------------


def test_message_start_splits_cached_input_as_message_delta(server: MlxcacheServer) -> None:
    client = claude(server)
    ask = [{"role": "user", "content": "A prompt long enough to span blocks: " + "ab" * 40}]
    client.messages.create(model=CLAUDE, messages=ask, max_tokens=2)  # cached from now on
    events = list(client.messages.create(model=CLAUDE, messages=ask, max_tokens=2, stream=True))
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert start.cache_read_input_tokens and start.cache_read_input_tokens > 0
    assert (start.input_tokens, start.cache_read_input_tokens) == (
        delta.input_tokens,
        delta.cache_read_input_tokens,
    )


# -- 5: ignored fields named ----------------------------------------------------------------

IGNORED = "x-mlxcache-ignored"


def test_responses_and_messages_name_what_they_ignore(server: MlxcacheServer) -> None:
    fields: dict[str, Any] = {
        "model": GPT,
        "input": ASK,
        "max_output_tokens": 2,
        "reasoning": {"effort": "high"},
        "text": {"verbosity": "low"},
    }
    plain = oai(server).responses.with_raw_response.create(**fields)
    with oai(server).responses.with_streaming_response.create(stream=True, **fields) as streamed:
        streamed.read()
    for reply in (plain, streamed):
        assert reply.headers[IGNORED] == "reasoning.effort, text.verbosity"
    ask = {"model": CLAUDE, "messages": [{"role": "user", "content": ASK}], "max_tokens": 2}
    raw = claude(server).messages.with_raw_response
    off = raw.create(**ask, thinking={"type": "disabled"})  # type: ignore[arg-type]
    assert off.headers[IGNORED] == "thinking"
    effort = {"output_config": {"effort": "low"}}
    with claude(server).messages.with_streaming_response.create(
        **ask, stream=True, extra_body=effort
    ) as reply:
        reply.read()
        assert reply.headers[IGNORED] == "output_config.effort"
    assert IGNORED not in raw.create(**ask).headers  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as loud:
        oai(server).responses.create(**{**fields, "text": {"verbosity": "loud"}})
    assert loud.value.body["param"] == "text.verbosity"  # type: ignore[index]


# -- 6, 7: errors name the route's own field; refused as the real APIs refuse ---------------


@pytest.mark.parametrize(
    ("items", "message"),
    [
        ([], "input: give at least one message, function call or function call output"),
        (5, "input: Input should be a valid string or a valid list"),
        ([{"role": "bogus", "content": "x"}], "input.0.role: Input should be 'user', "),
        ([{"role": "user", "content": 5}], "input.0.content: Input should be a valid string or"),
        ([{"type": "function_call_output", "output": "x"}], "input.0.call_id: Field required"),
        ([{"type": "bogus"}], "input.0: Input should be an object whose type is one of 'message'"),
        (
            [{"role": "user", "content": [{"type": "bogus"}]}],
            "input.0.content.0: Input should be an object whose type is one of 'input_text'",
        ),
        (  # found past the schema, in the chat messages the items became
            [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "1"},
            ],
            "input.1: tool calls and results need the request's tools",
        ),
        ([{"role": "user", "content": "x" * 5000}], "input: the prompt has "),
    ],
)
def test_responses_errors_name_the_input_s_own_path(
    server: MlxcacheServer, items: Any, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai(server).responses.create(
            model=GPT, instructions="You are terse.", input=items, max_output_tokens=2
        )
    error = bad.value.body
    assert isinstance(error, dict) and error["param"] == message.partition(":")[0]
    assert error["message"].startswith(
        message.partition(": ")[2] if "prompt" in message else message
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (5, "messages.0.content: Input should be a valid string or a valid list"),
        (
            [{"type": "bogus"}],
            "messages.0.content.0: Input should be an object whose type is one of 'text', ",
        ),
        ([{"type": "tool_use", "name": "f", "input": {}}], "messages.0.content.0.id: Field"),
        ([{"type": "text"}], "messages.0.content.0.text: Field required"),
    ],
)
def test_messages_errors_name_the_block_s_own_path(
    server: MlxcacheServer, content: Any, message: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(server).messages.create(
            model=CLAUDE, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    error = bad.value.body
    assert isinstance(error, dict) and error["error"]["type"] == "invalid_request_error"
    assert error["error"]["message"].startswith(message)


def test_what_the_real_apis_refuse_is_refused(server: MlxcacheServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as budget:
        claude(server).messages.create(
            model=CLAUDE,
            messages=[{"role": "user", "content": ASK}],
            max_tokens=2,
            thinking={"type": "enabled", "budget_tokens": -1},
        )
    assert budget.value.body["error"]["message"] == (  # type: ignore[index]
        "thinking.budget_tokens: Input should be greater than or equal to 1024"
    )
    for thinking, message in (
        ({"type": "enabled"}, "thinking.budget_tokens: Field required"),
        (
            {"type": "enabled", "budget_tokens": 1024},
            "max_tokens: must be greater than thinking.budget_tokens",
        ),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude(server).messages.create(
                model=CLAUDE,
                messages=[{"role": "user", "content": ASK}],
                max_tokens=2,
                thinking=thinking,  # type: ignore[arg-type]
            )
        assert refused.value.body["error"]["message"] == message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as schema:
        oai(server).responses.create(
            model=GPT,
            input=ASK,
            max_output_tokens=2,
            text={"format": {"type": "json_schema", "name": "x"}},  # type: ignore[typeddict-item]
        )
    assert schema.value.body["param"] == "text.format.schema"  # type: ignore[index]


# -- 9, 10: the request log after [DONE]; a client gone before the first byte --------------


def raw_post(srv: MlxcacheServer, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=120)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    conn.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return conn


def metric(srv: MlxcacheServer, path: str, status: int) -> int:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=60) as reply:
        text = reply.read().decode()
    found = re.search(
        rf'^mlxcache_requests_total\{{path="{re.escape(path)}",status="{status}"\}} (\d+)$',
        text,
        re.M,
    )
    return int(found.group(1)) if found else 0


def test_a_stream_read_to_done_is_logged_with_its_counts(server: MlxcacheServer) -> None:
    path, n = "/v1/chat/completions", 40
    before = metric(server, path, 200)
    body = {"model": GPT, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    for i in range(n):
        conn = raw_post(server, path, {**body, "max_tokens": 2, "user": f"done-{i}"})
        seen = b""
        while b"data: [DONE]" not in seen:
            seen += conn.recv(65536)
        conn.close()  # at once, as a client that has all it wanted
        rid = re.search(rb'"id": ?"(chatcmpl-\w+)"', seen).group(1).decode()  # type: ignore[union-attr]
        line = server.wait_for(re.compile(re.escape(rid) + r" POST .*")).group(0)
        assert re.search(r" 200 prompt=\d+ cached=\d+ generated=2 ", line), line
        assert "disconnected" not in line
    assert metric(server, path, 200) == before + n


def lines(srv: MlxcacheServer, pattern: re.Pattern[str]) -> list[str]:
    return [line for line in list(srv.lines) if pattern.search(line)]


def idle(srv: MlxcacheServer) -> dict[str, Any]:
    for _ in range(1200):
        with urllib.request.urlopen(srv.url + "/v1/cache", timeout=60) as reply:
            report: dict[str, Any] = json.loads(reply.read())
        if not report["busy"]:
            return report
        time.sleep(0.05)
    raise AssertionError("the server stayed busy")


LONG = "The quick brown fox jumps over the lazy dog. " * 75  # ~3400 prompt tokens


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1 " + LONG}]}),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": "2 " + LONG}], "max_tokens": 4},
        ),
        ("/v1/responses", {"input": "3 " + LONG}),
    ],
)
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_the_first_byte_is_cancelled_at_once(
    server: MlxcacheServer, path: str, body: dict[str, Any], stream: bool
) -> None:
    mark = f"{path[4:]} {stream}"  # another prompt per case: nothing of it is cached yet
    text = f"{mark} {LONG}"
    if "input" in body:
        body = {"input": text}
    else:
        body = {**body, "messages": [{"role": "user", "content": text}]}
    gone = re.compile(rf"POST {re.escape(path)} \S+ .*finish=disconnected")
    before = len(lines(server, gone))
    conn = raw_post(server, path, {"model": GPT, **body, "stream": stream})
    conn.close()  # before any byte of the reply
    for _ in range(1200):  # its log line comes once the route has let it go
        if len(lines(server, gone)) > before:
            break
        time.sleep(0.05)
    assert len(lines(server, gone)) == before + 1
    assert idle(server)["pinned_entries"] == 0
    # The next request is served; its prompt's prefill had stopped early: little of it was
    # kept (a request left running would have kept all of it).
    again = chat_reply(server, messages=[{"role": "user", "content": text}], max_tokens=1)
    assert again.usage.prompt_tokens > 3000
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens // 2

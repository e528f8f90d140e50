"""The APIs coding agents speak, through their own SDKs, unchanged: Anthropic's Messages
(`anthropic`) and OpenAI's Responses (`openai`'s `client.responses`). A reply through either
is the chat completion's for the same conversation and sampling, byte for byte."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from mlxcache.server.process import MlxcacheServer, running

pytestmark = pytest.mark.slow  # a server in a child process

ALIASES = ("claude-sonnet-4-5", "gpt-5")
SYSTEM = "You are terse."
ASK = "Name a color and a fruit."
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server(wide_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlxcacheServer]:
    cache = tmp_path_factory.mktemp("agents-cache")
    args = ["--block-size", "16", "--cache-dir", str(cache), "--no-warm-ahead", "-n", "24"]
    with running(wide_gguf, *args, *(x for a in ALIASES for x in ("--alias", a))) as srv:
        yield srv


def claude(srv: MlxcacheServer, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)


def oai(srv: MlxcacheServer, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0)


def chat_reply(srv: MlxcacheServer, **fields: Any) -> Any:
    """The chat completion the other routes must equal (model: the served id)."""
    model = oai(srv).models.list().data[0].id
    return oai(srv).chat.completions.create(model=model, **fields)


# -- Anthropic Messages -------------------------------------------------------------------


@pytest.mark.check  # the fast tier's smoke of the agents' APIs
def test_messages_create_and_stream_equal_chat_completions(server: MlxcacheServer) -> None:
    messages = [{"role": "user", "content": ASK}]
    want = chat_reply(
        server,
        messages=[{"role": "system", "content": SYSTEM}, *messages],
        max_tokens=20,
        temperature=0.7,
    )
    client = claude(server)
    hot = {"temperature": 0.7}  # sampling fields: older SDKs' arguments, still read
    got = client.messages.create(
        model=ALIASES[0], system=SYSTEM, messages=messages, max_tokens=20, extra_body=hot
    )
    assert [b.type for b in got.content] == ["text"]
    assert got.content[0].text == want.choices[0].message.content
    assert (
        got.stop_reason
        == {"stop": "end_turn", "length": "max_tokens"}[want.choices[0].finish_reason]
    )
    assert got.usage.output_tokens == want.usage.completion_tokens
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.usage.prompt_tokens
    assert got.usage.cache_read_input_tokens > 0  # the same prompt again: resumed
    with client.messages.stream(
        model=ALIASES[0], system=SYSTEM, messages=messages, max_tokens=20, extra_body=hot
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == got.content[0].text
    assert (
        final.stop_reason == got.stop_reason
        and final.usage.output_tokens == got.usage.output_tokens
    )
    count = client.messages.count_tokens(model=ALIASES[0], system=SYSTEM, messages=messages)
    assert count.input_tokens == want.usage.prompt_tokens


def test_messages_tool_use_round_trip(server: MlxcacheServer) -> None:
    client = claude(server)
    tool = {"name": WEATHER["name"], "description": WEATHER["description"]}
    tools = [{**tool, "input_schema": WEATHER["parameters"]}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    got = client.messages.create(
        model=ALIASES[0], messages=ask, tools=tools, tool_choice={"type": "any"}, max_tokens=120
    )
    assert got.stop_reason == "tool_use"
    use = next(b for b in got.content if b.type == "tool_use")
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    want = chat_reply(
        server,
        messages=ask,
        tools=[{"type": "function", "function": WEATHER}],
        tool_choice="required",
        max_tokens=120,
    )
    call = want.choices[0].message.tool_calls[0].function
    assert (call.name, json.loads(call.arguments)) == (use.name, use.input)
    # The result goes back; the answer is the chat completion's after the same turns.
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "18 C, sunny"}
    turns = [
        *ask,
        {"role": "assistant", "content": got.content},
        {"role": "user", "content": [result]},
    ]
    after = client.messages.create(model=ALIASES[0], messages=turns, tools=tools, max_tokens=16)
    history = [
        *ask,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": json.dumps(use.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "content": "18 C, sunny"},
    ]
    plain = chat_reply(
        server, messages=history, tools=[{"type": "function", "function": WEATHER}], max_tokens=16
    )
    text = "".join(b.text for b in after.content if b.type == "text")
    assert text == (plain.choices[0].message.content or "")
    # Streamed, the call comes as a tool_use block with its input as JSON deltas, sent as
    # it is written; they join to the input as JSON writes it.
    with client.messages.stream(
        model=ALIASES[0], messages=ask, tools=tools, tool_choice={"type": "any"}, max_tokens=120
    ) as stream:
        kinds = [(e.type, getattr(e, "delta", None)) for e in stream]
        final = stream.get_final_message()
    streamed = next(b for b in final.content if b.type == "tool_use")
    assert (streamed.name, streamed.input) == (use.name, use.input)
    partial = [d.partial_json for k, d in kinds if k == "content_block_delta"]
    assert len(partial) > 3 and "".join(partial) == json.dumps(use.input, ensure_ascii=False)


def test_aliases_are_listed_echoed_and_no_model_means_the_served_one(
    server: MlxcacheServer,
) -> None:
    """Issue 53, item 8: `/v1/models` lists every --alias; a reply names the model as the
    request did (an alias included), as the real APIs do; a request without `model` gets
    the served model, as mlx_lm.server's and llama.cpp's do."""
    listed = [(m.id, getattr(m, "alias_of", None)) for m in oai(server).models.list().data]
    served = server.model
    assert listed == [(served, None), *((a, served) for a in ALIASES)]
    ask = [{"role": "user", "content": ASK}]
    want = oai(server).chat.completions.create(model=served, messages=ask, max_tokens=6)
    got = oai(server).chat.completions.create(model=ALIASES[1], messages=ask, max_tokens=6)
    assert (got.model, got.choices[0].message.content) == (
        ALIASES[1],
        want.choices[0].message.content,
    )
    message = claude(server).messages.create(model=ALIASES[0], messages=ask, max_tokens=6)
    assert (message.model, message.content[0].text) == (ALIASES[0], want.choices[0].message.content)
    with claude(server).messages.stream(model=ALIASES[0], messages=ask, max_tokens=6) as stream:
        assert stream.get_final_message().model == ALIASES[0]
    response = oai(server).responses.create(model=ALIASES[1], input=ASK, max_output_tokens=6)
    assert (response.model, response.output_text) == (ALIASES[1], want.choices[0].message.content)
    request = urllib.request.Request(
        server.url + "/v1/chat/completions",
        json.dumps({"messages": ask, "max_tokens": 6}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request) as reply:
        doc = json.load(reply)
    assert (doc["model"], doc["choices"][0]["message"]["content"]) == (
        served,
        want.choices[0].message.content,
    )


def test_messages_errors_are_anthropic_s(server: MlxcacheServer) -> None:
    client = claude(server)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(
            model="claude-x", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    body = missing.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in body["error"]["message"] and "--alias" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=ALIASES[0],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "x"}}],
                }
            ],
            max_tokens=4,
        )
    assert bad.value.response.json()["error"] == {
        "type": "invalid_request_error",
        "message": "messages.0.content.0: image blocks are not supported by this server",
    }
    # max_tokens is required, as Anthropic's API has it.
    body = json.dumps({"model": ALIASES[0], "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(urllib.error.HTTPError) as raw:
        urllib.request.urlopen(server.url + "/v1/messages", body.encode(), timeout=60)
    assert raw.value.code == 400
    assert json.loads(raw.value.read()) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }


# -- OpenAI Responses ---------------------------------------------------------------------


def test_responses_create_stream_and_parse(server: MlxcacheServer) -> None:
    client = oai(server)
    want = chat_reply(
        server,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
        max_tokens=20,
        temperature=0.7,
    )
    got = client.responses.create(
        model=ALIASES[1], instructions=SYSTEM, input=ASK, max_output_tokens=20, temperature=0.7
    )
    assert got.output_text == want.choices[0].message.content
    assert got.usage.input_tokens == want.usage.prompt_tokens
    assert got.usage.input_tokens_details.cached_tokens > 0
    with client.responses.stream(
        model=ALIASES[1], instructions=SYSTEM, input=ASK, max_output_tokens=20, temperature=0.7
    ) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == got.output_text

    class City(BaseModel):
        city: str = Field(max_length=8)

    parsed = client.responses.parse(
        model=ALIASES[1], input="Capital of France?", text_format=City, max_output_tokens=48
    )
    assert isinstance(parsed.output_parsed, City)
    # The same schema (the SDK writes it from the model) through chat completions.
    model = client.models.list().data[0].id
    same = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Capital of France?"}],
        response_format=City,
        max_tokens=48,
    )
    assert parsed.output_text == same.choices[0].message.content


def test_responses_function_call_and_previous_response(server: MlxcacheServer) -> None:
    client = oai(server)
    tool = {"type": "function", **WEATHER}
    first = client.responses.create(
        model=ALIASES[1],
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=120,
    )
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    # Streamed: the call's arguments in deltas as they are written, the same call at the end.
    with client.responses.stream(
        model=ALIASES[1],
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=120,
    ) as stream:
        seen = [(e.type, getattr(e, "delta", None)) for e in stream]
        done = stream.get_final_response()
    deltas = [d for k, d in seen if k == "response.function_call_arguments.delta"]
    assert len(deltas) > 3 and "".join(deltas) == call.arguments
    [again] = [item for item in done.output if item.type == "function_call"]
    assert (again.name, again.arguments) == (call.name, call.arguments)
    # The follow-up sends only the tool's output; the conversation is the stored one.
    second = client.responses.create(
        model=ALIASES[1],
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        tools=[tool],
        max_output_tokens=16,
    )
    whole = client.responses.create(
        model=ALIASES[1],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
        ],
        tools=[tool],
        max_output_tokens=16,
        store=False,
    )
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=ALIASES[1], previous_response_id=whole.id, input="and?")


def test_an_api_key_is_read_from_x_api_key_too(wide_gguf: Path, tmp_path: Path) -> None:
    args = ["--cache-dir", str(tmp_path), "--api-key", "sekret", "-n", "4"]
    with running(wide_gguf, *args) as srv:
        model = oai(srv, "sekret").models.list().data[0].id
        ok = claude(srv, "sekret").messages.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert ok.usage.output_tokens >= 1
        with pytest.raises(anthropic.AuthenticationError) as refused:
            claude(srv, "wrong").messages.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        assert refused.value.response.json()["error"]["type"] == "authentication_error"

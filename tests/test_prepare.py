"""One prepare path (`mlxcache.prepare`): a spec as the in-process `generate`, `json` and
`tools` build it gives the same engine Request in-process as through the server's path
(its body on the wire, validated, read back and prepared there), and the same prompt as
those commands built before the spec existed: replies are unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlxcache.constrain import GrammarProcessor
from mlxcache.engine import Engine, Request
from mlxcache.errors import FieldError
from mlxcache.model import LoadedModel
from mlxcache.modes import json_mode
from mlxcache.modes.json_mode import JsonTask
from mlxcache.modes.schema import check_schema
from mlxcache.modes.tool_chat import ToolsTask
from mlxcache.modes.tools import ToolChoice, parse_tools
from mlxcache.prepare import Local, prepare
from mlxcache.request_spec import RequestSpec, conversation, spec_of, to_wire
from mlxcache.sampling import SamplingParams
from mlxcache.server import prepare as server
from mlxcache.server.errors import from_domain
from mlxcache.server.schemas import ChatRequest, CompletionRequest
from mlxcache_cli import json_cmd, tools_cmd

PARAMS = SamplingParams(temperature=0.5, top_k=3, seed=4, max_tokens=7, frequency_penalty=0.5)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
TOOLS = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        {"type": "function", "function": {"name": "get_time"}},
    ]
)
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    },
    {"role": "tool", "name": "get_weather", "content": '{"temp": 20}'},
]


def served(engine: Engine, spec: RequestSpec) -> Request:
    """`spec`'s engine request through the server: sent, validated, read, prepared."""
    body = to_wire(spec)
    if spec.prompt is not None:
        completion = CompletionRequest.model_validate(body)
        return server.completion(engine, completion, SamplingParams()).request
    return server.chat(engine, ChatRequest.model_validate(body), SamplingParams()).request


def assert_same(engine: Engine, local: Request, remote: Request) -> None:
    """The fields that decide a reply's tokens: prompt, sampling, stops, draft, and the
    processors, a grammar compared by the tokens it allows after the prompt."""
    assert list(local.tokens) == list(remote.tokens)
    assert (local.sampling, local.stop_strings, local.draft, local.stop_tokens) == (
        remote.sampling,
        remote.stop_strings,
        remote.draft,
        remote.stop_tokens,
    )
    assert [type(p) for p in local.processors] == [type(p) for p in remote.processors]
    size = engine.loaded.tokenizer.vocab_size
    for a, b in zip(local.processors, remote.processors, strict=True):
        if isinstance(a, GrammarProcessor) and isinstance(b, GrammarProcessor):
            assert np.array_equal(a.allowed(size), b.allowed(size))


@pytest.mark.parametrize("raw", [False, True])
def test_generate_s_spec_is_the_server_s_request(tiny: LoadedModel, raw: bool) -> None:
    engine = Engine(tiny, warm_ahead=False)
    if raw:
        spec = RequestSpec(prompt="Once upon", sampling=PARAMS, stops=("x", "\n"))
        before = engine.encoder.encode("Once upon")
    else:
        messages = conversation("Be brief.", [{"role": "user", "content": "A cat?"}])
        spec = RequestSpec(messages, sampling=PARAMS, stops=("x",))
        before = engine.encoder.encode_chat([dict(m) for m in messages])
    local = prepare(engine, spec).request
    assert list(local.tokens) == before and local.stop_strings == spec.stops
    assert not local.processors and local.sampling == PARAMS
    assert_same(engine, local, served(engine, spec))


@pytest.mark.parametrize("instructions", [None, "Be brief."])
def test_json_s_spec_is_the_server_s_request(tiny: LoadedModel, instructions: str | None) -> None:
    engine = Engine(tiny, warm_ahead=False)
    spec = json_cmd._spec(PARAMS, SCHEMA, instructions, "A number?")
    prepared = prepare(engine, spec, think=False, local=Local(strict=False))
    task = JsonTask(check_schema(SCHEMA), instructions).for_model(tiny.tokenizer, False)
    assert prepared.json == task
    assert prepared.ids == json_mode.encode(engine, task.messages("A number?"))
    local = prepared.request
    assert [type(p) for p in local.processors] == [GrammarProcessor]
    assert_same(engine, local, served(engine, spec))


@pytest.mark.parametrize("choice", ["auto", "required", "get_weather", "none"])
def test_tools_s_spec_is_the_server_s_request(wide: LoadedModel, choice: str) -> None:
    engine = Engine(wide, warm_ahead=False)
    picked = ToolChoice.parse(choice, TOOLS)
    spec = tools_cmd._spec(PARAMS, ("\n\n",), TOOLS, picked, False, "Use tools.", TOOL_TURNS)
    prepared = prepare(engine, spec, think=False)
    task = ToolsTask(TOOLS, picked, "Use tools.", False, False)
    assert prepared.tools is not None and prepared.tools.choice == picked
    assert prepared.ids == task.encode(engine, TOOL_TURNS)
    local = prepared.request
    before = task.request(engine, prepared.ids, PARAMS)
    assert [type(p) for p in local.processors] == [type(p) for p in before.processors]
    assert_same(engine, local, served(engine, spec))


def test_the_prepare_path_s_errors_name_the_server_s_field(tiny: LoadedModel) -> None:
    engine = Engine(tiny, warm_ahead=False)
    named = {"type": "function", "function": {"name": "nope"}}
    tools = tuple(t.as_openai() for t in TOOLS)
    image = [{"type": "image_url"}]
    cases: list[tuple[dict[str, Any], str, str | None, str]] = [
        ({"tool_choice": "required"}, "tool_choice", "invalid_value", "tool_choice needs tools"),
        (
            {"tools": tools, "tool_choice": named},
            "tool_choice",
            "invalid_value",
            "tool_choice names 'nope', which is not in tools (get_weather, get_time)",
        ),
        (
            {"tools": tools, "response_format": {"type": "json_object"}},
            "tools",
            None,
            "response_format cannot be combined with tools",
        ),
        (
            {"messages": ({"role": "user", "content": image},)},
            "messages.0.content.0",
            "unsupported_value",
            "messages.0.content.0: images are not supported by this model (image_url)",
        ),
    ]
    for given, param, code, message in cases:
        spec = RequestSpec(**{"messages": ({"role": "user", "content": "hi"},), **given})
        with pytest.raises(FieldError) as caught:
            prepare(engine, spec)
        error = from_domain(caught.value)
        assert (error.status, error.param, error.code, error.message) == (400, param, code, message)


def test_a_body_with_messages_and_a_prompt_names_the_prompt() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    with pytest.raises(FieldError) as caught:
        spec_of(body)
    error = from_domain(caught.value)
    assert (error.status, error.param, error.code) == (400, "prompt", "invalid_value")
    assert error.message == "a request continues messages or a raw prompt, not both"

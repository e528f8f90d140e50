"""Tools mode library: definitions, tool_choice, the call grammar, parsing, conversations."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from grammar_accepts import accepts

from mlxcache.engine import Engine
from mlxcache.errors import GrammarError, UserInputError
from mlxcache.model import LoadedModel
from mlxcache.modes.tool_chat import (
    ToolsTask,
    add_tool_results,
    assistant_message,
    hermes_messages,
    native_tools,
    read_messages,
)
from mlxcache.modes.tool_formats import HERMES
from mlxcache.modes.tools import Tool, ToolChoice, parse_reply, parse_tools, tool_grammar
from mlxcache.sampling import SamplingParams

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
TOOLS = parse_tools([WEATHER, ADD])


def test_a_function_without_parameters_takes_no_arguments(tiny: LoadedModel) -> None:
    (ping,) = parse_tools([{"type": "function", "function": {"name": "ping"}}])
    assert ping.parameters == {"type": "object", "properties": {}}
    grammar = tool_grammar((ping,), ToolChoice("required"))
    assert accepts(tiny, grammar, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    assert not accepts(
        tiny, grammar, '<tool_call>\n{"name": "ping", "arguments": {"x": 1}}\n</tool_call>'
    )


def test_parse_tools_accepts_openai_bare_and_single() -> None:
    weather, add = TOOLS
    assert (weather.name, weather.description, add.name, add.description) == (
        "get_weather",
        "Current weather in a city",
        "add",
        "",
    )
    assert weather.as_openai() == WEATHER
    assert parse_tools(ADD) == (add,)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "tools has no tool (expected a list of function definitions)"),
        ([3], "tools entry 0: expected an object, got int"),
        ([{"type": "retrieval"}], 'tools entry 0: only "type": "function" tools are supported'),
        ([{"parameters": {}}], "tools entry 0: name must be a string of [A-Za-z0-9_-], got None"),
        ([{"name": "a b", "parameters": {}}], "name must be a string of [A-Za-z0-9_-], got 'a b'"),
        (
            [{"name": "f", "parameters": {"type": "string"}}],
            'tool \'f\': parameters must be a JSON Schema with "type": "object"',
        ),
        ([ADD, ADD], "tools: tool 'add' is defined twice"),
    ],
)
def test_bad_tools(doc: Any, message: str) -> None:
    with pytest.raises(UserInputError) as info:
        parse_tools(doc)
    assert str(info.value).endswith(message)


def test_bad_parameters_schema_names_the_location() -> None:
    bad = {"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "nope"}}}}
    with pytest.raises(
        GrammarError,
        match=r"^tool 'f' parameters is not valid JSON Schema at /properties/n/type \(anyOf\): ",
    ):
        parse_tools([bad])


def test_tool_choice() -> None:
    assert ToolChoice.parse("auto", TOOLS) == ToolChoice("auto")
    assert ToolChoice.parse("add", TOOLS) == ToolChoice("function", "add")
    with pytest.raises(
        UserInputError,
        match=re.escape(
            "unknown tool 'mul' in tool_choice (auto, required, none, or one of: get_weather, add)"
        ),
    ):
        ToolChoice.parse("mul", TOOLS)
    with pytest.raises(ValueError):
        ToolChoice("function")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("required", False, CALL, True),
        ("required", False, ADD_CALL, True),
        ("required", False, "Sure. " + CALL, False),  # required: a call and nothing else
        ("required", False, CALL.replace("Paris", "Paris, the capital"), False),  # maxLength
        ("required", False, CALL.replace("get_weather", "get_time"), False),
        ("required", False, CALL + "\n" + ADD_CALL, False),
        ("required", True, CALL + "\n" + ADD_CALL, True),
        ("add", False, ADD_CALL, True),
        ("add", False, CALL, False),
        ("auto", False, "Hello there <b>!", True),
        ("auto", False, "Let me check. " + CALL, True),
        ("auto", False, "<tool_call>\nnot json", False),
        ("auto", False, CALL + " and more", False),
    ],
)
def test_tool_grammar(tiny: LoadedModel, choice: str, parallel: bool, text: str, ok: bool) -> None:
    grammar = tool_grammar(TOOLS, ToolChoice.parse(choice, TOOLS), parallel)
    assert accepts(tiny, grammar, text) is ok


def test_none_has_no_grammar() -> None:
    assert tool_grammar(TOOLS, ToolChoice("none")) is None


def test_required_makes_even_a_random_model_call(tiny: LoadedModel) -> None:
    engine = Engine(tiny)
    task = ToolsTask(TOOLS, ToolChoice("required"))
    req = task.request(engine, engine.encoder.encode("x"), SamplingParams(max_tokens=120))
    assert task.style is not None and task.style.grammar is not None and not task.style.native
    result = engine.complete(req)
    reply = task.read(result)
    assert result.finish_reason == "stop" and reply.error is None
    assert len(reply.calls) == 1 and reply.calls[0].name in ("get_weather", "add")


def test_parse_reply() -> None:
    reply = parse_reply("Checking.\n" + CALL + "\n" + ADD_CALL, TOOLS)
    assert reply.content == "Checking." and reply.error is None
    assert [c.as_dict() for c in reply.calls] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "add", "arguments": {"a": 1, "b": 2}},
    ]
    as_string = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse_reply(as_string, TOOLS).calls[0].arguments == {"a": 1, "b": 2}
    assert parse_reply("just text", TOOLS) == parse_reply("  just text\n", TOOLS)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "<tool_call>{nope}</tool_call>",
            "a tool call cannot be read (json_tools format): Expecting property name",
        ),
        ('<tool_call>{"name": "mul"}</tool_call>', "a tool call names an unknown tool 'mul'"),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',
            "the arguments of 'add' do not fit its parameters: required at /: 'b' is a required "
            "property",
        ),
        ('<tool_call>\n{"name": "add", "argu', "a tool call was cut off before </tool_call>"),
    ],
)
def test_parse_reply_errors(text: str, error: str) -> None:
    reply = parse_reply(text, TOOLS)
    assert reply.error is not None and reply.error.startswith(error)
    assert reply.calls == ()


def test_conversation_round_trip() -> None:
    reply = parse_reply(CALL, TOOLS)
    messages = [{"role": "user", "content": "Weather in Paris?"}, assistant_message(reply)]
    again = read_messages(json.loads(json.dumps(messages)))
    assert again == messages
    done = add_tool_results(again, [("get_weather", '{"temp": 21}')])
    assert done[-1] == {"role": "tool", "name": "get_weather", "content": '{"temp": 21}'}
    rendered = hermes_messages(done, TOOLS[:1], "Be brief.")
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in rendered[0]["content"]
    assert rendered[2]["content"] == CALL
    assert rendered[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'


def test_openai_style_messages_are_normalized() -> None:
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    msgs = read_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert msgs == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}],
        }
    ]


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"role": "user"}, "messages must be a JSON list of messages"),
        ([{"role": "robot", "content": "x"}], "messages message 0: expected an object with role"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "only the first"),
        (
            [{"role": "tool", "content": "1"}],
            "messages message 0: a tool message needs the tool's name",
        ),
        ([{"role": "user", "content": 3}], "messages message 0: content must be a string"),
    ],
)
def test_bad_messages(doc: Any, message: str) -> None:
    with pytest.raises(UserInputError, match=re.escape(message)):
        read_messages(doc)


def test_tool_results_must_answer_the_last_calls() -> None:
    with pytest.raises(UserInputError, match="does not end with one"):
        add_tool_results([{"role": "user", "content": "x"}], [("add", "3")])
    last = assistant_message(parse_reply(ADD_CALL, TOOLS))
    with pytest.raises(UserInputError, match=re.escape("no call to get_weather (it called: add)")):
        add_tool_results([last], [("get_weather", "3")])


class FakeTemplate:
    """A tokenizer whose template renders tools in the Hermes format (as Qwen's does)."""

    chat_template = "... <tool_call> {{ tool_call.name }} ..."  # what mlx-lm infers json_tools from

    def __init__(self, renders_tools: bool) -> None:
        self.renders_tools = renders_tools

    def apply_chat_template(self, messages: Any, tools: Any = None, **kw: Any) -> str:
        return json.dumps([messages, tools if self.renders_tools else None])


def test_native_tools_detection(tiny: LoadedModel) -> None:
    assert native_tools(FakeTemplate(True)) is HERMES
    assert native_tools(FakeTemplate(False)) is None  # has the tags but ignores tools=
    assert native_tools(tiny.tokenizer) is None  # ChatML without tools


def test_tool_is_validated() -> None:
    with pytest.raises(ValueError, match="parameters must have"):
        Tool("f", {"type": "string"})

"""Tool-call formats of the common model families, on a tiny model with a template per family.

Each template is minimal and written here in its family's style: it names the call syntax
(which is what mlx-lm infers the tool parser from) and renders the tools it is given.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from grammar_accepts import accepts

from mlxcache.engine import Engine
from mlxcache.model import LoadedModel
from mlxcache.modes.call_stream import CallsSent
from mlxcache.modes.tool_chat import ToolsTask, native_tools
from mlxcache.modes.tool_formats import FORMATS, MISTRAL_JSON, blocks
from mlxcache.modes.tools import ToolCall, ToolChoice, parse_reply, parse_tools, tool_grammar
from mlxcache.sampling import SamplingParams
from mlxcache.server.text import ReplyText

TOOLS = parse_tools(
    [
        {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["C", "F"]},
                },
                "required": ["city"],
            },
        },
        {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    ]
)
ADD = ToolCall("add", {"a": 1, "b": 2})
PARIS = ToolCall("get_weather", {"city": "Paris"})


def template(how: str) -> str:
    """ChatML with the tools and the family's call syntax in a system block."""
    return (
        "{% if tools %}<|im_start|>system\n{% raw %}" + how + "{% endraw %}\n{{ tools | tojson }}"
        "<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# family -> (how its template shows a call, an add(1, 2) call, a get_weather("Paris") call)
FAMILIES: dict[str, tuple[str, str, str]] = {
    "json_tools": (
        "<tool_call>{{ tool_call.name }}</tool_call>",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n"
        "</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    "pythonic": (
        "<|tool_call_start|>[name(key=value)]<|tool_call_end|>",
        "<|tool_call_start|>[add(a=1, b=2)]<|tool_call_end|>",
        '<|tool_call_start|>[get_weather(city="Paris")]<|tool_call_end|>',
    ),
    "mistral": (
        "[TOOL_CALLS]name[ARGS]{arguments}",
        '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
    ),
    "mistral_list": (
        '[TOOL_CALLS][{"name": name, "arguments": {...}}]',
        '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]',
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ),
    "gemma4": (
        '<|tool_call>call:name{key:<|"|>text<|"|>}<tool_call|>',
        "<|tool_call>call:add{a:1,b:2}<tool_call|>",
        '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    ),
    "function_gemma": (
        "<start_function_call>call:name{key:<escape>text<escape>}<end_function_call>",
        "<start_function_call>call:add{a:1,b:2}<end_function_call>",
        "<start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>",
    ),
}


@pytest.fixture
def family(request: pytest.FixtureRequest, wide: LoadedModel) -> Iterator[str]:
    """The wide tiny model wearing one family's template (restored afterwards)."""
    hf = wide.tokenizer._tokenizer
    saved = hf.chat_template
    hf.chat_template = template(FAMILIES[request.param][0])
    try:
        yield request.param
    finally:
        hf.chat_template = saved


def parser_of(family: str) -> str:
    return "mistral" if family == "mistral_list" else family


def mlx_lm_reads(fmt_parser: str, text: str, fmt: Any) -> list[dict[str, Any]]:
    """What mlx-lm's own parser reads from each call block of `text`."""
    module = importlib.import_module(f"mlx_lm.tool_parsers.{fmt_parser}")
    openai = [t.as_openai() for t in TOOLS]
    out: list[dict[str, Any]] = []
    for segment in blocks(text, fmt)[1]:
        parsed = module.parse_tool_call(segment, openai)
        out += parsed if isinstance(parsed, list) else [parsed]
    return out


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_format_is_inferred_forced_and_read_back(wide: LoadedModel, family: str) -> None:
    fmt = native_tools(wide.tokenizer)
    assert fmt is not None and fmt.parser == parser_of(family) and fmt.call is not None
    _, add, paris = FAMILIES[family]
    required = tool_grammar(TOOLS, ToolChoice("required"), fmt=fmt)
    assert accepts(wide, required, add) and accepts(wide, required, paris)
    assert not accepts(wide, required, "Sure. " + add)  # required: a call, nothing else
    assert not accepts(wide, required, add.replace("add", "mul"))
    assert not accepts(wide, required, paris.replace("Paris", "Paris, the capital"))  # maxLength
    named = tool_grammar(TOOLS, ToolChoice("function", "add"), fmt=fmt)
    assert accepts(wide, named, add) and not accepts(wide, named, paris)
    auto = tool_grammar(TOOLS, ToolChoice("auto"), fmt=fmt)
    assert accepts(wide, auto, "Hello there!") and accepts(wide, auto, "Let me see. " + add)
    assert not accepts(wide, auto, "Let me see. " + add.replace("add", "mul"))
    for text, call in ((add, ADD), (paris, PARIS)):
        reply = parse_reply(text, TOOLS, fmt)
        assert reply == parse_reply(text, TOOLS, fmt) and reply.error is None
        assert reply.calls == (call,) and reply.content == ""
        assert [c.as_dict() for c in reply.calls] == mlx_lm_reads(fmt.parser, text, fmt)


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_random_model_calls_in_its_family_format(wide: LoadedModel, family: str) -> None:
    engine = Engine(wide)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in (ToolChoice("required"), ToolChoice("function", "add")):
        task = ToolsTask(TOOLS, choice)
        ids = task.encode(engine, messages)
        assert task.style is not None and task.style.native
        assert task.call_start in wide.tokenizer.decode(ids) or parser_of(family) == "mistral"
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=200)
        result = engine.complete(task.request(engine, ids, params))
        reply = task.read(result)
        assert result.finish_reason == "stop" and reply.error is None, (result.text, reply.error)
        assert len(reply.calls) == 1 and reply.content == ""
        assert choice.name in (None, reply.calls[0].name)
        assert [c.as_dict() for c in reply.calls] == mlx_lm_reads(
            task.style.fmt.parser, result.text, task.style.fmt
        )
        # Streamed as the model wrote it, the call joins to the same name and arguments.
        stream = task.call_stream()
        assert stream is not None
        text = ReplyText(task.call_start, strip=True, calls=stream)
        sent = CallsSent()
        for char in result.text:
            text.add(char)
            for delta in text.new_calls():
                sent.add(delta)
        whole = [(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in reply.calls]
        assert [(sent.name(i), sent.arguments(i)) for i in range(sent.begun)] == whole
    none = ToolsTask(TOOLS, ToolChoice("none"))
    none.encode(engine, messages)
    assert none.style is not None and none.style.grammar is None


def test_a_template_without_tools_keeps_the_hermes_system_message(wide: LoadedModel) -> None:
    engine = Engine(wide)
    task = ToolsTask(TOOLS, ToolChoice("required"))
    ids = task.encode(engine, [{"role": "user", "content": "hi"}])
    assert (
        task.style is not None and not task.style.native and task.style.fmt.parser == "json_tools"
    )
    assert "You may call these functions" in wide.tokenizer.decode(ids)


def test_refs_to_definitions_resolve_in_every_format(tiny: LoadedModel) -> None:
    (temp,) = parse_tools(
        [
            {
                "name": "temp",
                "parameters": {
                    "type": "object",
                    "$defs": {"unit": {"enum": ["C", "F"]}},
                    "properties": {"unit": {"$ref": "#/$defs/unit"}},
                    "required": ["unit"],
                },
            }
        ]
    )
    for fmt in [*FORMATS.values(), MISTRAL_JSON]:
        assert tool_grammar((temp,), ToolChoice("required"), fmt=fmt) is not None, fmt.parser
    pythonic = tool_grammar((temp,), ToolChoice("required"), fmt=FORMATS["pythonic"])
    assert accepts(tiny, pythonic, '<|tool_call_start|>[temp(unit="C")]<|tool_call_end|>')
    assert not accepts(tiny, pythonic, '<|tool_call_start|>[temp(unit="K")]<|tool_call_end|>')

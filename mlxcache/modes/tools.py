"""Tool calls: definitions, tool_choice, the call grammar, and parsing calls out of a reply.

Calls are written in the model family's own format (`tool_formats`), by default Hermes
(what mlx-lm's `json_tools` parser reads, and what Qwen and Hermes models are trained on):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`required` and a named choice are grammars that allow only such calls, with arguments
valid for the tool's parameters schema; `auto` allows plain text or text then a call;
`none` leaves the reply free.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from mlxcache.constrain import grammar_error, grammar_from_lark
from mlxcache.errors import GrammarError, Setting, UserInputError, Worded
from mlxcache.fileio import loads_json
from mlxcache.modes.schema import check_schema, check_size, one_line, validation_error
from mlxcache.modes.tool_formats import HERMES, ToolFormat, blocks, grammar_lines

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""The parameters of a function defined without any: no arguments."""


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call. `parameters` is the JSON Schema of its arguments."""

    name: str
    parameters: dict[str, Any] = field(hash=False)
    description: str = ""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tool name must match [A-Za-z0-9_-]{{1,64}}, got {self.name!r}")
        if self.parameters.get("type") != "object":
            raise ValueError(f'tool {self.name!r}: parameters must have "type": "object"')

    def as_openai(self) -> dict[str, Any]:
        """The OpenAI function definition (what chat templates and the prompt show)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


def _tool(entry: Any, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise UserInputError(f"{where}: expected an object, got {type(entry).__name__}")
    fn = entry.get("function", entry) if entry.get("type", "function") == "function" else None
    if not isinstance(fn, dict):
        raise UserInputError(f'{where}: only "type": "function" tools are supported')
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise UserInputError(f"{where}: name must be a string of [A-Za-z0-9_-], got {name!r}")
    params = fn.get("parameters", NO_PARAMETERS)  # OpenAI allows a function without any
    if not isinstance(params, dict) or params.get("type") != "object":
        raise UserInputError(
            f'{where}: tool {name!r}: parameters must be a JSON Schema with "type": "object"'
        )
    check_schema(params, f"tool {name!r} parameters")
    description = fn.get("description", "")
    if not isinstance(description, str):
        raise UserInputError(f"{where}: tool {name!r}: description must be a string")
    return Tool(name, params, description)


def parse_tools(doc: Any, origin: str = "tools") -> tuple[Tool, ...]:
    """Tools from OpenAI-style definitions (`{"type": "function", "function": {...}}`),
    bare `{"name", "description", "parameters"}` objects, or a single one of either.

    Raises:
        UserInputError: a malformed definition or duplicate name.
        GrammarError: a parameters schema that is invalid or cannot be enforced, or
            definitions too large together (`check_size`).
    """
    check_size(doc, origin)  # all tools together: each one's bound alone would not bound them
    entries = doc if isinstance(doc, list) else [doc]
    if not entries:
        raise UserInputError(f"{origin} has no tool (expected a list of function definitions)")
    tools = [_tool(entry, f"{origin} entry {i}") for i, entry in enumerate(entries)]
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise UserInputError(f"{origin}: tool {dup!r} is defined twice")
    return tuple(tools)


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """`auto` (text or a call), `required` (a call), `none` (text), or one named function."""

    mode: str
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "required", "none", "function"):
            raise ValueError(f"unknown tool choice mode {self.mode!r}")
        if (self.mode == "function") != (self.name is not None):
            raise ValueError("a name goes with mode 'function' only")

    @classmethod
    def parse(cls, text: str, tools: tuple[Tool, ...]) -> ToolChoice:
        """From the CLI form: auto | required | none | NAME.

        Raises:
            UserInputError: NAME is not one of `tools`.
        """
        if text in ("auto", "required", "none"):
            return cls(text)
        names = [t.name for t in tools]
        if text not in names:
            raise UserInputError(
                Worded(
                    f"unknown tool {text!r} in ",
                    Setting("tool_choice"),
                    f" (auto, required, none, or one of: {', '.join(names)})",
                )
            )
        return cls("function", text)


def tool_grammar(
    tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = False, fmt: ToolFormat = HERMES
) -> str | None:
    """The llguidance grammar for `choice` in the call format `fmt`, or None when the reply
    is free (`none`).

    Args:
        parallel: allow several calls in one reply (otherwise the reply ends after one).
        fmt: the model family's call syntax (`tool_formats.format_for`); it must be forcing.
    """
    if choice.mode == "none":
        return None
    chosen = [
        (t.name, check_schema(t.parameters, f"tool {t.name!r} parameters").decoding)
        for t in tools
        if choice.name in (None, t.name)
    ]
    lines = grammar_lines(fmt, chosen, auto=choice.mode == "auto", parallel=parallel)
    grammar = grammar_from_lark("\n".join(["%llguidance {}", *lines]) + "\n")
    problem = grammar_error(grammar)
    if problem is not None:  # each schema compiled alone, so this is our bug, not the user's
        raise GrammarError(f"cannot build the tool call grammar: {problem}")
    return grammar


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass(frozen=True, slots=True)
class ToolReply:
    """A reply split into its text and its calls; `error` says why a call is unusable."""

    content: str
    calls: tuple[ToolCall, ...]
    error: str | None = None
    reasoning: str | None = None
    """The thinking section, apart from the content (None: none)."""


def call_arguments(args: Any) -> dict[str, Any] | str:
    """A call's arguments as an object, or what is wrong with them.

    Some models (and OpenAI's format) send the arguments as a JSON string: decoded here.
    """
    if isinstance(args, str):
        try:
            args = loads_json(args)
        except json.JSONDecodeError as exc:
            return f"arguments are not JSON: {exc.msg}"
    if not isinstance(args, dict):
        return "arguments must be a JSON object"
    return args


def check_call(raw: Any, tools: dict[str, Tool]) -> ToolCall | str:
    """A parsed call ({"name", "arguments"}) checked against its tool, or what is wrong."""
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return 'a tool call is not {"name": ..., "arguments": {...}}'
    tool = tools.get(raw["name"])
    if tool is None:
        return f"a tool call names an unknown tool {raw['name']!r}"
    args = call_arguments(raw.get("arguments", {}))
    if isinstance(args, str):
        return f"{tool.name!r}: {args}"
    problem = validation_error(args, tool.parameters)
    if problem is not None:
        return f"the arguments of {tool.name!r} do not fit its parameters: {problem}"
    return ToolCall(tool.name, args)


def parse_reply(text: str, tools: tuple[Tool, ...], fmt: ToolFormat = HERMES) -> ToolReply:
    """Split `text` into content and the calls written in `fmt`, read with mlx-lm's parser
    for that format and each checked against its tool's schema."""
    by_name = {t.name: t for t in tools}
    openai = [t.as_openai() for t in tools]
    content, segments, cut = blocks(text, fmt)
    calls: list[ToolCall] = []
    for segment in segments:
        try:
            raws = fmt.parse(segment, openai)
        except ValueError as exc:
            problem = one_line(f"a tool call cannot be read ({fmt.parser} format): {exc}", 200)
            return ToolReply(text.strip(), tuple(calls), problem)
        for raw in raws:
            call = check_call(raw, by_name)
            if isinstance(call, str):
                return ToolReply(text.strip(), tuple(calls), call)
            calls.append(call)
    if cut:
        return ToolReply(content.strip(), tuple(calls), "a tool call was cut off before " + fmt.end)
    return ToolReply(content.strip(), tuple(calls))

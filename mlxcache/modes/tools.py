"""Tool calls: definitions, tool_choice, the call grammar, and parsing calls out of a reply.

Calls use the Hermes format (what mlx-lm's `json_tools` parser reads, and what Qwen and
Hermes models are trained on):

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

from mlxcache.constrain import JSON_OPTIONS, LENIENT_OPTIONS, grammar_error, grammar_from_lark
from mlxcache.errors import GrammarError, UserInputError
from mlxcache.fileio import loads_json
from mlxcache.modes.schema import check_schema, validation_error

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)" + re.escape(CALL_END), re.DOTALL)


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
        GrammarError: a parameters schema that is invalid or cannot be enforced.
    """
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
                f"unknown tool {text!r} in --tool-choice (auto, required, none, or one of: "
                f"{', '.join(names)})"
            )
        return cls("function", text)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # JSON string escapes are valid in llguidance's Lark literals


def tool_grammar(tools: tuple[Tool, ...], choice: ToolChoice, parallel: bool = False) -> str | None:
    """The llguidance grammar for `choice`, or None when the reply is free (`none`).

    Args:
        parallel: allow several calls in one reply (otherwise the reply ends after one).
    """
    if choice.mode == "none":
        return None
    chosen = [t for t in tools if choice.name in (None, t.name)]
    rules = []
    for i, tool in enumerate(chosen):
        decoding = check_schema(tool.parameters, f"tool {tool.name!r} parameters").decoding
        args = {**decoding, "x-guidance": {**JSON_OPTIONS, **LENIENT_OPTIONS}}
        head = _lark_string(f'{{"name": "{tool.name}", "arguments": ')
        rules.append(f"call_{i}: {head} args_{i} " + _lark_string("}"))
        rules.append(f"args_{i}: %json {json.dumps(args)}")
    body = " | ".join(f"call_{i}" for i in range(len(chosen)))
    more = f" ({_lark_string(chr(10) + CALL_START)} body)*" if parallel else ""
    lines = ["%llguidance {}"]
    if choice.mode == "auto":
        # Text may not contain the call tag, so once the model writes it a valid call must
        # follow (the lazy `pre` lexeme ends right at the tag).
        lines += [
            f"start: TEXT | pre body{more}",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){re.escape(CALL_START)}(?s:.*)/",
            f"pre[lazy]: /(?s:.*){re.escape(CALL_START)}/",
        ]
    else:
        lines.append(f"start: {_lark_string(CALL_START)} body{more}")
    lines.append(f"body: {_lark_string(chr(10))} ({body}) {_lark_string(chr(10) + CALL_END)}")
    grammar = grammar_from_lark("\n".join(lines + rules) + "\n")
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


def _check_call(raw: str, tools: dict[str, Tool]) -> ToolCall | str:
    try:
        obj = loads_json(raw)
    except json.JSONDecodeError as exc:
        return f"a tool call is not JSON: {exc.msg} at column {exc.colno}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'a tool call is not {"name": ..., "arguments": {...}}'
    tool = tools.get(obj["name"])
    if tool is None:
        return f"a tool call names an unknown tool {obj['name']!r}"
    args = call_arguments(obj.get("arguments", {}))
    if isinstance(args, str):
        return f"{tool.name!r}: {args}"
    problem = validation_error(args, tool.parameters)
    if problem is not None:
        return f"the arguments of {tool.name!r} do not fit its parameters: {problem}"
    return ToolCall(tool.name, args)


def parse_reply(text: str, tools: tuple[Tool, ...]) -> ToolReply:
    """Split `text` into content and Hermes calls, each checked against its tool's schema."""
    by_name = {t.name: t for t in tools}
    calls: list[ToolCall] = []
    for raw in _CALL.findall(text):
        call = _check_call(raw, by_name)
        if isinstance(call, str):
            return ToolReply(text.strip(), tuple(calls), call)
        calls.append(call)
    content = _CALL.sub("", text)
    if CALL_START in content:
        cut = content[: content.index(CALL_START)].strip()
        return ToolReply(cut, tuple(calls), "a tool call was cut off before " + CALL_END)
    return ToolReply(content.strip(), tuple(calls))

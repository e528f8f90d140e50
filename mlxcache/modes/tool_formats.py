"""How each model family writes tool calls: detecting it, forcing it, reading it back.

The format is the one mlx-lm infers from the chat template (its `tool_parsers` module
names), and calls are read back with mlx-lm's own parser for it. For these formats a
grammar can force a call (`required`, a named tool) or keep a started call valid (`auto`):

    json_tools    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>    (Hermes, Qwen)
    mistral       [TOOL_CALLS]f[ARGS]{...}   or   [TOOL_CALLS][{"name": "f", "arguments": {...}}]
    pythonic      <|tool_call_start|>[f(a="x", n=1)]<|tool_call_end|>             (LFM2, Llama 3.2 style)
    qwen3_coder   <tool_call>\\n<function=f>\\n<parameter=a>\\nx\\n</parameter>\\n</function>\\n</tool_call>
    gemma4        <|tool_call>call:f{a:<|"|>x<|"|>,n:1}<tool_call|>
    function_gemma <start_function_call>call:f{a:<escape>x<escape>,n:1}<end_function_call>

Other formats mlx-lm knows (GLM, Kimi, MiniMax...) are read back, not forced.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlxcache.constrain import JSON_OPTIONS, LENIENT_OPTIONS, regex_literal

Rules = list[str]
"""Lark rule lines (llguidance dialect)."""
_ARG_OPTIONS = {**JSON_OPTIONS, **LENIENT_OPTIONS}


def lark_string(text: str) -> str:
    """`text` as a Lark literal (JSON string escapes are valid in llguidance's Lark)."""
    return json.dumps(text)


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark expression for one JSON value valid against `schema`, laid out as JSON_OPTIONS."""
    return f"%json {json.dumps({**schema, 'x-guidance': _ARG_OPTIONS})}"


def _until(name: str, delimiter: str, schema: dict[str, Any] | None = None) -> str:
    """A lazy lexeme: text up to and including the first `delimiter`, as long as the
    string `schema` allows (minLength/maxLength; other string rules are checked after)."""
    schema = schema or {}
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    length = f"{{{int(low)},{int(high)}}}" if isinstance(high, int) else f"{{{int(low)},}}"
    return f"{name}[lazy]: /(?s:.){length}{regex_literal(delimiter)}/"


@dataclass(frozen=True, slots=True)
class Param:
    """One property of a tool's decoding schema, in schema order."""

    name: str
    schema: dict[str, Any]
    required: bool

    @property
    def strings(self) -> list[str] | None:
        """The only values when they are a fixed set of strings (enum/const), else None."""
        values = self.schema.get("enum", [self.schema["const"]] if "const" in self.schema else None)
        if isinstance(values, list) and values and all(isinstance(v, str) for v in values):
            return values
        return None

    @property
    def is_string(self) -> bool:
        return self.schema.get("type") == "string" or self.strings is not None


def params(decoding: dict[str, Any]) -> list[Param]:
    """The listed properties of a tool's (closed, decoding) parameters schema, each with
    the root's definitions so its `$ref`s still resolve on their own."""
    props = decoding.get("properties", {})
    required = set(decoding.get("required", []))
    defs: dict[str, Any] = {k: decoding[k] for k in ("definitions", "$defs") if k in decoding}
    return [
        Param(k, {**v, **defs} if isinstance(v, dict) else {}, k in required)
        for k, v in props.items()
    ]


def sequence(prefix: str, items: list[tuple[str, bool]], sep: str) -> tuple[str, Rules]:
    """Rules writing `items` (expression, required) in order, optional ones skippable,
    `sep` between those written. Returns the start rule's name and the rules."""
    n = len(items)
    rules = [f"{prefix}_rest_{n}: {lark_string('')}", f"{prefix}_first_{n}: {lark_string('')}"]
    for i in range(n - 1, -1, -1):
        expr, required = items[i]
        rest, first = f"{prefix}_rest_{i + 1}", f"{prefix}_first_{i + 1}"
        with_it = f"{lark_string(sep)} {expr} {rest}"
        rules.append(f"{prefix}_rest_{i}: {with_it}" + ("" if required else f" | {rest}"))
        rules.append(f"{prefix}_first_{i}: {expr} {rest}" + ("" if required else f" | {first}"))
    return f"{prefix}_first_0", rules


CallGrammar = Callable[[str, dict[str, Any], str], tuple[str, Rules]]
"""Grammar of one call: (rule prefix, decoding parameters schema, tool name) ->
(expression, extra rules)."""


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's call syntax.

    A block is `start open CALLS close end`; `end` "" means the block runs to the end of
    the reply (Mistral). Several calls go in one block separated by `list_sep` when the
    family lists them (pythonic, Mistral), else in blocks separated by `block_sep`.
    """

    parser: str
    """mlx-lm's tool parser module (mlx_lm.tool_parsers.<parser>)."""
    start: str
    end: str
    call: CallGrammar | None = None
    """None: read back only, never forced."""
    open: str = ""
    close: str = ""
    list_sep: str | None = None
    block_sep: str = ""
    call_head: tuple[str, str] | None = None
    """The text a call writes before its name and between the name and its arguments
    (`call_stream` reads calls by it as they are written, their arguments as `arguments`
    says); None: the calls are read once the reply ends."""
    arguments: str = "json"
    """How a call writes its arguments after its head: "json" (an object), "keywords"
    (`key=VALUE, ...)`, a Python call, each VALUE JSON), "xml" (`<parameter=key>` elements
    up to `</function>`), "key_value" (Gemma 4's `key:VALUE,...}`, strings between
    `GEMMA_QUOTE`s, the rest JSON) or "cut" (FunctionGemma's `key:VALUE,...}`, which its
    parser cuts at the first "}" and reads the first call of a block only)."""

    def parse(self, segment: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The calls in one block's inner text as mlx-lm's parser reads them.

        Raises:
            ValueError: the parser cannot read it (mlx-lm raises various errors; all map here).
        """
        module = importlib.import_module(f"mlx_lm.tool_parsers.{self.parser}")
        try:
            parsed = module.parse_tool_call(segment, tools)
        except Exception as exc:  # the parsers raise ValueError, JSONDecodeError, KeyError...
            raise ValueError(str(exc) or type(exc).__name__) from exc
        calls = parsed if isinstance(parsed, list) else [parsed]
        if not all(isinstance(c, dict) for c in calls):
            raise ValueError("not a tool call")
        return calls


def _alternatives(exprs: list[str]) -> str:
    return "(" + " | ".join(exprs) + ")"


# -- one call, per family -----------------------------------------------------------------


JSON_HEAD = ('{"name": "', '", "arguments": ')
MISTRAL_HEAD = ("", "[ARGS]")
PYTHONIC_HEAD = ("", "(")
XML_HEAD = ("<function=", ">\n")
XML_PARAMETER = ("<parameter=", ">\n", "\n</parameter>\n")
"""Around one argument of a Qwen3-Coder call: before its key, after it, after its value."""
XML_END = "</function>"
GEMMA_HEAD = ("call:", "{")
GEMMA_QUOTE = '<|"|>'
FUNCTION_GEMMA_QUOTE = "<escape>"


def _json_call(prefix: str, decoding: dict[str, Any], name: str) -> tuple[str, Rules]:
    head = lark_string(JSON_HEAD[0] + name + JSON_HEAD[1])
    return prefix, [f"{prefix}: {head} {lark_json(decoding)} {lark_string('}')}"]


def _quoted(prefix: str, p: Param, delimiter: str) -> tuple[str, Rules]:
    """A string value between `delimiter`s (Gemma), a fixed set as literals."""
    if p.strings is not None:
        return _alternatives([lark_string(delimiter + s + delimiter) for s in p.strings]), []
    text = f"{prefix}_text"
    return f"{lark_string(delimiter)} {text}", [_until(text, delimiter, p.schema)]


def _key_value(delimiter: str) -> CallGrammar:
    """Gemma's `call:NAME{key:value,...}`: strings between `delimiter`s, the rest JSON."""

    def call(prefix: str, decoding: dict[str, Any], name: str) -> tuple[str, Rules]:
        rules: Rules = []
        items = []
        for i, p in enumerate(params(decoding)):
            if p.is_string:
                value, more = _quoted(f"{prefix}_{i}", p, delimiter)
                rules += more
            else:
                value = lark_json(p.schema)
            items.append((f"{lark_string(p.name + ':')} {value}", p.required))
        first, seq = sequence(prefix, items, ",")
        head, tail = lark_string(GEMMA_HEAD[0] + name + GEMMA_HEAD[1]), lark_string("}")
        return prefix, [f"{prefix}: {head} {first} {tail}", *rules, *seq]

    return call


def _pythonic_call(prefix: str, decoding: dict[str, Any], name: str) -> tuple[str, Rules]:
    ps = params(decoding)
    items = [(f"{lark_string(p.name + '=')} {lark_json(p.schema)}", p.required) for p in ps]
    first, seq = sequence(prefix, items, ", ")
    head, tail = lark_string(PYTHONIC_HEAD[0] + name + PYTHONIC_HEAD[1]), lark_string(")")
    return prefix, [f"{prefix}: {head} {first} {tail}", *seq]


def _xml_call(prefix: str, decoding: dict[str, Any], name: str) -> tuple[str, Rules]:
    """Qwen3-Coder: one <parameter=KEY> element per argument; strings raw, the rest JSON."""
    rules: Rules = []
    items = []
    for i, p in enumerate(params(decoding)):
        opening, after_key, close = XML_PARAMETER
        head = lark_string(opening + p.name + after_key)
        if p.strings is not None:
            value = _alternatives([lark_string(s + close) for s in p.strings])
        elif p.is_string:
            value = f"{prefix}_{i}_text"
            rules.append(_until(value, close, p.schema))
        else:
            value = f"{lark_json(p.schema)} {lark_string(close)}"
        items.append((f"{head} {value}", p.required))
    first, seq = sequence(prefix, items, "")
    head, tail = lark_string(XML_HEAD[0] + name + XML_HEAD[1]), lark_string(XML_END)
    return prefix, [f"{prefix}: {head} {first} {tail}", *rules, *seq]


def _mistral_args_call(prefix: str, decoding: dict[str, Any], name: str) -> tuple[str, Rules]:
    head = lark_string(MISTRAL_HEAD[0] + name + MISTRAL_HEAD[1])
    return prefix, [f"{prefix}: {head} {lark_json(decoding)}"]


HERMES = ToolFormat(
    "json_tools", "<tool_call>", "</tool_call>", _json_call, "\n", "\n", None, "\n", JSON_HEAD
)
FORMATS: dict[str, ToolFormat] = {
    "json_tools": HERMES,
    "qwen3_coder": ToolFormat(
        "qwen3_coder",
        "<tool_call>",
        "</tool_call>",
        _xml_call,
        "\n",
        "\n",
        None,
        "\n",
        XML_HEAD,
        "xml",
    ),
    "pythonic": ToolFormat(
        "pythonic",
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        _pythonic_call,
        "[",
        "]",
        ", ",
        call_head=PYTHONIC_HEAD,
        arguments="keywords",
    ),
    "gemma4": ToolFormat(
        "gemma4",
        "<|tool_call>",
        "<tool_call|>",
        _key_value(GEMMA_QUOTE),
        call_head=GEMMA_HEAD,
        arguments="key_value",
    ),
    "function_gemma": ToolFormat(
        "function_gemma",
        "<start_function_call>",
        "<end_function_call>",
        _key_value(FUNCTION_GEMMA_QUOTE),
        call_head=GEMMA_HEAD,
        arguments="cut",
    ),
    "mistral": ToolFormat(
        "mistral", "[TOOL_CALLS]", "", _mistral_args_call, list_sep="", call_head=MISTRAL_HEAD
    ),
}
MISTRAL_JSON = ToolFormat(
    "mistral", "[TOOL_CALLS]", "", _json_call, "[", "]", ", ", call_head=JSON_HEAD
)
"""Mistral's older list form, for templates without [ARGS]."""


def parser_name(tokenizer: Any) -> str | None:
    """The tool parser mlx-lm infers from the tokenizer's current chat template, or the one
    its config names; None when neither knows a tool format."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    try:
        name = _infer_tool_parser(hf)
    except Exception:  # an odd tokenizer (no vocab...) has no tool format we know
        name = None
    config = getattr(hf, "init_kwargs", None) or {}
    return name or config.get("tool_parser_type")


def format_for(tokenizer: Any) -> ToolFormat | None:
    """The model's own call format, or None (no tool format: the Hermes system message)."""
    name = parser_name(tokenizer)
    if name is None:
        return None
    if name == "mistral":
        template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", "")
        return FORMATS[name] if "[ARGS]" in str(template) else MISTRAL_JSON
    if name in FORMATS:
        return FORMATS[name]
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return ToolFormat(name, module.tool_call_start, module.tool_call_end)


def blocks(text: str, fmt: ToolFormat) -> tuple[str, list[str], bool]:
    """Split a reply into (text outside calls, call blocks' inner text, last block cut off)."""
    segments: list[str] = []
    outside: list[str] = []
    pos = 0
    while (at := text.find(fmt.start, pos)) != -1:
        outside.append(text[pos:at])
        inner = at + len(fmt.start)
        if not fmt.end:
            segments.append(text[inner:])
            return "".join(outside), segments, False
        close = text.find(fmt.end, inner)
        if close == -1:
            return "".join(outside), segments, True
        segments.append(text[inner:close])
        pos = close + len(fmt.end)
    outside.append(text[pos:])
    return "".join(outside), segments, False


def grammar_lines(
    fmt: ToolFormat, tools: Sequence[tuple[str, dict[str, Any]]], auto: bool, parallel: bool
) -> list[str]:
    """Lark lines (without the `%llguidance` header) for calls to `tools` (name, decoding
    schema): only calls, or (`auto`) text with no start marker or text then calls.

    Raises:
        ValueError: `fmt` cannot be forced.
    """
    if fmt.call is None:
        raise ValueError(f"the {fmt.parser} tool format cannot be forced")
    exprs: list[str] = []
    rules: Rules = []
    for i, (name, decoding) in enumerate(tools):
        expr, more = fmt.call(f"call_{i}", decoding, name)
        exprs.append(expr)
        rules += more
    one = _alternatives(exprs)
    listed = parallel and fmt.list_sep is not None
    inner = f"{one} ({lark_string(fmt.list_sep or '')} {one})*" if listed else one
    after_start = f"{lark_string(fmt.open)} {inner} {lark_string(fmt.close + fmt.end)}"
    more_blocks = ""
    if parallel and fmt.list_sep is None:
        more_blocks = f" ({lark_string(fmt.block_sep)} {lark_string(fmt.start)} after_start)*"
    lines = [f"after_start: {after_start}"]
    if auto:
        # Text may not contain the start marker, so once the model writes it a valid call
        # must follow (the lazy `pre` lexeme ends right at the marker).
        marker = regex_literal(fmt.start)
        lines += [
            f"start: TEXT | pre after_start{more_blocks}",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/",
            f"pre[lazy]: /(?s:.*){marker}/",
        ]
    else:
        lines.append(f"start: {lark_string(fmt.start)} after_start{more_blocks}")
    return lines + rules

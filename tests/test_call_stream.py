"""Tool calls streamed as they are written: what goes out is a prefix of what the finished
reply says, piece by piece, and joins to exactly it (checked against mlx-lm's own parsers
through `parse_reply`, and against `json.loads`/`json.dumps` for the JSON itself)."""

from __future__ import annotations

import json
import keyword
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcache.modes.call_stream import CallDelta, CallsSent, CallStream, JsonRelayout
from mlxcache.modes.tool_formats import (
    FORMATS,
    FUNCTION_GEMMA_QUOTE,
    GEMMA_QUOTE,
    HERMES,
    MISTRAL_JSON,
    ToolFormat,
    blocks,
)
from mlxcache.modes.tools import Tool, ToolCall, parse_reply, parse_tools
from mlxcache.server.text import ReplyText

TEXT = st.text(st.characters(codec="utf-8"), max_size=6)  # controls, quotes, astral chars
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | TEXT
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
OBJECTS = st.dictionaries(TEXT, VALUES, max_size=4)
LAYOUTS = st.sampled_from(
    [
        {},
        {"separators": (",", ":")},
        {"indent": 1},
        {"indent": "\t", "separators": (" ,", " : ")},
        {"ensure_ascii": True},
    ]
)


PIECE_SIZES = (1, 1, 2, 3, 5, 8)


def pieces(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random places (single characters to whole words)."""
    out, i = [], 0
    while i < len(text):
        n = rng.choice(PIECE_SIZES)
        out.append(text[i : i + n])
        i += n
    return out


def relayout(text: str, rng: random.Random) -> tuple[str, JsonRelayout, int]:
    """What a relayout writes of `text` fed in random pieces, and how much it used."""
    r, out, used = JsonRelayout(), [], 0
    for piece in pieces(text, rng):
        written, n = r.feed(piece)
        out.append(written)
        used += n
    return "".join(out), r, used


@settings(max_examples=300, deadline=None)
@given(OBJECTS, LAYOUTS, st.randoms(use_true_random=False))
def test_an_object_is_written_as_json_dumps_writes_it(
    obj: dict[str, Any], layout: dict[str, Any], rng: random.Random
) -> None:
    text = json.dumps(obj, **layout)
    written, r, used = relayout(text, rng)
    assert written == json.dumps(obj, ensure_ascii=False)
    assert r.done and not r.failed and used == len(text)


@settings(max_examples=300, deadline=None)
@given(OBJECTS, st.randoms(use_true_random=False), st.data())
def test_a_cut_or_damaged_text_writes_a_prefix_or_stops(
    obj: dict[str, Any], rng: random.Random, data: st.DataObject
) -> None:
    """Whatever the text, a relayout that finishes agrees with `json.loads` about it;
    one cut short has written a prefix of the whole object's text."""
    text = json.dumps(obj)
    cut = data.draw(st.integers(0, len(text)))
    written, r, _ = relayout(text[:cut], rng)
    assert json.dumps(obj, ensure_ascii=False).startswith(written)
    # One character changed: a finished relayout means json.loads reads the same object.
    at = data.draw(st.integers(0, len(text) - 1))
    damaged = text[:at] + data.draw(st.sampled_from('{}[]",: \\x0-.e\n')) + text[at + 1 :]
    written, r, used = relayout(damaged, rng)
    try:
        loaded = json.loads(damaged, parse_constant=lambda c: pytest.fail(c))
    except (ValueError, pytest.fail.Exception):
        loaded = None
    accepted = r.done and not r.failed and not damaged[used:].strip()
    assert accepted == isinstance(loaded, dict)
    if accepted:
        assert json.loads(written) == loaded


@pytest.mark.parametrize(
    ("text", "written"),
    [
        ('{"a": NaN}', '{"a": '),  # json.loads takes NaN; a tool's arguments never hold one
        ('{"a": 01}', '{"a": '),
        ('{"a": "x\ny"}', '{"a": "x'),  # a raw control character: json.loads refuses it
        ('{"a": tru}', '{"a": '),
        ("[1]", ""),  # arguments are an object
        ('{"a": 1,}', '{"a": 1, '),
    ],
)
def test_what_json_loads_refuses_stops_the_relayout(text: str, written: str) -> None:
    got, r, _ = relayout(text, random.Random(0))
    assert (got, r.failed, r.done) == (written, True, False)


def test_surrogate_pairs_join_and_a_lone_one_is_written_when_known() -> None:
    text = '{"s": "\\ud83d\\ude00 \\ud800x"}'
    got, r, _ = relayout(text, random.Random(0))
    assert got == json.dumps(json.loads(text), ensure_ascii=False) and r.done


def test_duplicate_keys_read_back_as_json_loads_reads_them() -> None:
    got, r, _ = relayout('{"a": 1, "a": 2}', random.Random(0))
    assert r.done and got == '{"a": 1, "a": 2}' and json.loads(got) == {"a": 2}


# -- calls in each format whose arguments are JSON ------------------------------------------

TOOLS = parse_tools(
    [
        {"name": "get_weather", "parameters": {"type": "object"}},
        {"name": "add_2", "parameters": {"type": "object"}},
    ]
)
NAMES = st.sampled_from([t.name for t in TOOLS])


def written(fmt: ToolFormat, calls: list[tuple[str, dict[str, Any]]], layout: dict) -> str:
    """The calls as a model writes them in `fmt` (JSON laid out as `layout` says)."""

    def body(name: str, args: dict[str, Any]) -> str:
        if fmt.arguments == "keywords":
            values = (f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in args.items())
            return f"{name}({', '.join(values)})"
        if fmt.arguments in ("key_value", "cut"):  # strings between quotes, the rest JSON
            quote = GEMMA_QUOTE if fmt.arguments == "key_value" else FUNCTION_GEMMA_QUOTE
            pairs = (
                f"{k}:{quote}{v}{quote}" if isinstance(v, str) else f"{k}:{json.dumps(v)}"
                for k, v in args.items()
            )
            return f"call:{name}{{{','.join(pairs)}}}"
        if fmt.arguments == "xml":  # strings raw, the rest JSON
            values = (
                f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                for k, v in args.items()
            )
            return f"<function={name}>\n{''.join(values)}</function>"
        if fmt.call_head == FORMATS["mistral"].call_head:
            return f"{name}[ARGS]{json.dumps(args, **layout)}"
        return json.dumps({"name": name, "arguments": args}, **layout)

    inner = [body(n, a) for n, a in calls]
    if fmt is HERMES:
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in inner)
    if fmt is MISTRAL_JSON:
        return "[TOOL_CALLS][" + ", ".join(inner) + "]"
    if fmt.arguments == "keywords":
        return f"{fmt.start}[{', '.join(inner)}]{fmt.end}"
    if fmt.arguments == "xml":
        return "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in inner)
    if fmt.arguments in ("key_value", "cut"):
        return "".join(f"{fmt.start}{b}{fmt.end}" for b in inner)
    return "[TOOL_CALLS]" + "".join(inner)


def streamed(
    fmt: ToolFormat, text: str, rng: random.Random, tools: tuple[Tool, ...] = ()
) -> tuple[str, list[CallDelta]]:
    """The content and the call deltas a stream of `text` sends, in random pieces."""
    openai = [t.as_openai() for t in tools]
    reply = ReplyText(fmt.start, strip=True, calls=CallStream(fmt, openai))
    deltas: list[CallDelta] = []
    for piece in pieces(text, rng):
        reply.add(piece)
        deltas += reply.new_calls()
    return reply.safe(), deltas


def joined(deltas: list[CallDelta]) -> list[tuple[str, str]]:
    sent = CallsSent()
    for d in deltas:
        sent.add(d)
    return [(sent.name(i), sent.arguments(i)) for i in range(sent.begun)]


STREAMED = {
    "json_tools": HERMES,
    "mistral_json": MISTRAL_JSON,
    "mistral": FORMATS["mistral"],
    "pythonic": FORMATS["pythonic"],
}
NAMES_OF_ARGUMENTS = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(
    lambda k: not keyword.iskeyword(k)  # what the tools a pythonic call streams for have
)
KEYWORDS = st.dictionaries(NAMES_OF_ARGUMENTS, VALUES, max_size=4)

FG = FORMATS["function_gemma"]
ESC = FUNCTION_GEMMA_QUOTE


# Values the parser reads back as they were: no "}" anywhere (it cuts the arguments there),
# no "," in what is not a string, no escape inside a string.
FG_STRINGS = st.text(st.characters(codec="utf-8", exclude_characters="}"), max_size=8).filter(
    lambda v: ESC not in v and FG.end not in v
)
FG_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**30), 10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
)
FG_ARGS = st.dictionaries(
    st.text(st.characters(codec="utf-8", exclude_characters=":}"), max_size=5).filter(
        lambda k: FG.end not in k
    ),
    FG_STRINGS | FG_SCALARS,
    max_size=4,
)
ARGUMENTS = {**{name: KEYWORDS for name in STREAMED}, "function_gemma": FG_ARGS}


@pytest.mark.parametrize("name", list(ARGUMENTS))
@settings(max_examples=120, deadline=None)
@given(st.data(), st.sampled_from(["", "Let me check. "]), st.randoms(use_true_random=False))
def test_calls_stream_as_the_finished_reply_reads_them(
    name: str, data: st.DataObject, before: str, rng: random.Random
) -> None:
    fmt = STREAMED.get(name, FG)
    calls = data.draw(st.lists(st.tuples(NAMES, ARGUMENTS[name]), min_size=1, max_size=3))
    text = before + written(fmt, calls, {})
    content, deltas = streamed(fmt, text, rng)
    reply = parse_reply(text, TOOLS, fmt)  # mlx-lm's parser for the format
    assert reply.error is None
    final = [(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in reply.calls]
    assert joined(deltas) == final
    assert content == reply.content
    assert [d.index for d in deltas if d.name is not None] == list(range(len(calls)))
    sent = CallsSent()
    for d in deltas:
        sent.add(d)
    assert sent.rest(reply.calls) == []


XML = FORMATS["qwen3_coder"]


def typed(name: str, **properties: dict[str, Any]) -> dict[str, Any]:
    """A tool whose parameters are `properties`."""
    return {"name": name, "parameters": {"type": "object", "properties": properties}}


TYPED = parse_tools(
    [
        typed(
            "get_weather",
            city={"type": "string"},
            days={"type": "array", "items": {"type": "integer"}},
        ),
        typed("add_2", a={"type": "number"}),
    ]
)
"""Tools whose parameters have types (Qwen3-Coder's parser converts a value by its type)."""
GEMMA = FORMATS["gemma4"]
EVERY = {**STREAMED, "qwen3_coder": XML, "gemma4": GEMMA}


@pytest.mark.parametrize("fmt", EVERY.values(), ids=list(EVERY))
def test_a_call_is_sent_as_it_is_written(fmt: ToolFormat) -> None:
    """Fed a character at a time: the name as soon as it is whole, then the arguments in
    many deltas, each out as soon as it is final."""
    args = {"city": "Paris, on the Seine", "days": [1, 2, 3]}
    text = written(fmt, [("get_weather", args)], {})
    reply = ReplyText(fmt.start, strip=True, calls=CallStream(fmt, [t.as_openai() for t in TYPED]))
    came: list[tuple[int, CallDelta]] = []
    for i, char in enumerate(text):
        reply.add(char)
        came += [(i, d) for d in reply.new_calls()]
    (named_at, first), *rest = came
    assert first == CallDelta(0, "get_weather", "")
    assert named_at == text.index("get_weather") + len("get_weather") + len(fmt.call_head[1]) - 1
    assert len(rest) > 15 and "".join(d.arguments for _, d in rest) == json.dumps(args)
    # The last piece, the object's end, as soon as the text says it ends.
    end = text.index("</function>") + len("</function>") - 1 if fmt is XML else text.index("3]") + 2
    assert rest[-1][0] == end


@pytest.mark.parametrize("fmt", EVERY.values(), ids=list(EVERY))
def test_a_call_cut_off_has_sent_a_prefix_of_its_arguments(fmt: ToolFormat) -> None:
    calls = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("add_2", {"a": 1.5})]
    text = written(fmt, calls, {})
    whole = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    for cut in range(len(text) + 1):
        got = joined(streamed(fmt, text[:cut], random.Random(cut), TYPED)[1])
        assert all(n == whole[i][0] and whole[i][1].startswith(a) for i, (n, a) in enumerate(got))
    assert joined(streamed(fmt, text, random.Random(0), TYPED)[1]) == whole


XML_TOOLS = parse_tools(
    [
        typed(
            "edit",
            path={"type": "string"},
            count={"type": "integer"},
            scale={"type": "number"},
            dry={"type": "boolean"},
            meta={"type": "object"},
            lines={"type": "array"},
            note={},  # no type: JSON when it reads as an object or a list
        )
    ]
)
XML_VALUES = st.fixed_dictionaries(
    {},
    optional={
        "path": st.text(st.characters(codec="utf-8", exclude_characters="<"), max_size=8).filter(
            lambda v: v.lower() != "null"  # None: not a string (the call would not be used)
        )
        | st.sampled_from(["nu", "NUL", "nullx", "\n", "a\n"]),
        "count": st.integers(-(10**6), 10**6),
        "scale": st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
        "dry": st.booleans(),
        "meta": st.dictionaries(TEXT, SCALARS, max_size=2),
        "lines": st.lists(SCALARS, max_size=3),
        "note": st.sampled_from(["plain words", "[1, 2]", '{"a": 1}']),
    },
)


@settings(max_examples=150, deadline=None)
@given(st.lists(XML_VALUES, min_size=1, max_size=2), st.randoms(use_true_random=False))
def test_xml_calls_stream_as_qwen3_coder_s_parser_reads_them(
    calls: list[dict[str, Any]], rng: random.Random
) -> None:
    """Each value as mlx-lm's parser converts it by its parameter's type (an integer
    parameter's "3" is 3; a string parameter's "null" is None), a string's as it comes."""
    text = written(XML, [("edit", args) for args in calls], {})
    _, deltas = streamed(XML, text, rng, XML_TOOLS)
    reply = parse_reply(text, XML_TOOLS, XML)
    assert reply.error is None and len(reply.calls) == len(calls)
    final = [(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in reply.calls]
    assert joined(deltas) == final


def test_a_layout_the_stream_cannot_read_leaves_the_calls_to_the_end() -> None:
    """JSON laid out otherwise than the grammar writes it (no space after the colon): no
    call is found while it streams, and the finished reply's calls go out whole."""
    text = written(HERMES, [("get_weather", {"city": "Paris"})], {"separators": (",", ":")})
    _, deltas = streamed(HERMES, text, random.Random(0))
    assert deltas == []
    reply = parse_reply(text, TOOLS, HERMES)
    assert CallsSent().rest(reply.calls) == [CallDelta(0, "get_weather", '{"city": "Paris"}')]


def test_the_rest_of_a_call_begun_is_sent_after_what_was() -> None:
    sent = CallsSent()
    sent.add(CallDelta(0, "f", '{"a": '))
    calls = (ToolCall("f", {"a": 1}), ToolCall("g", {}))
    assert sent.rest(calls) == [CallDelta(0, None, "1}"), CallDelta(1, "g", "{}")]


@pytest.mark.parametrize(
    ("fmt", "key"),
    [(FORMATS["pythonic"], "from"), (FORMATS["pythonic"], "dry-run"), (GEMMA, "dry-run")],
)
def test_keys_a_format_s_parser_reads_otherwise_leave_the_calls_to_the_end(
    fmt: ToolFormat, key: str
) -> None:
    """`from=` (a keyword) or `dry-run=` makes mlx-lm read a pythonic block with a regex,
    which reads values otherwise than Python; Gemma 4's parser finds keys as `\\w+` only."""
    tools = [t.as_openai() for t in parse_tools([typed("f", **{key: {}, "n": {}})])]
    assert not CallStream.supports(fmt, tools)
    assert CallStream.supports(fmt, [t.as_openai() for t in parse_tools([typed("f", n={})])])


def test_a_format_read_only_at_the_end_has_no_stream() -> None:
    fmt = ToolFormat("glm47", "<tool_call>", "</tool_call>")  # read back, never forced
    assert not CallStream.supports(fmt)
    with pytest.raises(ValueError, match="not read as they come"):
        CallStream(fmt)


@pytest.mark.parametrize("value", ["null", "NULL", "Null"])
def test_a_string_parameter_s_null_is_none_as_the_parser_reads_it(value: str) -> None:
    text = written(XML, [("edit", {"path": value, "count": 2})], {})
    deltas = streamed(XML, text, random.Random(0), XML_TOOLS)[1]
    [(name, arguments)] = joined(deltas)
    [call] = XML.parse(blocks(text, XML)[1][0], [t.as_openai() for t in XML_TOOLS])
    assert (name, arguments) == ("edit", '{"path": null, "count": 2}')
    assert json.loads(arguments) == call["arguments"]


# Nested strings without what Gemma 4's parser reads as structure (braces it counts, a bare
# key after "{" or ","): such a value leaves the call unreadable, not another value.
PLAIN = st.text(st.characters(codec="utf-8", exclude_characters=":<{}"), max_size=6)
PLAIN_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**9), 10**9)
    | st.floats(allow_nan=False, allow_infinity=False)
    | PLAIN,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(PLAIN, inner, max_size=3),
    max_leaves=6,
)
GEMMA_ARGS = st.dictionaries(
    st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True),
    st.text(st.characters(codec="utf-8"), max_size=8).filter(lambda v: GEMMA_QUOTE not in v)
    | PLAIN_VALUES,
    max_size=4,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(NAMES, GEMMA_ARGS), min_size=1, max_size=2),
    st.randoms(use_true_random=False),
)
def test_gemma_calls_stream_as_gemma_4_s_parser_reads_them(
    calls: list[tuple[str, dict[str, Any]]], rng: random.Random
) -> None:
    text = written(GEMMA, calls, {})
    _, deltas = streamed(GEMMA, text, rng)
    reply = parse_reply(text, TOOLS, GEMMA)
    assert reply.error is None and len(reply.calls) == len(calls)
    final = [(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in reply.calls]
    assert joined(deltas) == final


# -- FunctionGemma: arguments as its parser cuts them ---------------------------------------


def test_a_function_gemma_string_streams_as_it_is_written() -> None:
    """Fed a character at a time: the name once "{" comes, a key at its ":", a string's
    characters as they come (what may begin an escape or the block's end held), a number
    once the "}" after it comes."""
    text = written(FG, [("get_weather", {"city": "Paris <b>", "days": 3})], {})
    reply = ReplyText(FG.start, strip=True, calls=CallStream(FG))
    came: list[tuple[str, str]] = []
    for i, char in enumerate(text):
        reply.add(char)
        came += [(text[: i + 1][-3:], d.name or d.arguments) for d in reply.new_calls()]
    assert came == [
        ("er{", "get_weather"),
        ("ty:", '{"city": '),
        ("pe>", '"'),
        ("e>P", "P"),
        *((c[-3:], c[-1]) for c in ("e>Pa", "e>Par", "e>Pari", "e>Paris", "e>Paris ")),
        (" <b", "<b"),
        ("<b>", ">"),
        ("pe>", '"'),
        ("ys:", ', "days": '),
        (":3}", "3}"),
    ]


def test_a_function_gemma_call_cut_off_has_sent_a_prefix_of_its_arguments() -> None:
    calls = [("get_weather", {"city": "Paris", "days": 2}), ("add_2", {"a": 1.5, "b": "x"})]
    text = written(FG, calls, {})
    whole = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    for cut in range(len(text) + 1):
        got = joined(streamed(FG, text[:cut], random.Random(cut))[1])
        assert all(n == whole[i][0] and whole[i][1].startswith(a) for i, (n, a) in enumerate(got))
    assert joined(streamed(FG, text, random.Random(0))[1]) == whole


@pytest.mark.parametrize(
    ("inner", "sent"),
    [
        ("call:f{a: x y,b: 1 }", '{"a": " x y", "b": 1}'),  # JSON where it reads, else text
        ("call:f{a:,b:NaN,c:[1,d:2}", '{"a": "", "b": NaN, "c": "[1", "d": 2}'),
        ("call:f{a:1,}", '{"a": 1}'),
        (f"call:f{{a b:{ESC}x, y{ESC};c:1}}", '{"a b": "x, y", "c": 1}'),  # ";" skipped
        (f"call:f{{a:{ESC}x{ESC}}} call:g{{b:2}}", '{"a": "x"}'),  # one call per block
        (f"call:f{{a:{ESC}x}}y{ESC}}}", '{"a": "x'),  # "}" ends it: unreadable
        (f"call:f{{a:{ESC}x<", '{"a": "x<'),  # the block ends first: unreadable
        ("call:f{a:1,b}", '{"a": 1'),  # a key without ":": unreadable
    ],
)
def test_function_gemma_arguments_are_what_its_parser_reads(inner: str, sent: str) -> None:
    text = FG.start + inner + FG.end
    [(name, arguments)] = joined(streamed(FG, text, random.Random(0))[1])
    assert (name, arguments) == ("f", sent)
    try:
        [call] = FG.parse(blocks(text, FG)[1][0], [])
    except ValueError:
        return
    assert arguments == json.dumps(call["arguments"], ensure_ascii=False)


def test_what_may_begin_an_escape_or_the_block_s_end_is_held() -> None:
    for held_back in (ESC[:4], FG.end[:4]):
        text = f"{FG.start}call:f{{a:{ESC}x{held_back}"
        assert joined(streamed(FG, text, random.Random(0))[1]) == [("f", '{"a": "x')]


# Pieces the parser reads as structure, and a few that it does not.
FG_PIECES = st.sampled_from(
    [
        *("call:", "get_weather", "{", "}", ":", ",", ESC, ESC[:3], FG.start, FG.end, FG.end[:5]),
        *("a", "1", "1.5", "[1", "true", "nul", " ", "\n", '"', "é"),
    ]
)


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(NAMES, FG_ARGS), min_size=1, max_size=2),
    st.lists(st.tuples(st.floats(0, 1), FG_PIECES, st.booleans()), min_size=1, max_size=3),
    st.randoms(use_true_random=False),
)
def test_a_damaged_function_gemma_text_streams_what_its_parser_reads_or_stops(
    calls: list[tuple[str, dict[str, Any]]],
    edits: list[tuple[float, str, bool]],
    rng: random.Random,
) -> None:
    """Calls with pieces put in or characters taken out: every call the stream begins is
    one the parser reads (when it reads the reply), the same name, its arguments a prefix
    of the final ones (or, with a key written twice, text that reads back as them)."""
    text = written(FG, calls, {})
    for where, piece, insert in edits:
        at = int(where * len(text))
        text = text[:at] + piece + text[at:] if insert else text[:at] + text[at + 1 :]
    reply = parse_reply(text, TOOLS, FG)
    sent = joined(streamed(FG, text, rng)[1])
    if reply.error is None:
        assert len(sent) <= len(reply.calls)
    for (name, arguments), call in zip(sent, reply.calls, strict=False):
        whole = json.dumps(call.arguments, ensure_ascii=False)
        assert name == call.name
        assert whole.startswith(arguments) or json.loads(arguments) == call.arguments

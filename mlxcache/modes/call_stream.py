"""Tool calls read while the reply is written, so a client sees a call's name and its
arguments grow token by token (OpenAI's `tool_calls` deltas, Anthropic's
`input_json_delta`, the Responses API's `function_call_arguments.delta`).

What is streamed is a prefix of what the finished reply says: a call's arguments go out
as `json.dumps(arguments, ensure_ascii=False)` writes them, the model's own JSON re-laid
out as it arrives (`JsonRelayout`). It is read for each format with a
`ToolFormat.call_head`: JSON arguments (Hermes, Qwen, Mistral), pythonic keyword arguments
(`JsonRelayout` per value), Qwen3-Coder's XML elements (`XmlArgs`), Gemma 4's `key:VALUE`
pairs (`KeyValueArgs`) and FunctionGemma's, read as its parser cuts them (`CutArgs`).
"""

from __future__ import annotations

import json
import keyword
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlxcache.modes.tool_formats import (
    FUNCTION_GEMMA_QUOTE,
    GEMMA_QUOTE,
    XML_END,
    XML_HEAD,
    XML_PARAMETER,
    ToolFormat,
)
from mlxcache.modes.tools import ToolCall
from mlxcache.stops import partial_marker

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_SPACE = " \t\n\r"
_NUMBER = set("-+0123456789.eE")
_WORDS = ("true", "false", "null")
_HEX = set("0123456789abcdefABCDEF")
_MAX_NAME = 256
"""A name longer than this is not a tool's (the call is then sent at the end)."""


def _written(char: str) -> str:
    """One character as `json.dumps(..., ensure_ascii=False)` writes it inside a string."""
    return json.dumps(char, ensure_ascii=False)[1:-1]


class JsonRelayout:
    """One JSON object's text, as it arrives, written as `json.dumps(json.loads(text),
    ensure_ascii=False)` writes it: whitespace normalized, separators `", "` and `": "`,
    strings re-escaped, numbers as Python prints them. Each character is looked at once
    (a number or a word is held until it ends).

    `failed` turns true at the first character `json.loads` would refuse (or `NaN`,
    which it accepts and this does not follow); nothing is written after that. Duplicate
    keys are written as they come (`json.loads` keeps the last value), so the text still
    reads back as the same object.

    Args:
        value: any JSON value, not only an object (a number or word at the top ends at the
            first character that cannot continue it, which is left unused).
        python: the text is read as a Python literal (a pythonic call's argument), where
            `\\/` keeps its backslash and surrogate escapes are not joined: those stop it.
    """

    def __init__(self, value: bool = False, python: bool = False) -> None:
        self.done = False
        self.failed = False
        self._python = python
        self._stack: list[str] = []  # the open containers, "{" or "["
        self._expect = "value" if value else "object"  # what may come next (`_structure`)
        self._in_string = False
        self._key = False  # the string being read is a key
        self._escape: str | None = None  # the escape being read, after its backslash
        self._high = ""  # a high surrogate waiting for its low half
        self._held = ""  # a number or a word, until it ends

    def feed(self, text: str) -> tuple[str, int]:
        """Take `text`; returns (what became final, how many characters were used: all
        of them unless the object ended inside `text`)."""
        out: list[str] = []
        for i, char in enumerate(text):
            if self._held and not self._continues(char):
                out.append(self._flush_held())
            if self.done or self.failed:
                return "".join(out), i
            out.append(self._char(char))
        return "".join(out), len(text)

    def _continues(self, char: str) -> bool:
        """Whether `char` goes on with the number or word held."""
        return char.isalpha() if self._held[0] in "tfn" else char in _NUMBER

    def _fail(self) -> str:
        self.failed = True
        return ""

    def _char(self, char: str) -> str:
        if self._in_string:
            return self._string_char(char)
        if self._held:
            self._held += char
            return ""
        return self._structure(char)

    def _flush_held(self) -> str:
        held_text, self._held = self._held, ""
        if held_text[0] in "tfn":
            return held_text + self._value_done() if held_text in _WORDS else self._fail()
        try:
            value = json.loads(held_text)
        except ValueError:  # not a JSON number (or too many digits for Python)
            return self._fail()
        return json.dumps(value) + self._value_done()

    def _value_done(self) -> str:
        if not self._stack:
            self.done = True
        self._expect = "comma_or_end"
        return ""

    def _structure(self, char: str) -> str:
        if char in _SPACE:
            return ""
        expect = self._expect
        if expect == "object":  # the arguments: an object, nothing else
            return self._open(char) if char == "{" else self._fail()
        if expect in ("key", "key_or_end"):
            if char == '"':
                self._in_string, self._key = True, True
                return '"'
            return self._close(char) if expect == "key_or_end" else self._fail()
        if expect == "colon":
            if char != ":":
                return self._fail()
            self._expect = "value"
            return ": "
        if expect == "comma_or_end":
            if char == ",":
                self._expect = "key" if self._stack[-1] == "{" else "value"
                return ", "
            return self._close(char)
        # a value (or, just inside "[", the end)
        if char in "{[":
            return self._open(char)
        if char == '"':
            self._in_string, self._key = True, False
            return '"'
        if char in "-0123456789" or char in "tfn":
            self._held = char
            return ""
        return self._close(char) if expect == "value_or_end" else self._fail()

    def _open(self, char: str) -> str:
        self._stack.append(char)
        self._expect = "key_or_end" if char == "{" else "value_or_end"
        return char

    def _close(self, char: str) -> str:
        if not self._stack or char != {"{": "}", "[": "]"}[self._stack[-1]]:
            return self._fail()
        self._stack.pop()
        return char + self._value_done()

    def _string_char(self, char: str) -> str:
        if self._escape is not None:
            self._escape += char
            code = self._escape
            if code[0] == "u":
                if len(code) < 5:
                    return ""
                self._escape = None
                if not all(c in _HEX for c in code[1:]):  # int() would also take spaces, signs
                    return self._fail()
                if self._python and 0xD800 <= int(code[1:], 16) < 0xE000:
                    return self._fail()
                return self._text(chr(int(code[1:], 16)))
            self._escape = None
            if code not in _ESCAPES or (self._python and code == "/"):
                return self._fail()
            return self._text(_ESCAPES[code])
        if char == "\\":
            self._escape = ""
            return ""
        if char == '"':
            self._in_string = False
            tail, self._high = _written(self._high) + '"', ""
            if self._key:
                self._expect = "colon"
                return tail
            return tail + self._value_done()
        if ord(char) < 0x20:  # json.loads (strict) refuses control characters in strings
            return self._fail()
        return self._text(char)

    def _text(self, char: str) -> str:
        """A decoded character of a string, surrogate pairs joined as `json.loads` joins
        them (a lone high surrogate is held until the next character shows it is one)."""
        code = ord(char)
        lone, self._high = self._high, ""
        if lone and 0xDC00 <= code < 0xE000:
            return _written(chr(0x10000 + ((ord(lone) - 0xD800) << 10) + (code - 0xDC00)))
        if 0xD800 <= code < 0xDC00:
            self._high = char
            return _written(lone)
        return _written(lone) + _written(char)


class KeywordArgs:
    """A pythonic call's arguments after its "(": `key=VALUE, ...)` up to and including
    the ")", each VALUE JSON read as a Python literal (as mlx-lm's parser reads it), written
    as `json.dumps` writes the object of them. The same interface as `JsonRelayout`."""

    def __init__(self) -> None:
        self.done = False
        self.failed = False
        self._state = "first"  # -> "key" -> "value" -> "next" (a comma or the ")")
        self._key = ""
        self._value = JsonRelayout(value=True, python=True)
        self._written_one = False

    def feed(self, text: str) -> tuple[str, int]:
        out: list[str] = []
        i = 0
        while i < len(text) and not (self.done or self.failed):
            if self._state == "value":
                written, used = self._value.feed(text[i:])
                out.append(written)
                i += used
                self.failed = self._value.failed
                if self._value.done:
                    self._state = "next"
                continue
            out.append(self._char(text[i]))
            i += 1
        return "".join(out), i

    def _char(self, char: str) -> str:
        if char in _SPACE and not self._key:
            return ""
        if self._state == "next":
            if char == ",":
                self._state = "key"
                return ""
            return self._end(char)
        if char == ")" and self._state == "first":
            return self._end(char)
        if char == "=" and self._key:
            head = ", " if self._written_one else "{"
            key, self._key = json.dumps(self._key, ensure_ascii=False), ""
            self._state, self._written_one = "value", True
            self._value = JsonRelayout(value=True, python=True)
            return f"{head}{key}: "
        if char.isalnum() or char == "_":
            self._key += char
            return ""
        self.failed = True
        return ""

    def _end(self, char: str) -> str:
        if char != ")":
            self.failed = True
            return ""
        self.done = True
        return "}" if self._written_one else "{}"


class XmlArgs:
    """A Qwen3-Coder call's arguments after its head: `<parameter=key>` elements up to and
    including `</function>`, written as `json.dumps` writes the object mlx-lm's parser
    reads from them. A string parameter's value (its schema's type "string") streams as it
    comes, held while it may still read as `null` (the parser's None, whatever the type);
    any other value is held until its element ends and read by the parser itself (types
    convert there: "1" is an integer for an integer parameter). The same interface as
    `JsonRelayout`.
    """

    def __init__(self, fmt: ToolFormat, name: str, tools: Sequence[dict[str, Any]]) -> None:
        self.done = False
        self.failed = False
        self._fmt, self._name, self._tools = fmt, name, list(tools)
        fn: dict[str, Any] = next(
            (t["function"] for t in tools if t["function"]["name"] == name), {}
        )
        self._props: dict[str, Any] = (fn.get("parameters") or {}).get("properties") or {}
        self._state = "tag"  # -> "key" -> "value" -> "tag"
        self._text = ""  # the tag or key being read, or the value so far
        self._key = ""
        self._sent = 0  # how much of a string value was written
        self._opened = False  # its opening quote was
        self._written_one = False

    def feed(self, text: str) -> tuple[str, int]:
        out: list[str] = []
        used = 0
        while used < len(text) and not (self.done or self.failed):
            n, written = self._step(text[used:])
            used += n
            out.append(written)
        return "".join(out), used

    def _fail(self) -> tuple[int, str]:
        self.failed = True
        return 0, ""

    def _step(self, text: str) -> tuple[int, str]:
        """(characters of `text` used, what they made final)."""
        opening, after_key, _ = XML_PARAMETER
        if self._state == "value":
            return self._value(text)
        start = len(self._text)
        self._text += text
        if self._state == "key":
            at = self._text.find(after_key)
            if at < 0:
                return (len(text), "") if len(self._text) <= _MAX_NAME else self._fail()
            self._key, self._state = self._text[:at], "value"
            self._text, self._sent, self._opened = "", 0, False
            return at + len(after_key) - start, self._head()
        for tag, state in ((opening, "key"), (XML_END, "done")):
            if self._text.startswith(tag):
                self._text = ""
                if state == "done":
                    self.done = True
                    return len(tag) - start, "}" if self._written_one else "{}"
                self._state = state
                return len(tag) - start, ""
        if any(tag.startswith(self._text) for tag in (opening, XML_END)):
            return len(text), ""
        return self._fail()

    def _head(self) -> str:
        """What goes before a value: the key, after a comma but for the first."""
        head = ", " if self._written_one else "{"
        self._written_one = True
        return f"{head}{json.dumps(self._key, ensure_ascii=False)}: "

    def _streams(self) -> bool:
        return (self._props.get(self._key) or {}).get("type") == "string"

    def _value(self, text: str) -> tuple[int, str]:
        close = XML_PARAMETER[2]
        start = len(self._text)
        self._text += text
        at = self._text.find(close, max(start - len(close), 0))
        if at < 0:
            if not self._streams():
                return len(text), ""
            return len(text), self._string(
                self._text[: len(self._text) - partial_marker(self._text, close)]
            )
        value, self._text, self._state = self._text[:at], "", "tag"
        used = at + len(close) - start
        if not self._streams() or value.lower() == "null":
            return used, self._read(value)
        return used, self._string(value, whole=True) + '"'

    def _string(self, value: str, whole: bool = False) -> str:
        """More of a string value (all of it that is final), once it cannot be `null`."""
        if not whole and len(value) <= len("null") and "null".startswith(value.lower()):
            return ""
        out = ("" if self._opened else '"') + "".join(map(_written, value[self._sent :]))
        self._opened, self._sent = True, len(value)
        return out

    def _read(self, value: str) -> str:
        """A whole value as mlx-lm's parser reads it for this parameter."""
        opening, after_key, close = XML_PARAMETER
        element = f"{XML_HEAD[0]}{self._name}{XML_HEAD[1]}{opening}{self._key}{after_key}"
        try:
            [call] = self._fmt.parse(f"{element}{value}{close}{XML_END}", self._tools)
            return json.dumps(call["arguments"][self._key], ensure_ascii=False)
        except (ValueError, KeyError, TypeError):
            self.failed = True
            return ""


class KeyValueArgs:
    """A Gemma 4 call's arguments after its "{": `key:VALUE,...}` up to and including the
    "}", a string VALUE between `GEMMA_QUOTE`s (streamed as it comes, the text between
    them as it is), any other JSON (`JsonRelayout`); written as `json.dumps` writes the
    object mlx-lm's parser reads. The same interface as `JsonRelayout`."""

    def __init__(self) -> None:
        self.done = False
        self.failed = False
        self._state = "first"  # -> "key" -> "value" -> "quoted" | "json" -> "next"
        self._key = ""
        self._text = ""  # a quote being matched, or a quoted string's text not yet written
        self._json = JsonRelayout(value=True)
        self._written_one = False

    def feed(self, text: str) -> tuple[str, int]:
        out: list[str] = []
        i = 0
        while i < len(text) and not (self.done or self.failed):
            if self._state in ("json", "quoted"):
                written, used = (
                    self._json_value(text[i:]) if self._state == "json" else self._quoted(text[i:])
                )
                out.append(written)
                i += used
                continue
            out.append(self._char(text[i]))
            i += 1
        return "".join(out), i

    def _char(self, char: str) -> str:
        state = self._state
        if state == "next":
            if char == ",":
                self._state = "key"
                return ""
            return self._end(char)
        if state == "first" and char == "}":
            return self._end(char)
        if state in ("first", "key"):
            if char == ":" and self._key:
                head = ", " if self._written_one else "{"
                key, self._key = json.dumps(self._key, ensure_ascii=False), ""
                self._state, self._written_one = "value", True
                return f"{head}{key}: "
            if char.isalnum() or char == "_":
                self._key += char
                return ""
            return self._stop()
        # the value's first characters: a quote, or JSON
        if char == GEMMA_QUOTE[0] or self._text:
            self._text += char
            if self._text == GEMMA_QUOTE:
                self._state, self._text = "quoted", ""
                return '"'
            return "" if GEMMA_QUOTE.startswith(self._text) else self._stop()
        self._state, self._json = "json", JsonRelayout(value=True)
        written, _ = self._json_value(char)
        return written

    def _json_value(self, text: str) -> tuple[str, int]:
        written, used = self._json.feed(text)
        if self._json.failed:
            self.failed = True
        elif self._json.done:
            self._state = "next"
        return written, used

    def _quoted(self, text: str) -> tuple[str, int]:
        start = len(self._text)
        self._text += text
        at = self._text.find(GEMMA_QUOTE)
        if at < 0:
            keep = partial_marker(self._text, GEMMA_QUOTE)
            final, self._text = (
                self._text[: len(self._text) - keep],
                self._text[len(self._text) - keep :],
            )
            return "".join(map(_written, final)), len(text)
        final, self._text, self._state = self._text[:at], "", "next"
        return "".join(map(_written, final)) + '"', at + len(GEMMA_QUOTE) - start

    def _stop(self) -> str:
        self.failed = True
        return ""

    def _end(self, char: str) -> str:
        if char != "}":
            return self._stop()
        self.done = True
        return "}" if self._written_one else "{}"


class CutArgs:
    """A FunctionGemma call's arguments after its "{", read as mlx-lm's parser reads them:
    they end at the first "}" (wherever it is); a key runs to the next ":"; a value that
    starts with `quote` runs to the next `quote`, and the character after that is skipped
    (the comma the grammar writes); any other value runs to the next "," and is JSON where
    `json.loads` reads it, else its text. A quoted string streams as it comes, any other
    value goes out once it ends, written as `json.dumps` writes the object. The block's
    `end` tag before that "}" leaves the call unreadable (the parser's block ends first):
    that stops it. The same interface as `JsonRelayout`."""

    def __init__(self, quote: str, end: str) -> None:
        self.done = False
        self.failed = False
        self._quote, self._end = quote, end
        self._args = ""  # the text after "{", up to its first "}"
        self._closed = False  # that "}" came
        self._state = "key"  # -> "value" -> "quoted" -> "skip" -> "key" | "plain" -> "key"
        self._at = 0  # where in `_args` the key or value being read starts
        self._sent = 0  # how far a quoted value was written
        self._written_one = False

    def feed(self, text: str) -> tuple[str, int]:
        if self.done or self.failed:
            return "", 0
        cut = text.find("}")
        start = len(self._args)
        self._args += text if cut < 0 else text[:cut]
        self._closed = cut >= 0
        if self._end in self._args[max(start - len(self._end) + 1, 0) :]:
            self.failed = True
            return "", 0
        out: list[str] = []
        while not (self.done or self.failed) and (written := self._step()) is not None:
            out.append(written)
        return "".join(out), len(text) if cut < 0 else cut + 1

    def _step(self) -> str | None:
        """Read what `_args` says next; None: it needs more text."""
        args, state = self._args, self._state
        if state == "key":
            at = args.find(":", self._at)
            if at >= 0:
                key, self._at, self._state = args[self._at : at], at + 1, "value"
                head = ", " if self._written_one else "{"
                self._written_one = True
                return f"{head}{json.dumps(key, ensure_ascii=False)}: "
            if not self._closed:
                return None
            if self._at < len(args):  # a key without ":": the parser's `index` raises
                return self._fail()
            return self._finish()
        if state == "value":
            rest = args[self._at :]
            if rest.startswith(self._quote):
                self._at += len(self._quote)
                self._state, self._sent = "quoted", self._at
                return '"'
            if self._quote.startswith(rest) and not self._closed:
                return None  # may still open a string
            self._state = "plain"
            return ""
        if state == "plain":
            at = args.find(",", self._at)
            if at < 0 and not self._closed:
                return None
            end = len(args) if at < 0 else at
            value, self._at, self._state = args[self._at : end], end + 1, "key"
            return self._plain(value) + (self._finish() if at < 0 else "")
        if state == "quoted":
            at = args.find(self._quote, self._at)
            if at >= 0:
                text, self._at, self._state = args[self._sent : at], at + len(self._quote), "skip"
                return "".join(map(_written, text)) + '"'
            if self._closed:  # the "}" came inside the string: it never closes
                return self._fail()
            upto = len(args) - max(
                partial_marker(args, self._quote), partial_marker(args, self._end)
            )
            if upto <= self._sent:
                return None
            text, self._sent = args[self._sent : upto], upto
            return "".join(map(_written, text))
        if self._at < len(args):  # "skip"
            self._at, self._state = self._at + 1, "key"
            return ""
        return self._finish() if self._closed else None

    def _plain(self, value: str) -> str:
        """A value not quoted, as the parser reads it: JSON, else its text."""
        try:
            read: Any = json.loads(value)
        except json.JSONDecodeError:
            read = value
        except Exception:  # the parser lets other errors out: the call is unreadable
            return self._fail()
        return json.dumps(read, ensure_ascii=False)

    def _fail(self) -> str:
        self.failed = True
        return ""

    def _finish(self) -> str:
        self.done = True
        return "}" if self._written_one else "{}"


@dataclass(frozen=True, slots=True)
class CallDelta:
    """More of the reply's `index`th call: its name on the call's first delta (else
    None), and more of its arguments as `json.dumps` writes them."""

    index: int
    name: str | None
    arguments: str


class CallStream:
    """Reads the calls in the text from a call tag on, as it arrives: each call's name
    once it is whole, then its arguments as they become final.

    A call is found by the text its format writes before the name and between the name and
    the arguments (`ToolFormat.call_head`; with nothing before the name, it starts at the
    next character a name may hold); what lies between calls (closing and opening tags,
    list separators) is skipped. Text that does not read as a call ends the streaming:
    the finished reply then says the rest. Where the parser reads one call per block
    (FunctionGemma's), the next call is sought in the next block, and a block that ends
    before its call begins stops it.
    """

    def __init__(self, fmt: ToolFormat, tools: Sequence[dict[str, Any]] = ()) -> None:
        if fmt.call_head is None:
            raise ValueError(f"the {fmt.parser} format's calls are not read as they come")
        self._before, self._after = fmt.call_head
        self._fmt, self._tools = fmt, tools
        self._index = -1
        self._state = "seek"
        self._text = ""  # text not yet placed: a head being matched, a name being read
        self._args: JsonRelayout | KeywordArgs | XmlArgs | KeyValueArgs | CutArgs | None = None
        self._one_per_block = fmt.arguments == "cut"
        self.stopped = False

    @staticmethod
    def supports(fmt: ToolFormat, tools: Sequence[dict[str, Any]] = ()) -> bool:
        """Whether calls to `tools` (OpenAI's shape) in `fmt` are read as they come: the
        format has a `call_head`, and mlx-lm's parser reads their keys as the grammar writes
        them. A pythonic block is read as Python only when every key is a name that is not
        a keyword (`from=` sends the whole block to a regex, which reads values otherwise);
        Gemma 4's keys are found as `\\w+`."""
        if fmt.call_head is None:
            return False
        keys = [
            key
            for t in tools
            for key in ((t["function"].get("parameters") or {}).get("properties") or {})
        ]
        if fmt.arguments == "keywords":
            return all(k.isidentifier() and not keyword.iskeyword(k) for k in keys)
        if fmt.arguments == "key_value":
            return all(re.fullmatch(r"\w+", k) for k in keys)
        return True

    def feed(self, text: str) -> list[CallDelta]:
        """The deltas that `text` (the next piece of the reply) made final."""
        out: list[CallDelta] = []
        while text and not self.stopped:
            text = self._step(text, out)
        return out

    def _step(self, text: str, out: list[CallDelta]) -> str:
        """Use what it can of `text`; returns the rest."""
        if self._state == "args":
            assert self._args is not None
            written, used = self._args.feed(text)
            if written:
                out.append(CallDelta(self._index, None, written))
            if self._args.failed:
                self.stopped = True
            elif self._args.done:
                self._state = "block_end" if self._one_per_block else "seek"
            return text[used:]
        self._text += text
        if self._state in ("block_end", "block_start"):
            tag = self._fmt.end if self._state == "block_end" else self._fmt.start
            at = self._text.find(tag)
            if at < 0:
                self._text = self._text[len(self._text) - partial_marker(self._text, tag) :]
                return ""
            self._state = "block_start" if self._state == "block_end" else "seek"
            text, self._text = self._text[at + len(tag) :], ""
            return text
        if self._state == "seek":
            at = self._text.find(self._before) if self._before else _name_at(self._text)
            closed = self._text.find(self._fmt.end) if self._one_per_block else -1
            if closed >= 0 and (at < 0 or closed < at):
                self.stopped = True  # the block ends before its call: it cannot be read
                return ""
            if at < 0:
                ends = partial_marker(self._text, self._fmt.end) if self._one_per_block else 0
                keep = max(partial_marker(self._text, self._before), ends)
                self._text = self._text[len(self._text) - keep :]
                return ""
            self._state, self._text = "name", self._text[at + len(self._before) :]
            text, self._text = self._text, ""
            return text
        at = self._text.find(self._after)
        if at < 0:
            if len(self._text) > _MAX_NAME:
                self.stopped = True
            return ""
        name, rest = self._text[:at], self._text[at + len(self._after) :]
        if self._one_per_block and not self._reads_name(name):
            self.stopped = True
            return ""
        self._index += 1
        out.append(CallDelta(self._index, name, ""))
        self._state, self._text = "args", ""
        self._args = self._reader(name)
        return rest

    def _reads_name(self, name: str) -> bool:
        """Whether FunctionGemma's parser reads the head as a call to `name` (the text
        between "call:" and "{" may hold what its `\\w+` does not)."""
        try:
            [call] = self._fmt.parse(f"{self._before}{name}{self._after}}}", list(self._tools))
        except ValueError:
            return False
        return bool(call.get("name") == name)

    def _reader(self, name: str) -> JsonRelayout | KeywordArgs | XmlArgs | KeyValueArgs | CutArgs:
        """What reads the arguments of a call to `name` (`ToolFormat.arguments`)."""
        if self._fmt.arguments == "keywords":
            return KeywordArgs()
        if self._fmt.arguments == "xml":
            return XmlArgs(self._fmt, name, self._tools)
        if self._fmt.arguments == "key_value":
            return KeyValueArgs()
        if self._fmt.arguments == "cut":
            return CutArgs(FUNCTION_GEMMA_QUOTE, self._fmt.end)
        return JsonRelayout()


def _name_at(text: str) -> int:
    """Where the first character a tool's name may hold is (-1: none)."""
    return next((i for i, c in enumerate(text) if c.isalnum() or c in "_.-"), -1)


class CallsSent:
    """What a stream has sent of each call, and what then finishes the reply's calls."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._arguments: list[str] = []

    def add(self, delta: CallDelta) -> None:
        if delta.name is not None:
            self._names.append(delta.name)
            self._arguments.append("")
        self._arguments[delta.index] += delta.arguments

    @property
    def begun(self) -> int:
        """How many calls were begun."""
        return len(self._names)

    def name(self, index: int) -> str:
        return self._names[index]

    def arguments(self, index: int) -> str:
        """The arguments sent of call `index` so far."""
        return self._arguments[index]

    def rest(self, calls: Sequence[ToolCall]) -> list[CallDelta]:
        """The deltas that finish `calls` (the finished reply's): the rest of each call
        begun, then each call not begun, whole.

        A call begun is finished as `json.dumps` writes its arguments, which the text sent
        is a prefix of; one whose arguments were sent whole needs nothing more (with
        duplicate keys the text sent differs, but reads back as the same object). Calls
        begun beyond `calls` (one cut off, or unreadable) stay as they were sent.
        """
        out: list[CallDelta] = []
        for i, call in enumerate(calls):
            whole = json.dumps(call.arguments, ensure_ascii=False)
            if i >= len(self._names):
                out.append(CallDelta(i, call.name, whole))
            elif whole.startswith(self._arguments[i]) and whole != self._arguments[i]:
                out.append(CallDelta(i, None, whole[len(self._arguments[i]) :]))
        return out

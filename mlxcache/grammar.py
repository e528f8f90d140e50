"""Grammars as text: llguidance grammars from JSON Schema or Lark, checked without a model.

Only llguidance is imported here (no MLX, no numpy): `mlxcache json --check` compiles a
schema's grammar at start-up speed. Decoding with a grammar is `constrain.py`'s.
"""

from __future__ import annotations

import re
from typing import Any

from llguidance import LLMatcher, LLParserLimits

JSON_OPTIONS: dict[str, Any] = {
    # No free whitespace: a small model otherwise pads JSON with newlines until max tokens.
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
"""How constrained JSON is laid out: one line, `{"a": 1, "b": [2, 3]}`."""

LENIENT_OPTIONS: dict[str, Any] = {"lenient": True, "coerce_one_of": True}
"""Enforce what the grammar can: unknown formats become plain strings, keywords it cannot
enforce are skipped (reported as warnings), `oneOf` is decoded as `anyOf`."""


def grammar_from_json_schema(schema: dict[str, Any], lenient: bool = False) -> str:
    """The llguidance grammar enforcing `schema`, laid out as JSON_OPTIONS says."""
    options = {**JSON_OPTIONS, **LENIENT_OPTIONS} if lenient else JSON_OPTIONS
    return str(LLMatcher.grammar_from_json_schema(schema, overrides=options))  # type: ignore[arg-type]


def regex_literal(text: str) -> str:
    """`text` as a Lark regex matching it exactly (one line, `/` escaped)."""
    escapes = {"\n": "\\n", "/": "\\/"}  # `/` ends a Lark regex
    return "".join(escapes.get(c) or re.escape(c) for c in text)


def grammar_from_lark(lark: str) -> str:
    """The llguidance grammar of a Lark (llguidance dialect) text."""
    return str(LLMatcher.grammar_from_lark(lark))


def grammar_check(grammar: str) -> tuple[str | None, list[str]]:
    """(why llguidance cannot compile `grammar` or None, its warnings), each one line.

    Checked without a tokenizer, so bad schemas are refused before a model is loaded, and
    within llguidance's default limits (grammar size, lexer fuel), so none runs for long.
    """
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=LLParserLimits())
    lines = [" ".join(m.split()) for m in messages]
    if is_error:
        return (lines[0] if lines else "invalid grammar"), []
    return None, lines


def grammar_error(grammar: str) -> str | None:
    """Why llguidance cannot compile `grammar` (one line), or None when it can."""
    return grammar_check(grammar)[0]

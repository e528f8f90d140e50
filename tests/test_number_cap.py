"""The digit cap on numbers a schema leaves unbounded, checked on the token mask of the
tiny model's byte-level tokenizer (one token per digit)."""

from __future__ import annotations

from typing import Any

import pytest
from grammar_accepts import accepts

from mlxcache.constrain import processor_for
from mlxcache.events import Result, Stats
from mlxcache.model import LoadedModel
from mlxcache.modes.json_mode import JsonTask, read_reply
from mlxcache.modes.schema import NUMBER_CAP, check_schema

DIGITS = set("0123456789")
D4 = "http://json-schema.org/draft-04/schema#"
INT: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
}
NUM: dict[str, Any] = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}


def next_digits(model: LoadedModel, grammar: str, text: str) -> set[str]:
    """The digits the grammar's token mask allows right after `text`."""
    proc = processor_for(model, grammar)
    assert proc.matcher.consume_tokens(model.tokenizer.encode(text, add_special_tokens=False))
    allowed = proc.allowed(model.tokenizer.vocab_size)
    ids = {d: model.tokenizer.encode(d, add_special_tokens=False) for d in DIGITS}
    assert all(len(i) == 1 for i in ids.values())  # byte-level: one token per digit
    return {d for d, [i] in ids.items() if allowed[i]}


def test_an_unbounded_integer_gets_no_17th_digit(tiny: LoadedModel) -> None:
    grammar = check_schema(INT).grammar
    assert next_digits(tiny, grammar, '{"n": ' + "1" * 15) == DIGITS
    assert next_digits(tiny, grammar, '{"n": ' + "1" * 16) == set()
    assert next_digits(tiny, grammar, '{"n": -' + "1" * 16) == set()
    assert NUMBER_CAP == 9007199254740991
    assert accepts(tiny, grammar, '{"n": 9007199254740991}')
    assert accepts(tiny, grammar, '{"n": -9007199254740991}')
    assert not accepts(tiny, grammar, '{"n": 9007199254740992}')


def test_an_unbounded_number_gets_16_digits_and_10_after_the_point(tiny: LoadedModel) -> None:
    grammar = check_schema(NUM).grammar
    assert next_digits(tiny, grammar, '{"x": ' + "1" * 16) == set()
    assert next_digits(tiny, grammar, '{"x": 0.' + "1" * 9) == DIGITS
    assert next_digits(tiny, grammar, '{"x": 0.' + "1" * 10) == set()
    assert accepts(tiny, grammar, '{"x": -2.5}')
    assert accepts(tiny, grammar, '{"x": 9007199254740990.9999999999}')
    assert not accepts(tiny, grammar, '{"x": 1e5}')  # bounded numbers have no exponent


@pytest.mark.parametrize(
    ("schema", "yes", "no"),
    [
        ({"type": "integer", "minimum": 0, "maximum": 100}, ["0", "100"], ["-1", "101"]),
        ({"type": "integer", "minimum": 0}, ["9007199254740991"], ["-1", "9007199254740992"]),
        (
            {"type": "integer", "maximum": 10**18},
            ["1000000000000000000", "-9007199254740991"],
            ["-9007199254740992"],
        ),
        (
            {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
            ["1.5", "0.0000000001"],
            ["0", "1.6", "0.00000000001"],
        ),
        ({"$schema": D4, "type": "number", "maximum": 5, "exclusiveMaximum": True}, ["4.5"], ["5"]),
        ({"type": "number", "multipleOf": 0.25}, ["0.75"], ["0.3", "9007199254740992"]),
        ({"type": ["integer", "null"]}, ["null", "7"], ["9007199254740992"]),
    ],
)
def test_bounds_the_schema_gives_are_kept(
    tiny: LoadedModel, schema: dict[str, Any], yes: list[str], no: list[str]
) -> None:
    grammar = check_schema(schema).grammar
    assert [accepts(tiny, grammar, text) for text in yes] == [True] * len(yes)
    assert [accepts(tiny, grammar, text) for text in no] == [False] * len(no)


def test_the_cap_is_left_out_where_it_would_leave_no_value() -> None:
    narrow = {"type": "number", "minimum": 1e-15, "maximum": 2e-15}  # no multiple of 1e-10
    assert check_schema(narrow).decoding == narrow
    past = {"type": "integer", "minimum": 10**17}  # past the cap: no maximum added
    assert check_schema(past).decoding == past
    listed = {"type": "integer", "enum": [10**17]}
    assert check_schema(listed).decoding == listed


def test_strict_keeps_the_schema_numbers_unless_asked(tiny: LoadedModel) -> None:
    strict = check_schema(INT, strict=True)
    assert strict.decoding == {**INT, "additionalProperties": False}
    assert next_digits(tiny, strict.grammar, '{"n": ' + "1" * 16) == DIGITS
    capped = check_schema(INT, strict=True, cap_numbers=True)
    assert next_digits(tiny, capped.grammar, '{"n": ' + "1" * 16) == set()
    uncapped = check_schema(INT, cap_numbers=False)
    assert next_digits(tiny, uncapped.grammar, '{"n": ' + "1" * 16) == DIGITS


def test_replies_are_validated_against_the_schema_as_given() -> None:
    task = JsonTask.create(INT)
    assert task.schema is INT and INT["properties"]["n"] == {"type": "integer"}
    beyond = read_reply(task, Result('{"n": 123456789012345678901}', [], "stop", Stats()))
    assert (beyond.output, beyond.error) == ({"n": 123456789012345678901}, None)
    bad = read_reply(task, Result('{"n": 1.5}', [], "stop", Stats()))
    assert (
        bad.error
        == "the reply does not satisfy the schema: type at /n: 1.5 is not of type 'integer'"
    )

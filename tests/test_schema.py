"""JSON Schema compile: lenient vs strict, closed objects, $ref cycles, one-line errors, validation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from grammar_accepts import accepts

from mlxcache.errors import GrammarError
from mlxcache.model import LoadedModel
from mlxcache.modes.schema import (
    MAX_ERROR,
    DuplicateKeyError,
    check_schema,
    parse_json,
    validation_error,
)
from mlxcache.modes.schema_walk import close_objects, ref_cycle, resolve

D4 = "http://json-schema.org/draft-04/schema#"
D7 = "http://json-schema.org/draft-07/schema#"  # still has `dependencies` (2020-12 split it)
CANNOT = "schema uses what constrained decoding cannot enforce: "
STRICT_HINT = " (remove or rewrite that part, or leave strict mode)"

# One schema per kind of refusal seen on real-world schemas: what --strict says (cause and
# location), what lenient decoding lists as checked after, and an instance breaking only it.
KINDS: list[tuple[dict[str, Any], str, str, Any, str]] = [
    (
        {
            "type": "object",
            "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
        },
        "oneOf constraints are not supported at /properties/v/oneOf",
        "oneOf decoded as anyOf at /properties/v/oneOf",
        {"v": 1},
        "oneOf at /v: 1 is valid under each of {'type': 'number'}, {'type': 'integer'}",
    ),
    (
        {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
        'Unimplemented keys: ["uniqueItems"] at /properties/tags/uniqueItems',
        'Unimplemented keys: ["uniqueItems"] at /properties/tags/uniqueItems',
        {"tags": ["a", "a"]},
        "uniqueItems at /tags: ['a', 'a'] has non-unique elements",
    ),
    (
        {"type": "object", "properties": {"not": {"type": "string", "not": {"const": "x"}}}},
        'Unimplemented keys: ["not"] at /properties/not/not',  # a property named "not" is no keyword
        'Unimplemented keys: ["not"] at /properties/not/not',
        {"not": "x"},
        "not at /not: 'x' should not be valid under {'const': 'x'}",
    ),
    (
        {
            "type": "object",
            "properties": {"a": {}},
            "if": {"required": ["a"]},
            "then": {"required": ["b"]},
        },
        'Unimplemented keys: ["if", "then"] at /if',
        'Unimplemented keys: ["if", "then"] at /if',
        {"a": 1},
        "required at /: 'b' is a required property",
    ),
    (
        {
            "$schema": D7,
            "type": "object",
            "properties": {"a": {}, "b": {}},
            "dependencies": {"a": ["b"]},
        },
        'Unimplemented keys: ["dependencies"] at /dependencies',
        'Unimplemented keys: ["dependencies"] at /dependencies',
        {"a": 1},
        "dependencies at /: 'b' is a dependency of 'a'",
    ),
    (
        {"type": "array", "contains": {"const": 3}},
        'Unimplemented keys: ["contains"] at /contains',
        'Unimplemented keys: ["contains"] at /contains',
        [1],
        "contains at /: [1] does not contain items matching the given schema",
    ),
    (
        {"type": "object", "propertyNames": {"maxLength": 3}},
        'Unimplemented keys: ["propertyNames"] at /propertyNames',
        'Unimplemented keys: ["propertyNames"] at /propertyNames',
        {"long": 1},
        "maxLength at /: 'long' is too long",
    ),
    (
        {"type": "string", "format": "regex"},
        "Unknown format: regex at /format",
        "Unknown format: regex at /format",
        "(",
        "format at /: '(' is not a 'regex'",
    ),
    (
        {"type": "object", "properties": {"id": {"type": "string", "pattern": "^(?!x)[a-z]+$"}}},
        "regex parse error: ^(?!x)[a-z]+$ ^^^ error: look-around, including look-ahead and "
        "look-behind, is not supported at /properties/id/pattern",
        "pattern at /properties/id/pattern",
        {"id": "xy"},
        "pattern at /id: 'xy' does not match '^(?!x)[a-z]+$'",
    ),
]


@pytest.mark.parametrize(("schema", "strict", "unenforced", "bad", "rule"), KINDS)
def test_each_refusal_kind_strict_vs_lenient(
    schema: dict[str, Any], strict: str, unenforced: str, bad: Any, rule: str
) -> None:
    with pytest.raises(GrammarError) as info:
        check_schema(schema, strict=True)
    assert str(info.value) == CANNOT + strict + STRICT_HINT
    compiled = check_schema(schema)
    assert compiled.unenforced == (unenforced,)
    assert compiled.schema is schema  # outputs are validated against the schema as given
    assert validation_error(bad, schema) == rule


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ([1], "schema must be a JSON object, got list"),
        (
            {"type": "object", "properties": {"age": {"type": "strin"}}},
            "schema is not valid JSON Schema at /properties/age/type (anyOf): 'strin' is not "
            "valid under any of the given schemas",
        ),
        (
            {"properties": {"age": {"minimum": "ten"}}},
            "schema is not valid JSON Schema at /properties/age/minimum (type): 'ten' is not "
            "of type 'number'",
        ),
        (
            {"properties": {"a": {"$ref": "#/$defs/missing"}}},
            CANNOT + "Pointer '/$defs/missing' does not exist at /properties/a/$ref "
            "(remove or rewrite that part)",
        ),
        (
            {"properties": {"a": {"$ref": "other.json#/x"}}},
            CANNOT + "Resource 'json-schema:///other.json' is not present in a registry and "
            "retrieving it failed: Default retriever does not fetch resources at "
            "/properties/a/$ref (remove or rewrite that part)",
        ),
        (
            {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}},
            "schema has a $ref cycle that never reaches a value at /definitions/a/$ref",
        ),
        (
            {"anyOf": [{"type": "null"}, {"allOf": [{"$ref": "#"}]}]},
            "schema has a $ref cycle that never reaches a value at /anyOf/1/allOf/0/$ref",
        ),
    ],
)
def test_refusals_are_one_line_with_the_location(schema: Any, message: str) -> None:
    with pytest.raises(GrammarError) as info:
        check_schema(schema)
    assert str(info.value) == message


def test_a_huge_quote_is_cut_but_the_location_kept() -> None:
    codes = [f"C{i:03d}" for i in range(400)]
    schema = {"$schema": D4, "properties": {"currency": {"enum": [*codes, "C000"]}}}  # not unique
    with pytest.raises(GrammarError) as info:
        check_schema(schema)
    text = str(info.value)
    assert len(text) <= MAX_ERROR and "\n" not in text
    assert text.startswith(
        "schema is not valid JSON Schema at /properties/currency/enum (uniqueItems): "
    )
    assert text.endswith("…")


def test_recursion_through_a_value_is_fine() -> None:
    tree = {
        "$ref": "#/definitions/node",
        "definitions": {
            "node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/definitions/node"}}},
            }
        },
    }
    assert ref_cycle(tree) is None
    assert check_schema(tree).unenforced == ()
    assert resolve(tree, "#/definitions/node") == (
        ("definitions", "node"),
        tree["definitions"]["node"],
    )
    assert resolve(tree, "#/definitions/nope") is None


def test_close_objects_only_where_keys_are_left_open_by_omission() -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "plain": {"type": "object", "properties": {"x": {}}},
            "open": {"type": "object", "properties": {"x": {}}, "additionalProperties": True},
            "merged": {"allOf": [{"$ref": "#/definitions/base"}, {"properties": {"y": {}}}]},
            "needs_other": {"type": "object", "properties": {"x": {}}, "required": ["z"]},
            "either": {"properties": {"k": {}}, "oneOf": [{"properties": {"a": {}}}]},
            "choice": {"anyOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
        },
        "definitions": {"base": {"properties": {"x": {}}}},
    }
    close_objects(schema)
    props = schema["properties"]
    closed = {name for name, sub in props.items() if sub.get("additionalProperties") is False}
    assert closed == {"plain"}
    assert schema["additionalProperties"] is False
    assert "additionalProperties" not in schema["definitions"]["base"]  # an allOf branch's $ref
    assert "additionalProperties" not in props["merged"]["allOf"][1]
    assert "additionalProperties" not in props["either"]["oneOf"][0]  # merged with "k"
    assert [b.get("additionalProperties") for b in props["choice"]["anyOf"]] == [False, False]


OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_closed_objects_while_decoding(tiny: LoadedModel) -> None:
    closed = check_schema(OPEN)
    assert "additionalProperties" not in OPEN  # the given schema is untouched
    assert accepts(tiny, closed.grammar, '{"a": 1}')
    assert not accepts(tiny, closed.grammar, '{"a": 1, "b": 2}')
    extra = check_schema(OPEN, allow_extra_keys=True)
    assert accepts(tiny, extra.grammar, '{"a": 1, "b": 2}')


def test_duplicate_keys_are_not_json_we_accept() -> None:
    assert parse_json('{"a": {"b": 1}}') == {"a": {"b": 1}}
    with pytest.raises(DuplicateKeyError, match="key 'b' appears twice in an object"):
        parse_json('{"a": {"b": 1, "b": 2}}')
    with pytest.raises(json.JSONDecodeError):
        parse_json("{")


def test_validation_names_the_rule_and_the_path() -> None:
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert validation_error({"city": "Paris"}, city) is None
    assert validation_error({"city": 3}, city) == "type at /city: 3 is not of type 'string'"


def test_recursive_allof_is_narrowed_in_lenient_mode() -> None:
    schema = {
        "$ref": "#/definitions/Foo",
        "definitions": {
            "Child": {"type": "object"},
            "Foo": {
                "type": "object",
                "properties": {
                    "kids": {
                        "allOf": [{"$ref": "#/definitions/Foo"}, {"$ref": "#/definitions/Child"}]
                    }
                },
            },
        },
    }
    with pytest.raises(GrammarError, match="circular references with sibling keys"):
        check_schema(schema, strict=True)
    compiled = check_schema(schema)
    assert compiled.unenforced == (
        "allOf at /definitions/Foo/properties/kids/allOf (only its #/definitions/Foo branch decoded)",
    )
    assert compiled.decoding["definitions"]["Foo"]["properties"]["kids"]["allOf"] == [
        {"$ref": "#/definitions/Foo"}
    ]
    assert len(schema["definitions"]["Foo"]["properties"]["kids"]["allOf"]) == 2  # as given

"""JSON Schema input: reading, checking (jsonschema + llguidance) and validating output.

Every refusal names where the problem is, as a JSON pointer into the schema, so the user
can find it: "schema is not valid JSON Schema: 'strin' is not valid ... at /properties/age/type".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError, ValidationError

from mlxcache.constrain import grammar_error, grammar_from_json_schema
from mlxcache.errors import GrammarError, UserInputError


def read_json_arg(value: str, what: str) -> Any:
    """A JSON value given inline or as a file path (`value` starting with `{` or `[` is inline).

    Raises:
        UserInputError: unreadable file or not JSON (with line and column).
    """
    text, origin = value, what
    if not value.lstrip().startswith(("{", "[")):
        path = Path(value).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UserInputError(f"cannot read {what} file {value}: {reason}") from exc
        origin = f"{what} file {value}"
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserInputError(
            f"{origin} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc


def pointer(parts: Any) -> str:
    """A JSON pointer ("/properties/age") from path parts; "/" for the root."""
    items = [str(p).replace("~", "~0").replace("/", "~1") for p in parts]
    return "/" + "/".join(items) if items else "/"


def _walk(node: Any, parts: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield parts, node
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _walk(value, (*parts, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, (*parts, i))


def locate(schema: Any, message: str) -> str | None:
    """Best guess of where in `schema` llguidance's `message` points (it names no location).

    "Unimplemented keys: [\"uniqueItems\"]" points at the first object with such a key;
    other messages quote a value of the schema (a regex, a $ref), found by its text.
    """
    keys = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    if keys:
        names = set(re.findall(r'"([^"]*)"', keys.group(1)))
        for parts, node in _walk(schema):
            if isinstance(node, dict):
                hit = next((k for k in node if k in names), None)
                if hit is not None:
                    return pointer((*parts, hit))
    for parts, node in _walk(schema):
        quoted = isinstance(node, str) and len(node) >= 3 and parts
        if quoted and (node in message or (node.startswith("#") and node[1:] in message)):
            return pointer(parts)
    return None


def check_schema(schema: Any, what: str = "schema") -> str:
    """Check `schema` is valid JSON Schema that llguidance can enforce; returns its grammar.

    Raises:
        GrammarError: not an object, not valid JSON Schema, or a feature constrained
            decoding cannot enforce; the message names the location.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise GrammarError(
            f"{what} is not valid JSON Schema: {exc.message} at {pointer(exc.path)}"
        ) from exc
    grammar = grammar_from_json_schema(schema)
    problem = grammar_error(grammar)
    if problem is not None:
        where = locate(schema, problem)
        at = f" at {where}" if where else ""
        raise GrammarError(
            f"{what} uses what constrained decoding cannot enforce: {problem}{at} "
            "(remove or rewrite that part)"
        )
    return grammar


def validation_error(instance: Any, schema: dict[str, Any]) -> str | None:
    """Why `instance` does not satisfy `schema` (with location), or None when it does."""
    validator = jsonschema.validators.validator_for(schema)(schema)
    error: ValidationError | None = jsonschema.exceptions.best_match(
        validator.iter_errors(instance)
    )
    if error is None:
        return None
    return f"{error.message} at {pointer(error.absolute_path)}"

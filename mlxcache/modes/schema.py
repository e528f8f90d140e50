"""JSON Schema input: reading, compiling to a grammar, and validating output.

Lenient by default: the grammar enforces what llguidance can (`oneOf` as `anyOf`, unknown
formats as plain strings, keywords it cannot enforce skipped) and every output is then
validated against the schema as given, formats included. `strict` refuses up front what
the grammar cannot enforce. Every refusal is one line and names its location as a JSON
pointer into the schema when it is known for sure, never a guess:
"schema uses what constrained decoding cannot enforce: Unimplemented keys: ["not"] at /properties/age/not".

Numbers the schema leaves unbounded get a digit cap while decoding (`bound_numbers`), so a
small model cannot write digits until the token limit; `strict` keeps the schema's own
numbers unless asked (`cap_numbers`).
"""

from __future__ import annotations

import copy
import json
import math
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import SchemaError, ValidationError
from llguidance import LLMatcher

from mlxcache.errors import GrammarError, Setting, UserInputError, Worded
from mlxcache.fileio import loads_json
from mlxcache.grammar import grammar_check, grammar_error, grammar_from_json_schema
from mlxcache.modes.repeats import describe_loop
from mlxcache.modes.schema_walk import (
    Parts,
    close_objects,
    keyword_at,
    narrow_recursive_allof,
    pointer,
    reachable,
    ref_cycle,
    resolve,
    strip_ref_siblings,
    value_at,
)

_ONE_OF_HINT = re.compile(r"\.?\s*Enable 'coerce_one_of'[^.]*\.?")
_MAX_NARROWING = 8
# llguidance naming a definition, under the schema's $id or not: "...#/definitions/node".
_NAMED_DEFINITION = re.compile(r"\S*?(#/[^\s)]*)")
_CIRCULAR = "circular references with sibling keys"

NUMBER_CAP = 2**53 - 1
"""Largest magnitude decoding lets an integer or number the schema leaves unbounded take:
16 digits, the integers every JSON parser reads exactly (RFC 8259 section 6); llama.cpp's
converter also stops at about 16 digits."""
FRACTION_DIGITS = 10
"""Most fraction digits of a `number` without `multipleOf` (expressed as `multipleOf` 1e-10,
the finest step llguidance compiles over the whole capped range)."""
_FRACTION_STEP = 1e-10
_NUMBER_KEYS = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")

MAX_SCHEMA_OBJECTS = 2_000
"""Most JSON objects (subschemas and property maps) in the schemas of one request. Checking
and compiling grow faster than their size (llguidance builds an object of n optional
properties in ~n² steps), so this bounds each request's schema work: at the limit, about
3 s on 2 CPU cores; a 5 MB schema is refused at once instead of running for minutes."""
MAX_SCHEMA_VALUES = 100_000
"""Most JSON values in them (strings, numbers, enum members, ...)."""
_INTEGERS = range(-(2**63), 2**64)
"""The integers llguidance's JSON compiler takes (64 bits, signed or not)."""

MAX_ERROR = 300
"""Longest error line: long quotes of the schema are cut, the location is kept..."""
MAX_POINTER = 150
"""...unless it is longer than this (a pointer through a long regex key): then omitted."""


def one_line(text: str, limit: int = MAX_ERROR) -> str:
    """`text` on one line, cut to `limit` characters (an ellipsis marks the cut)."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def read_json_arg(value: str, what: str) -> Any:
    """A JSON value given inline or as a file: a path or @path (`{` or `[` first is inline).

    Raises:
        UserInputError: unreadable file or not JSON (with line and column).
    """
    text, origin = value, what
    if not value.lstrip().startswith(("{", "[")):
        path = Path(value.removeprefix("@")).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UserInputError(f"cannot read {what} file {value}: {reason}") from exc
        origin = f"{what} file {value}"
    try:
        return loads_json(text)
    except json.JSONDecodeError as exc:
        raise UserInputError(
            f"{origin} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc


@dataclass(frozen=True, slots=True)
class CompiledSchema:
    """A checked schema and the grammar that decodes it.

    `schema` is what outputs are validated against (as given); `decoding` is what the
    grammar enforces (objects closed, lenient options set: embed it in a Lark `%json`);
    `unenforced` lists what only the validation after decoding checks.
    """

    schema: dict[str, Any]
    decoding: dict[str, Any]
    grammar: str
    unenforced: tuple[str, ...] = ()


@lru_cache(maxsize=4096)
def _regex_ok(pattern: str) -> bool:
    return grammar_error(LLMatcher.grammar_from_regex(pattern)) is None


def _drop_bad_patterns(root: dict[str, Any]) -> list[str]:
    """Remove (in place) `pattern`s the grammar cannot compile (look-around...); say where."""
    dropped = []
    for parts, node in reachable(root):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and not _regex_ok(pattern):
            del node["pattern"]
            dropped.append(f"pattern at {pointer((*parts, 'pattern'))}")
    return dropped


def _number_cap(node: dict[str, Any]) -> dict[str, Any]:
    """The bounds `bound_numbers` adds to `node`: those of an integer or number it lacks."""
    kinds = node.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if not {"integer", "number"} & set(kinds) or any(k in node for k in ("enum", "const", "$ref")):
        return {}
    cap: dict[str, Any] = {}
    if "minimum" not in node and "exclusiveMinimum" not in node:
        cap["minimum"] = -NUMBER_CAP
    if "maximum" not in node and "exclusiveMaximum" not in node:
        cap["maximum"] = NUMBER_CAP
    if "number" in kinds and "multipleOf" not in node:
        cap["multipleOf"] = _FRACTION_STEP
    return cap


@lru_cache(maxsize=4096)
def _numbers_ok(schema: str) -> bool:
    return grammar_error(grammar_from_json_schema(loads_json(schema))) is None


def bound_numbers(root: dict[str, Any]) -> None:
    """Cap (in place) every reachable integer and number schema the schema leaves unbounded:
    at most NUMBER_CAP in magnitude, at most FRACTION_DIGITS fraction digits.

    Bounds the schema gives are kept (only a missing side is added). A cap that would leave
    no value or that llguidance cannot compile (a range narrower than a fraction step, a
    lower bound past the cap) is not added. Capping only narrows: every value it lets
    through is valid against the schema as given.
    """
    draft = {"$schema": root["$schema"]} if isinstance(root.get("$schema"), str) else {}
    for _, node in reachable(root):
        cap = _number_cap(node)
        numbers = {**draft, **{k: node[k] for k in _NUMBER_KEYS if k in node}, **cap}
        if cap and _numbers_ok(json.dumps(numbers, sort_keys=True)):
            node.update(cap)


def problem_location(schema: Any, message: str) -> str | None:
    """Where in `schema` llguidance's `message` points, when that is certain; else None.

    llguidance names no location: unimplemented keywords and unknown formats are found
    by name among the subschemas decoding reaches, a bad regex by its text.
    """
    keys = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    if keys:
        return keyword_at(schema, set(re.findall(r'"([^"]*)"', keys.group(1))))
    fmt = re.search(r"Unknown format: (\S+)", message)
    if fmt:
        return value_at(schema, "format", fmt.group(1))
    overlap = re.search(r"patternProperty regexes /(.*)/ and /(.*)/ are not disjoint", message)
    if overlap:
        for parts, node in reachable(schema):
            if {overlap.group(1), overlap.group(2)} <= set(node.get("patternProperties", {})):
                return pointer((*parts, "patternProperties"))
        return None
    if "regex" in message:
        for parts, node in reachable(schema):
            found: list[tuple[str, tuple[str, ...]]] = [
                (key, ("patternProperties", key)) for key in node.get("patternProperties", {})
            ]
            if isinstance(node.get("pattern"), str):
                found.append((node["pattern"], ("pattern",)))
            for text, where in found:
                if text and text in message:
                    return pointer((*parts, *where))
    missing = re.search(r"Pointer '([^']*)' does not exist", message)
    if missing:
        return value_at(schema, "$ref", "#" + missing.group(1))
    remote = re.search(r"Resource 'json-schema:///([^'#]+)", message)
    if remote:
        refs = [(p, n["$ref"]) for p, n in reachable(schema) if isinstance(n.get("$ref"), str)]
        name = remote.group(1).strip("/")
        hit = next((p for p, ref in refs if ref.split("#")[0].strip("/") == name), None)
        return pointer((*hit, "$ref")) if hit is not None else None
    named = _NAMED_DEFINITION.search(message)
    if named:
        target = resolve(schema, named.group(1))
        return pointer(target[0]) if target else None
    if "oneOf" in message or "one_of" in message:
        found = [parts for parts, node in reachable(schema) if "oneOf" in node]
        return pointer((*found[0], "oneOf")) if len(found) == 1 else None
    return None


def _located(schema: dict[str, Any], warning: str) -> str:
    """An llguidance warning (what it skips) as one short line, with its location if known."""
    text = "oneOf decoded as anyOf" if warning.startswith("oneOf not fully") else warning
    where = problem_location(schema, warning)
    return one_line(f"{text} at {where}" if where else text, 160)


def _readable_number(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return value in _INTEGERS if isinstance(value, int) else math.isfinite(value)


def check_size(schema: Any, what: str = "schema") -> None:
    """Refuse schemas too large to prepare in bounded time (`MAX_SCHEMA_OBJECTS`,
    `MAX_SCHEMA_VALUES`) and numbers constrained decoding cannot read, before any other
    work; the walk stops at the first excess.

    Raises:
        GrammarError: one line, naming the number's location.
    """
    stack: list[tuple[Any, Parts]] = [(schema, ())]
    objects = values = 0
    while stack:
        node, parts = stack.pop()
        values += 1
        if isinstance(node, dict):
            objects += 1
            stack.extend((value, (*parts, key)) for key, value in node.items())
        elif isinstance(node, list):
            stack.extend((value, (*parts, i)) for i, value in enumerate(node))
        elif not _readable_number(node):
            raise GrammarError(
                f"{what} has a number constrained decoding cannot read at {pointer(parts)} "
                "(integers must fit in 64 bits, numbers must be finite)"
            )
        if objects > MAX_SCHEMA_OBJECTS or values > MAX_SCHEMA_VALUES:
            count, limit = (
                ("objects", MAX_SCHEMA_OBJECTS)
                if objects > MAX_SCHEMA_OBJECTS
                else ("values", MAX_SCHEMA_VALUES)
            )
            raise GrammarError(
                f"{what} is too large: more than {limit:,} JSON {count} (split or simplify it)"
            )


def _metaschema_error(schema: dict[str, Any], what: str) -> str | None:
    try:
        with warnings.catch_warnings():  # Python's `re` warns about odd patterns it compiles
            warnings.simplefilter("ignore")
            jsonschema.validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = pointer(tuple(exc.absolute_path))
        return f"{what} is not valid JSON Schema at {where} ({exc.validator}): {one_line(exc.message, 200)}"
    return None


def check_schema(
    schema: Any,
    what: str = "schema",
    strict: bool = False,
    allow_extra_keys: bool = False,
    cap_numbers: bool | None = None,
) -> CompiledSchema:
    """Check `schema` and compile its grammar, without a model (fast, bounded).

    Args:
        strict: refuse what the grammar cannot enforce instead of checking it after decoding.
        allow_extra_keys: leave objects open where the schema does (by default an object
            with `properties` and no `additionalProperties` gets no other keys).
        cap_numbers: bound the numbers the schema leaves unbounded while decoding
            (`bound_numbers`); None: unless `strict`, which keeps the schema's own numbers.

    Raises:
        GrammarError: not an object, too large (`check_size`), not valid JSON Schema, a
            `$ref` cycle, or (strict, or
            beyond what lenient decoding can skip) a feature the grammar cannot enforce.
    """
    if not isinstance(schema, dict):
        raise GrammarError(f"{what} must be a JSON object, got {type(schema).__name__}")
    check_size(schema, what)
    invalid = _metaschema_error(schema, what)
    if invalid is not None:
        raise GrammarError(invalid)
    cycle = ref_cycle(schema)
    if cycle is not None:
        raise GrammarError(
            f"{what} has a $ref cycle that never reaches a value at {pointer(cycle)}"
        )
    decoding = copy.deepcopy(schema)
    unenforced = [] if strict else _drop_bad_patterns(decoding)
    if not allow_extra_keys:
        close_objects(decoding)
    if cap_numbers if cap_numbers is not None else not strict:
        bound_numbers(decoding)
    grammar = grammar_from_json_schema(decoding, lenient=not strict)
    problem, warnings = grammar_check(grammar)
    if problem is not None and not strict and problem.startswith(_CIRCULAR):
        unenforced += strip_ref_siblings(decoding)
        grammar = grammar_from_json_schema(decoding, lenient=True)
        problem, warnings = grammar_check(grammar)
    for _ in range(_MAX_NARROWING):  # each round names one recursive definition
        named = _NAMED_DEFINITION.search(problem or "")
        if strict or problem is None or not problem.startswith(_CIRCULAR) or not named:
            break
        narrowed = narrow_recursive_allof(decoding, named.group(1))
        if not narrowed:
            break
        unenforced += narrowed
        grammar = grammar_from_json_schema(decoding, lenient=True)
        problem, warnings = grammar_check(grammar)
    if problem is not None:
        where = problem_location(schema, problem)
        at = f" at {where}" if where and len(where) <= MAX_POINTER else ""
        leave = (", or ", Setting("strict", "leave strict mode")) if strict else ()
        head = f"{what} uses what constrained decoding cannot enforce: "
        tail = Worded(f"{at} (remove or rewrite that part", *leave, ")")
        cause = one_line(_ONE_OF_HINT.sub("", problem), MAX_ERROR - len(head) - len(tail))
        raise GrammarError(head + cause + tail)
    unenforced += [_located(schema, w) for w in warnings]
    return CompiledSchema(schema, decoding, grammar, tuple(unenforced))


class DuplicateKeyError(ValueError):
    """A JSON object with the same key twice (valid JSON text, ambiguous data)."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(f"key {key!r} appears twice in an object")
        out[key] = value
    return out


def parse_json(text: str) -> Any:
    """`text` as JSON, refusing duplicate keys.

    Raises:
        ValueError: not JSON (json.JSONDecodeError) or a duplicate key (DuplicateKeyError).
    """
    return loads_json(text, object_pairs_hook=_no_duplicates)


def read_document(
    text: str, raw: str, finish_reason: str, generated: int, schema: dict[str, Any]
) -> tuple[Any, str | None]:
    """A JSON reply's document and None, or None and why it cannot be used: cut off at the
    token limit, not JSON, or not valid against `schema`. `text`: the reply without its
    thinking section; `raw`: all of it (a loop it ends in is named)."""
    if finish_reason == "length":
        return None, (
            Worded(
                f"the reply reached the token limit ({generated}) before the JSON document "
                'was complete (finish_reason "length"); raise ',
                Setting("max_tokens"),
                ", or bound the schema (maxLength, maxItems)",
                describe_loop(raw),
            )
        )
    try:
        doc = parse_json(text)
    except ValueError as exc:
        return None, f"not JSON: {exc}"
    problem = validation_error(doc, schema)
    if problem is not None:
        return None, f"the reply does not satisfy the schema: {problem}"
    return doc, None


def validation_error(instance: Any, schema: dict[str, Any]) -> str | None:
    """Why `instance` does not satisfy `schema` (formats checked), or None when it does.

    One line naming the rule broken and where: "uniqueItems at /tags: [...] has non-unique
    elements".
    """
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    try:
        error: ValidationError | None = jsonschema.exceptions.best_match(
            validator.iter_errors(instance)
        )
    except Exception as exc:  # an unresolvable remote $ref, an unknown type: no common base
        return one_line(f"the schema cannot be checked: {type(exc).__name__}: {exc}")
    if error is None:
        return None
    where = pointer(tuple(error.absolute_path))
    return f"{error.validator} at {where}: {one_line(error.message, 200)}"

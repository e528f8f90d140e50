"""Reading and writing user files safely.

Writes: a crash or a full disk never leaves half a file behind. Reads: JSON and YAML from
users (or from a model's reply) go through `loads_json` / `load_yaml`, which refuse
documents nested deeper than `MAX_DEPTH`, so no reader, and no schema tool after it, ever
hits Python's recursion limit.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from mlxcache.errors import OutputFileError, UserInputError

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects accepted in any JSON or YAML input."""
MAX_YAML_VALUES = 1_000_000
"""Most values a YAML document may expand to through its aliases (a "billion laughs" guard)."""
# A JSON string (skipped whole: brackets inside it do not nest) or one bracket.
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
# One escape in a JSON string (`\\` is one: finditer keeps the backslashes paired).
_JSON_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")
"""A code point no text holds: half of a UTF-16 pair, or an undecodable byte (surrogateescape)."""
MAX_DIGITS = 4300
"""Longest integer in a JSON input (Python's own limit on converting one from text)."""
_LONG_NUMBER = re.compile(rf"\d{{{MAX_DIGITS + 1}}}")


def _too_deep_at(text: str) -> int | None:
    """Offset of the first bracket nested deeper than MAX_DEPTH, or None."""
    depth = 0
    for match in _JSON_TOKENS.finditer(text):
        char = match.group()
        if char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return match.start()
        elif char in "]}":
            depth -= 1
    return None


def _lone_surrogate_at(text: str) -> int | None:
    """Offset of the first lone surrogate in JSON text, as a character or a `\\u` escape
    (a high one not followed at once by a low one, or a low one alone), or None."""
    raw = _SURROGATE.search(text)
    if raw is not None:
        return raw.start()
    if "\\u" not in text:
        return None
    high: int | None = None  # offset of a high surrogate's escape waiting for its low half
    for m in _JSON_ESCAPE.finditer(text):
        code = int(m.group(1), 16) if m.group(1) else 0
        if high is not None:
            if 0xDC00 <= code <= 0xDFFF and m.start() == high + 6:
                high = None
                continue
            return high
        if 0xD800 <= code <= 0xDBFF:
            high = m.start()
        elif 0xDC00 <= code <= 0xDFFF:
            return m.start()
    return high


def loads_json(text: str | bytes, **options: Any) -> Any:
    """`json.loads(text, **options)`, refusing first documents nested deeper than MAX_DEPTH,
    strings that are not text (a lone surrogate, e.g. `"\\ud800"`: no tokenizer or UTF-8
    file takes one) and integers longer than MAX_DIGITS.

    Raises:
        json.JSONDecodeError: not JSON, or one of the above (with the offending position).
        UnicodeDecodeError: `text` is bytes that are not UTF-8.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    at = _too_deep_at(text)
    if at is not None:
        raise json.JSONDecodeError(f"nested deeper than {MAX_DEPTH} levels", text, at)
    at = _lone_surrogate_at(text)
    if at is not None:
        raise json.JSONDecodeError("a lone surrogate in a string (not valid text)", text, at)
    try:
        return json.loads(text, **options)
    except ValueError as exc:
        # Python's digit limit raises a plain ValueError (subclasses are the caller's own).
        long = _LONG_NUMBER.search(text)
        if type(exc) is not ValueError or long is None:
            raise
        message = f"an integer longer than {MAX_DIGITS} digits"
        raise json.JSONDecodeError(message, text, long.start()) from None


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, refusing deep nesting, self-referring aliases and alias bombs.

    Raises:
        yaml.YAMLError: not YAML, or one of the above.
    """
    import yaml  # here: JSON readers (`json --check`) need none of it

    try:
        doc = yaml.safe_load(text)
    except RecursionError:  # PyYAML's composer recurses per level: far deeper than MAX_DEPTH
        raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels") from None
    _check_tree(doc)
    return doc


def _check_tree(doc: Any) -> None:
    """Walk `doc` as a tree (aliases expanded) without recursion; a cycle is infinitely deep."""
    import yaml

    stack = [(doc, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise yaml.YAMLError(
                f"more than {MAX_YAML_VALUES} values once its aliases are expanded"
            )
        if isinstance(node, str) and _SURROGATE.search(node):
            raise yaml.YAMLError("a lone surrogate in a string (not valid text)")
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, (dict, list)):
            if depth == MAX_DEPTH:
                raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels")
            stack.extend((child, depth + 1) for child in children)


def check_output_dir(path: Path, option: str) -> None:
    """Refuse an output file whose directory does not exist (a typo, not a fault).

    Raises:
        UserInputError: naming the option and the missing directory.
    """
    parent = path.expanduser().parent
    if not parent.is_dir():
        raise UserInputError(f"{option} {path}: directory {parent} does not exist")


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, then rename it over `path`.

    Raises:
        OutputFileError: the directory or file cannot be written; `path` is untouched.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise OutputFileError(f"cannot write {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise OutputFileError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise

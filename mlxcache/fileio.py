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

import yaml

from mlxcache.errors import OutputFileError, UserInputError

MAX_DEPTH = 100
"""Deepest nesting of arrays and objects accepted in any JSON or YAML input."""
MAX_YAML_VALUES = 1_000_000
"""Most values a YAML document may expand to through its aliases (a "billion laughs" guard)."""
# A JSON string (skipped whole: brackets inside it do not nest) or one bracket.
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


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


def loads_json(text: str | bytes, **options: Any) -> Any:
    """`json.loads(text, **options)`, refusing documents nested deeper than MAX_DEPTH first.

    Raises:
        json.JSONDecodeError: not JSON, or nested too deeply (with the offending position).
        UnicodeDecodeError: `text` is bytes that are not UTF-8.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    at = _too_deep_at(text)
    if at is not None:
        raise json.JSONDecodeError(f"nested deeper than {MAX_DEPTH} levels", text, at)
    return json.loads(text, **options)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, refusing deep nesting, self-referring aliases and alias bombs.

    Raises:
        yaml.YAMLError: not YAML, or one of the above.
    """
    try:
        doc = yaml.safe_load(text)
    except RecursionError:  # PyYAML's composer recurses per level: far deeper than MAX_DEPTH
        raise yaml.YAMLError(f"nested deeper than {MAX_DEPTH} levels") from None
    _check_tree(doc)
    return doc


def _check_tree(doc: Any) -> None:
    """Walk `doc` as a tree (aliases expanded) without recursion; a cycle is infinitely deep."""
    stack = [(doc, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise yaml.YAMLError(
                f"more than {MAX_YAML_VALUES} values once its aliases are expanded"
            )
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

"""JSONL batches: input lines, `{{var}}` templates, a resumable output file, lanes.

Input: one JSON object per line, `{"prompt": "...", "vars": {...}, "id": ...}` (only
"prompt" required; blank lines skipped). Output: one record per input line, in input
order, appended and fsynced line by line. A rerun reads the output first and skips the
lines already there; a last line cut short by a crash (no final newline) is dropped and
redone.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from mlxcache import lanes as lanes_mod
from mlxcache.engine import Engine, Request
from mlxcache.errors import OutputFileError, UserInputError
from mlxcache.events import Result
from mlxcache.fileio import loads_json

_FIELDS = frozenset({"prompt", "vars", "id"})
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass(frozen=True, slots=True)
class InputLine:
    """One request of a batch. `line` is its 1-based line number in the input file."""

    line: int
    prompt: str
    vars: Mapping[str, str] = field(default_factory=dict)
    id: Any = None

    def __post_init__(self) -> None:
        if self.line < 1:
            raise ValueError(f"line numbers start at 1, got {self.line}")


def _parse_line(text: str, where: str, number: int) -> InputLine:
    try:
        obj = loads_json(text)
    except json.JSONDecodeError as exc:
        raise UserInputError(f"{where}: not JSON: {exc.msg} at column {exc.colno}") from exc
    if not isinstance(obj, dict):
        raise UserInputError(f'{where}: expected an object like {{"prompt": "..."}}')
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise UserInputError(f"{where}: unknown field {unknown[0]!r} (fields: id, prompt, vars)")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserInputError(f'{where}: "prompt" must be a non-empty string')
    raw_vars = obj.get("vars", {})
    if not isinstance(raw_vars, dict):
        raise UserInputError(f'{where}: "vars" must be an object of name: value')
    values: dict[str, str] = {}
    for name, value in raw_vars.items():
        if isinstance(value, (dict, list)) or value is None:
            raise UserInputError(f'{where}: var "{name}" must be a string, number or boolean')
        values[name] = value if isinstance(value, str) else json.dumps(value)
    return InputLine(number, prompt, values, obj.get("id"))


def read_input(path: Path) -> list[InputLine]:
    """Parse a JSONL input file; the first bad line stops it with its line number.

    Raises:
        UserInputError: unreadable file, a bad line, or no request at all.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"cannot read input file {path}: {exc}") from exc
    lines = [
        _parse_line(raw, f"{path} line {n}", n)
        for n, raw in enumerate(text.splitlines(), start=1)
        if raw.strip()
    ]
    if not lines:
        raise UserInputError(f"input file {path} has no request (one JSON object per line)")
    return lines


def substitute(template: str, values: Mapping[str, str], where: str) -> str:
    """`template` with each `{{name}}` replaced by `values[name]`.

    Raises:
        UserInputError: a placeholder without a value.
    """

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in values:
            raise UserInputError(f'{where}: no value for {{{{{name}}}}} (add it to "vars")')
        return values[name]

    return _PLACEHOLDER.sub(value, template)


@dataclass(frozen=True, slots=True)
class OutputState:
    """What an existing output file already holds."""

    done: frozenset[int]
    """Input line numbers with a record."""
    keep_bytes: int
    """Length of its complete lines; anything after is a torn last line to drop."""
    torn: bool


def read_output(path: Path) -> OutputState:
    """Scan an output file from an earlier run (absent: nothing done).

    Raises:
        UserInputError: a complete line that is not one of our records.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return OutputState(frozenset(), 0, False)
    except OSError as exc:
        raise UserInputError(f"cannot read output file {path}: {exc}") from exc
    keep = data.rfind(b"\n") + 1
    done: set[int] = set()
    for n, raw in enumerate(data[:keep].splitlines(), start=1):
        try:
            record = loads_json(raw)
            done.add(int(record["line"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise UserInputError(
                f"output file {path} line {n} is not a record of this command; "
                "fix or remove it, or write to another file"
            ) from exc
    return OutputState(frozenset(done), keep, keep < len(data))


class RecordWriter:
    """Appends one JSON record per line, each with a single write and an fsync.

    Opening truncates the file to `keep_bytes` (drops a torn last line) first.
    """

    def __init__(self, path: Path, keep_bytes: int) -> None:
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise OutputFileError(
                f"cannot write output file {path}: {exc.strerror or exc}"
            ) from exc
        if os.fstat(self._fd).st_size > keep_bytes:
            os.ftruncate(self._fd, keep_bytes)

    def write(self, record: dict[str, Any]) -> None:
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Job:
    """A request to run; `make` builds it when a lane frees up (processors are stateful)."""

    key: int
    make: Callable[[], Request]


def run_lanes(engine: Engine, jobs: Sequence[Job], lanes: int) -> Iterator[tuple[int, Result]]:
    """Run `jobs` with up to `lanes` in flight; yield (key, result) in job order."""
    return lanes_mod.run_lanes(
        engine, ((job.key, partial(lanes_mod.one_request, job.make)) for job in jobs), lanes
    )

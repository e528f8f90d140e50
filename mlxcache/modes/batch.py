"""JSONL batches: input lines, `{{var}}` templates, a resumable output file, lanes.

Input: one JSON object per line, `{"prompt": "...", "vars": {...}, "id": ...}` (only
"prompt" required; blank lines skipped). Output: one record per input line, in input
order, appended and fsynced line by line. Every record says what produced it (`run`: the
model, a digest of each shared input such as the schema, and the sampling), so a rerun
continues only the same run: it skips the lines already there and refuses records of
another run unless told to redo them. A last line cut short by a crash (no final newline)
is dropped and redone. A run claims its output file (`claim_output`) from reading what it
holds to its last record: a second run on the same file is refused, never writing its lines
twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from mlxcache import units
from mlxcache.engine import Engine, Request
from mlxcache.errors import OutputFileError, OutputMismatchError, UserInputError
from mlxcache.events import Result
from mlxcache.fileio import loads_json
from mlxcache.sampling import SamplingParams

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


def run_description(model_key: str, sampling: SamplingParams, **inputs: Any) -> dict[str, Any]:
    """What produces a batch's records: the model, a digest of each shared input, sampling."""

    def digest(value: Any) -> str | None:
        if value is None:
            return None
        text = json.dumps(value, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    return {
        "model": model_key[:16],
        **{name: digest(value) for name, value in inputs.items()},
        "sampling": asdict(sampling),
    }


def _differences(recorded: Any, run: dict[str, Any]) -> list[str]:
    """Names of what `recorded` (a record's `run`) has different from `run`."""
    if not isinstance(recorded, dict):
        return ["(not recorded)"]
    out = [k for k in run if k != "sampling" and recorded.get(k) != run[k]]
    theirs = recorded.get("sampling")
    if not isinstance(theirs, dict):
        return [*out, "sampling"]
    # A field added since the records were written had its default then.
    default = asdict(SamplingParams())
    return out + [k for k, v in run["sampling"].items() if theirs.get(k, default.get(k)) != v]


def read_output(path: Path, run: dict[str, Any] | None = None, redo: bool = False) -> OutputState:
    """Scan an output file from an earlier run (absent: nothing done).

    With `run` (see `run_description`), every record must come from that run. With `redo`,
    the file's records are to be replaced: nothing counts as done.

    Raises:
        UserInputError: a complete line that is not one of our records.
        OutputMismatchError: records of another run (unless `redo`).
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return OutputState(frozenset(), 0, False)
    except OSError as exc:
        raise UserInputError(f"cannot read output file {path}: {exc}") from exc
    if redo:
        return OutputState(frozenset(), 0, False)
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
        differences = _differences(record.get("run"), run) if run is not None else []
        if differences:
            raise OutputMismatchError(
                f"output file {path} holds records of another run (line {n} differs in: "
                f"{', '.join(differences)})"
            )
    return OutputState(frozenset(done), keep, keep < len(data))


@contextlib.contextmanager
def claim_output(path: Path) -> Iterator[None]:
    """Hold `path` for one run: read what it holds, plan, append, all under an OS lock on the
    file (released when the run ends or its process dies). A file created for the claim
    and left empty is removed again: a refused or failed plan leaves nothing behind.

    Raises:
        OutputFileError: another run holds the file, or it cannot be opened.
    """
    try:
        try:
            fd, created = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), True
        except FileExistsError:
            fd, created = os.open(path, os.O_RDWR), False
    except OSError as exc:
        raise OutputFileError(f"cannot write output file {path}: {exc.strerror or exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputFileError(
                f"output file {path} is being written by another run; wait for it to end, "
                "or write to another file"
            ) from None
        if os.fstat(fd).st_ino != _inode(path):  # removed by the run that held it before
            raise OutputFileError(f"output file {path} was removed meanwhile; run again")
        try:
            yield
        finally:
            if created and os.fstat(fd).st_size == 0:
                Path(path).unlink(missing_ok=True)  # still under the lock: nobody writes it
    finally:
        os.close(fd)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


class RecordWriter:
    """Appends one JSON record per line, each with a single write and an fsync.

    Opening truncates the file to `keep_bytes` (drops a torn last line) first.
    """

    def __init__(self, path: Path, keep_bytes: int) -> None:
        self._path = path
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise OutputFileError(
                f"cannot write output file {path}: {exc.strerror or exc}"
            ) from exc
        if os.fstat(self._fd).st_size > keep_bytes:
            os.ftruncate(self._fd, keep_bytes)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record.

        Raises:
            OutputFileError: the disk is full (or failing); the lines before are kept, and
                a rerun drops a line cut short and goes on from there.
        """
        data = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            os.fsync(self._fd)
        except OSError as exc:
            raise OutputFileError(
                f"cannot write output file {self._path}: {exc.strerror or exc}; the lines "
                "written before are kept and a rerun goes on from there"
            ) from exc

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Job:
    """A request to run; `make` builds it when its turn comes (processors are stateful)."""

    key: int
    make: Callable[[], Request]


def run_jobs(engine: Engine, jobs: Sequence[Job], concurrency: int) -> Iterator[tuple[int, Result]]:
    """Run `jobs` with up to `concurrency` in flight; yield (key, result) in job order."""
    return units.run_units(
        engine, ((job.key, partial(units.one_request, job.make)) for job in jobs), concurrency
    )

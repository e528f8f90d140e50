"""One line per request on stderr, and optionally one JSON object per request in a file."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from mlxcache.errors import OutputFileError

LOG_KEY = "mlxcache_log"
"""Where a request's numbers wait for its log line: `scope["state"][LOG_KEY]`."""


def log_fields(scope: Any) -> dict[str, Any]:
    """The log fields of the request `scope` belongs to (created by the guard)."""
    state: dict[str, Any] = scope.setdefault("state", {})
    fields: dict[str, Any] = state.setdefault(LOG_KEY, {})
    return fields


class RequestLog:
    """Writes request records (any thread).

    Raises:
        OutputFileError: `path` cannot be opened for appending.
    """

    def __init__(self, path: Path | None = None, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        if path is not None:
            try:
                self._file = path.open("a", encoding="utf-8")
            except OSError as exc:
                raise OutputFileError(f"cannot open log file {path}: {exc.strerror}") from exc

    def write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._stream.write(line(record) + "\n")
            self._stream.flush()
            if self._file is not None:
                self._file.write(json.dumps(record, ensure_ascii=False) + "\n")
                self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def line(record: dict[str, Any]) -> str:
    """`<id> <method> <path> <status> prompt=.. cached=.. generated=.. ttft=.. total=.. finish=..`."""
    parts = [str(record.get("id") or "-"), record["method"], record["path"], str(record["status"])]
    for key in ("prompt_tokens", "cached_tokens", "generated_tokens"):
        if key in record:
            parts.append(f"{key.removesuffix('_tokens')}={record[key]}")
    if record.get("ttft_s") is not None:
        parts.append(f"ttft={record['ttft_s']:.3f}s")
    parts.append(f"total={record['total_s']:.3f}s")
    if record.get("finish_reason"):
        parts.append(f"finish={record['finish_reason']}")
    if record.get("error"):
        parts.append(f"error={record['error']}")
    return " ".join(parts)

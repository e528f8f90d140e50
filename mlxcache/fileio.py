"""Writing user files safely: a crash or a full disk never leaves half a file behind."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mlxcache.errors import OutputFileError


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

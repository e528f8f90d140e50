"""Content hashes of model files (xxh3-128, read in chunks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import xxhash

_CHUNK = 1 << 22


def hash_file(hasher: Any, path: Path) -> None:
    """Feed `path`'s bytes to `hasher`."""
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            hasher.update(chunk)


def file_digest(path: Path) -> str:
    """Content hash of one file (hex)."""
    hasher = xxhash.xxh3_128()
    hash_file(hasher, path)
    return str(hasher.hexdigest())

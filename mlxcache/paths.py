"""Where mlxcache keeps converted models, the disk cache tier and chat sessions."""

from __future__ import annotations

import os
from pathlib import Path

from mlxcache.errors import UserInputError

ENV_CACHE_DIR = "MLXCACHE_CACHE_DIR"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: `override`, else $MLXCACHE_CACHE_DIR, else the platform cache dir.

    It need not exist yet (it is created on first write).

    Raises:
        UserInputError: the path, or a parent of it, is something other than a directory.
    """
    if override is not None:
        path = Path(override).expanduser()
    elif env := os.environ.get(ENV_CACHE_DIR):
        path = Path(env).expanduser()
    else:
        from platformdirs import user_cache_dir

        path = Path(user_cache_dir("mlxcache", appauthor=False))
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise UserInputError(f"cache directory {path} is not a directory{where}")
    return path


def kv_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The disk tier of the prompt cache, inside the cache directory."""
    return cache_dir(override) / "kv"

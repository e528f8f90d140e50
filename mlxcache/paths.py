"""Where mlxcache keeps converted models and the disk cache tier (the cache directory: all
of it can be made again) and saved chat sessions (the data directory: the user's own)."""

from __future__ import annotations

import os
from pathlib import Path

from mlxcache.errors import UserInputError

ENV_CACHE_DIR = "MLXCACHE_CACHE_DIR"
ENV_DATA_DIR = "MLXCACHE_DATA_DIR"


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
    return _directory(path, "cache")


def data_dir() -> Path:
    """The data directory: $MLXCACHE_DATA_DIR, else the platform's user data directory
    (XDG data home, e.g. ~/.local/share/mlxcache; ~/Library/Application Support/mlxcache
    on macOS). It need not exist yet.

    Saved chat sessions live here, not in the cache directory, which cache cleaners empty.

    Raises:
        UserInputError: the path, or a parent of it, is something other than a directory.
    """
    if env := os.environ.get(ENV_DATA_DIR):
        path = Path(env).expanduser()
    else:
        from platformdirs import user_data_dir

        path = Path(user_data_dir("mlxcache", appauthor=False))
    return _directory(path, "data")


def session_dirs(cache_override: str | os.PathLike[str] | None = None) -> list[Path]:
    """Where chat sessions are saved, then where mlxcache saved them before (the cache
    directory's `sessions`: still read, never written)."""
    home, legacy = data_dir() / "sessions", cache_dir(cache_override) / "sessions"
    return [home] if legacy == home else [home, legacy]


def _directory(path: Path, what: str) -> Path:
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "" if existing == path else f" ({existing} is a file)"
        raise UserInputError(f"{what} directory {path} is not a directory{where}")
    return path


def kv_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The disk tier of the prompt cache, inside the cache directory."""
    return cache_dir(override) / "kv"

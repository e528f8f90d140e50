"""Where mlxcache keeps converted models, the disk cache tier and chat sessions."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_DIR = "MLXCACHE_CACHE_DIR"


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: `override`, else $MLXCACHE_CACHE_DIR, else the platform cache dir."""
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(ENV_CACHE_DIR)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("mlxcache", appauthor=False))


def kv_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The disk tier of the prompt cache, inside the cache directory."""
    return cache_dir(override) / "kv"

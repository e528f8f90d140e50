"""Open an engine from settings: the one entry point the CLI and scripts need."""

from __future__ import annotations

from mlxcache.config import CacheConfig
from mlxcache.engine import Engine
from mlxcache.model import load
from mlxcache.model.gguf import Progress


def open_engine(
    model: str | None = None,
    cache: CacheConfig | None = None,
    progress: Progress | None = None,
) -> Engine:
    """Load `model` (default: the embedded SmolLM2) and attach the prompt cache `cache`."""
    cache = cache or CacheConfig()
    loaded = load(model, cache_root=cache.directory, progress=progress)
    return Engine(loaded, block_size=cache.block_size)

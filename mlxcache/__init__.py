"""mlxcache: an MLX model runner that resumes every prompt from the longest cached prefix.

The library API in one import::

    from mlxcache import CacheConfig, Request, SamplingParams, open_engine

    engine = open_engine()  # the embedded SmolLM2, memory + disk prompt cache
    ids = engine.encoder.encode_chat([{"role": "user", "content": "Hi!"}])
    print(engine.complete(Request(ids, SamplingParams(max_tokens=20))).text)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from mlxcache.config import CacheConfig
    from mlxcache.engine import Engine, Request
    from mlxcache.runtime import open_engine
    from mlxcache.sampling import SamplingParams

# Imported on first use (PEP 562): the engine imports mlx_lm and transformers (seconds),
# which `mlxcache --help` or `mlxcache cache ls` must not pay for.
_LAZY = {
    "CacheConfig": "mlxcache.config",
    "Engine": "mlxcache.engine",
    "Request": "mlxcache.engine",
    "open_engine": "mlxcache.runtime",
    "SamplingParams": "mlxcache.sampling",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'mlxcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["CacheConfig", "Engine", "Request", "SamplingParams", "__version__", "open_engine"]

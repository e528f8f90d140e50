"""mlxcache: an MLX model runner that resumes every prompt from the longest cached prefix.

The library API in one import::

    from mlxcache import CacheConfig, Request, SamplingParams, open_engine

    engine = open_engine()  # the embedded SmolLM2, memory + disk prompt cache
    ids = engine.encode_chat([{"role": "user", "content": "Hi!"}])
    print(engine.complete(Request(ids, SamplingParams(max_tokens=20))).text)
"""

__version__ = "0.1.0"

from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.runtime import open_engine
from mlxcache.sampling import SamplingParams

__all__ = ["CacheConfig", "Engine", "Request", "SamplingParams", "__version__", "open_engine"]

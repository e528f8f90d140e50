"""A child process that keeps random prompts of the tiny model into a shared cache directory.

Prints "kept N" after each entry is kept (the parent can wait for progress without reading
the index while it is written) and "disk_errors N" at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import load
from mlxcache.sampling import SamplingParams


def main(model: str, root: str, seed: int, count: int, disk_bytes: int = 20 << 30) -> None:
    loaded = load(model)
    config = CacheConfig(block_size=4, disk_bytes=disk_bytes)
    cache = PromptCache(loaded.model, loaded.key, config, root=Path(root))
    engine = Engine(loaded, cache)
    rng = np.random.default_rng(seed)
    for n in range(1, count + 1):
        engine.complete(
            Request(rng.integers(3, 250, size=24).tolist(), SamplingParams(max_tokens=1))
        )
        print(f"kept {n}", flush=True)
    print(f"disk_errors {cache.report()['disk_errors']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:]))

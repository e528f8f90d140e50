"""Prompts as long as the model's context resume from memory and from disk (a fresh cache
on the same directory), at full precision and with quantized KV, and reply as a cold run
does, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from tinymodel import write_tiny_gguf

from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import load
from mlxcache.model.kvquant import quantize_kv
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams

CONTEXT = 4096
REPLY = SamplingParams(max_tokens=3)


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_a_prompt_as_long_as_the_context_resumes_from_memory_and_disk(
    bits: int | None, tmp_path: Path, cache_root: Path
) -> None:
    path = tmp_path / "long.gguf"
    write_tiny_gguf(path, heads=2, kv_heads=1, context=CONTEXT)
    loaded = load(str(path), cache_root=cache_root)
    if bits is not None:
        loaded = quantize_kv(loaded, bits, 32)
    n = CONTEXT - REPLY.max_tokens
    first = [(7 * i + 3) % 250 + 1 for i in range(n)]
    second = [*first[:-5], 9, 8, 7, 6, 5]  # parts from `first` inside its last block
    config = CacheConfig(directory=tmp_path / "cache", block_size=16)
    cold = [Engine(loaded).complete(Request(p, REPLY)).tokens for p in (first, second)]

    warm = Engine(loaded, make_cache(loaded, config))
    assert warm.complete(Request(first, REPLY)).tokens == cold[0]
    again = warm.complete(Request(second, REPLY))
    assert again.stats.cached_from == "memory"
    assert again.stats.cached_tokens == (n - 5) // 16 * 16
    assert again.tokens == cold[1]

    fresh = Engine(loaded, make_cache(loaded, config))  # an empty memory tier
    resumed = fresh.complete(Request(second, REPLY))
    assert resumed.stats.cached_from == "disk"
    assert resumed.stats.cached_tokens == (n - 5) // 16 * 16
    assert resumed.tokens == cold[1]

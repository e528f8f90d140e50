"""A lease per resume: what a request stages is its lease's own, released exactly once."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcache.cache.base import LeaseError, NoCache
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.model import LoadedModel

B = 4


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 200, n).astype(np.int32)


def pins(cache: PromptCache) -> tuple[int, int]:
    report = cache.report()
    return report["pinned_entries"], report["open_leases"]


def prefilled(cache: PromptCache, ids: np.ndarray, model: LoadedModel) -> PromptCache:
    """Restore `ids`, prefill the rest block by block (capturing each), keep and release."""
    with cache.restore(ids) as lease:
        for stop in range(lease.length + B, len(ids) + 1, B):
            start = stop - B
            model.model(mx.array(ids[None, start:stop]), cache=lease.layers)
            lease.capture(stop)
        lease.keep(ids[: len(ids) // B * B])
    return cache


def test_a_lease_is_released_exactly_once(sliding: LoadedModel) -> None:
    cache = PromptCache(sliding.model, sliding.key, CacheConfig(block_size=B, disk_bytes=0))
    prefilled(cache, tokens(12), sliding)
    lease = cache.restore(tokens(13))
    assert lease.length == 12 and pins(cache) == (1, 1)  # its entry pinned while it runs
    lease.release()
    assert pins(cache) == (0, 0)
    for use in (lease.release, lambda: lease.keep(tokens(8)), lambda: lease.capture(4)):
        with pytest.raises(LeaseError, match="released already"):
            use()
    with pytest.raises(ValueError), cache.restore(tokens(13)):
        raise ValueError("a lane that fails")
    assert pins(cache) == (0, 0)  # the block's end released it


def test_what_a_lease_staged_is_its_own(sliding: LoadedModel) -> None:
    """Two requests prefill at once (their layers alive together, then one dropped and a
    new one made, as a worker's lanes come and go): each keeps only what it captured.
    A sliding window drops old positions, so a block kept from the wrong staging would
    hold another prompt's KV: the second prompt must resume as a cold prefill makes it."""
    cache = PromptCache(sliding.model, sliding.key, CacheConfig(block_size=B, disk_bytes=0))
    a, b = tokens(16, seed=1), tokens(16, seed=2)
    first, second = cache.restore(a), cache.restore(b)
    for stop in range(B, 17, B):
        for lease, ids in ((first, a), (second, b)):
            sliding.model(mx.array(ids[None, stop - B : stop]), cache=lease.layers)
            lease.capture(stop)
    first.release()  # staged, never kept: gone with its lease
    assert first.staged == {}
    second.keep(b)
    second.release()
    cold = PromptCache(sliding.model, sliding.key, CacheConfig(block_size=B, disk_bytes=0))
    prefilled(cold, b, sliding)
    probe = np.append(b, np.int32(7))
    with cache.restore(probe) as got, cold.restore(probe) as want:
        assert got.length == want.length == 16
        for mine, theirs in zip(got.layers, want.layers, strict=True):
            for x, y in zip(mine.state, theirs.state, strict=True):
                assert mx.array_equal(x, y)


def test_no_cache_leases_keep_nothing(tiny: LoadedModel) -> None:
    cache = NoCache(tiny.model, B)
    with cache.restore(tokens(9)) as lease:
        lease.keep(tokens(8))
        lease.keep_tail(tokens(9), None)
    assert cache.cached_length(tokens(9), whole=True) == 0
    with pytest.raises(LeaseError):
        lease.release()

"""Freed memory goes back to the system once the engine has nothing to run."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest

from mlxcache import sysmem, worker
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def test_an_idle_engine_keeps_no_freed_buffers(tiny: LoadedModel, tmp_path: Path) -> None:
    """While lanes run, MLX keeps freed buffers for reuse (else this test could not fail);
    when the last lane ends, through `run` or `generate`, none is left."""
    config = CacheConfig(block_size=4, directory=tmp_path)
    engine = Engine(tiny, PromptCache(tiny.model, tiny.key, config, root=tmp_path / "kv"))
    params = SamplingParams(max_tokens=6)
    for seed in range(3):
        engine.submit(Request(_prompt(40, seed), params))
    engine.warm(_prompt(24, 7))
    held = []
    for _ in engine.run(warm=True):
        held.append(mx.get_cache_memory())
    assert max(held) > 0
    assert mx.get_cache_memory() == 0
    list(engine.generate(Request(_prompt(30, 8), params)))
    assert mx.get_cache_memory() == 0


def test_release_unused_trims_the_c_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(sysmem, "_malloc_trim", lambda: calls.append)
    sysmem.release_unused()
    assert calls == [0]


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc only")
def test_glibc_malloc_trim_is_found() -> None:
    assert sysmem._malloc_trim() is not None


def test_a_worker_left_idle_releases_memory_once(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between back-to-back requests the worker keeps MLX's buffers; left idle for
    `IDLE_RELEASE_S` it hands them back, once (a cache report does not count as work)."""
    monkeypatch.setattr(worker, "IDLE_RELEASE_S", 0.05)
    config = CacheConfig(block_size=4, directory=tmp_path)
    engine = Engine(tiny, PromptCache(tiny.model, tiny.key, config, root=tmp_path / "kv"))
    release, released, calls = engine.release_memory, threading.Event(), []

    def spy() -> None:
        calls.append(engine.busy)
        release()
        released.set()

    engine.release_memory = spy  # type: ignore[method-assign]
    with worker.EngineWorker(engine) as w:
        assert not calls  # nothing ran yet: nothing to release
        w.complete(Request(_prompt(40, 1), SamplingParams(max_tokens=6)))
        assert released.wait(120)
        assert w.call(lambda e: mx.get_cache_memory()) == 0
        assert w.call(lambda e: len(calls)) == 1
    assert calls == [False]


def test_what_the_cache_keeps_holds_no_lane_arrays(tiny: LoadedModel, tmp_path: Path) -> None:
    """Kept blocks and tails are evaluated copies: once a lane's layers are gone, their
    arrays are freed (a lazy cut would keep every array it reads alive: after a batched
    decode, all rows' KV)."""
    import gc

    from mlxcache.types import KVLayer

    config = CacheConfig(block_size=4, directory=tmp_path, disk_bytes=0)
    cache = PromptCache(tiny.model, tiny.key, config)
    tokens = np.asarray(_prompt(202, 3), dtype=np.int32)
    lease = cache.restore(tokens)  # a miss: fresh layers
    layers = lease.layers
    tiny.model(mx.array(tokens[None]), cache=layers)
    mx.eval([c.state for c in layers])
    lease.keep(tokens[:200])
    lease.keep_tail(tokens, None)
    lease.release()
    del lease
    held = sum(c.keys.nbytes + c.values.nbytes for c in cast(list[KVLayer], layers))
    gc.collect()  # earlier tests' garbage must not be what frees the bytes counted below
    before = mx.get_active_memory()
    del layers
    gc.collect()
    assert before - mx.get_active_memory() >= held

"""Resumed == fresh, bit for bit: tokens, last-prompt-token logits and the forward schedule."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from shapemodel import checkpointed
from spy import Spy, spied

from mlxcache.cache.index import Entry
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.events import Done, Result
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams

B = 4
GREEDY = SamplingParams(max_tokens=6)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def engine_pair(
    loaded: LoadedModel, tmp_path: Path, **cfg: object
) -> tuple[Engine, Spy, Engine, Spy]:
    """A cached engine and a cache-less reference engine, each with its own spy."""
    config = CacheConfig(block_size=B, directory=tmp_path, **cfg)  # type: ignore[arg-type]
    cached, spy = spied(loaded)
    fresh, fresh_spy = spied(loaded)
    root = tmp_path / "kv" if config.disk_bytes else None
    return (
        Engine(cached, PromptCache(cached.model, cached.key, config, root=root)),
        spy,
        Engine(fresh, block_size=B),
        fresh_spy,
    )


def check_same(warm: Result, warm_spy: Spy, cold: Result, cold_spy: Spy, n_prompt: int) -> None:
    """Same tokens and bytes; the warm run made exactly the cold run's calls from its resume
    point (a whole prompt resumed: its decode steps; tests/guarantees.py checks its logits)."""
    assert warm.tokens == cold.tokens and warm.text == cold.text
    start = warm.stats.cached_tokens
    assert (start % B == 0 and start < n_prompt) or start == n_prompt
    assert warm_spy.calls == [c for c in cold_spy.calls if c[0] >= start]
    if start == n_prompt:
        return
    final = next(i for i, (s, n) in enumerate(warm_spy.calls) if s + n == n_prompt)
    final_cold = next(i for i, (s, n) in enumerate(cold_spy.calls) if s + n == n_prompt)
    assert mx.array_equal(warm_spy.last_logits[final], cold_spy.last_logits[final_cold])


def run(engine: Engine, spy: Spy, tokens: list[int], params: SamplingParams = GREEDY) -> Result:
    spy.reset()
    return engine.complete(Request(tokens, params))


def test_warm_in_memory_equals_fresh(tiny: LoadedModel, tmp_path: Path) -> None:
    cached, spy, fresh, fspy = engine_pair(tiny, tmp_path, disk_bytes=0)
    p = prompt(23)
    first = run(cached, spy, p)
    assert first.stats.cached_tokens == 0
    warm = run(cached, spy, [*p, 7])  # extends p: resumes at p's last full block
    cold = run(fresh, fspy, [*p, 7])
    assert warm.stats.cached_tokens == 20  # floor(min(24, 23) / 4) * 4
    assert spy.calls[:2] == [(20, 4), (24, 1)]
    check_same(warm, spy, cold, fspy, 24)
    again = run(cached, spy, p)  # the same prompt: resumes whole, nothing to prefill
    assert again.stats.cached_tokens == 23 and again.stats.prefilled_tokens == 0
    assert spy.calls[0] == (23, 1)  # the first call is the first decode step
    assert first.tokens == again.tokens == run(fresh, fspy, p).tokens


def test_corrupt_block_is_dropped_and_counted(tiny: LoadedModel, tmp_path: Path) -> None:
    cached, spy, fresh, fspy = engine_pair(tiny, tmp_path)
    p = prompt(18)
    run(cached, spy, p)
    files = sorted((tmp_path / "kv" / "files").glob("*.safetensors"))
    assert len(files) == 4
    files[1].write_bytes(files[1].read_bytes()[:-7])  # truncated
    reopened, spy2, _, _ = engine_pair(tiny, tmp_path)
    warm = run(reopened, spy2, p)
    report = reopened.cache.report()
    assert report["dropped_corrupt"] == 1 and warm.stats.cached_tokens == 0
    assert warm.tokens == run(fresh, fspy, p).tokens
    # The entry is gone for good; the re-prefilled prompt was kept again, intact.
    again, spy3, _, _ = engine_pair(tiny, tmp_path)
    assert run(again, spy3, p).stats.cached_tokens == 16


def test_disk_failure_warns_and_generation_goes_on(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcache.cache.disk import DiskTier

    def full(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write_file", full)
    warnings: list[str] = []
    config = CacheConfig(block_size=B, directory=tmp_path)
    engine = Engine(
        tiny, PromptCache(tiny.model, tiny.key, config, tmp_path / "kv", warnings.append)
    )
    p = prompt(10)
    engine.complete(Request(p, GREEDY))
    assert warnings == ["disk cache disabled: [Errno 28] No space left on device"]
    assert engine.complete(Request(p, GREEDY)).stats.cached_tokens == 10  # memory still works

    (tmp_path / "blocked").write_text("a file where the cache directory should be")
    warnings.clear()
    PromptCache(tiny.model, tiny.key, config, tmp_path / "blocked" / "kv", warnings.append)
    assert len(warnings) == 1 and warnings[0].startswith(
        "disk cache disabled: cannot open the disk cache"
    )


def test_memory_budget_evicts_by_policy(tiny: LoadedModel, tmp_path: Path) -> None:
    config = CacheConfig(block_size=B, disk_bytes=0, mem_bytes=1)
    loaded, _spy = spied(tiny)
    cache = PromptCache(loaded.model, loaded.key, config)
    engine = Engine(loaded, cache)
    engine.complete(Request(prompt(10), GREEDY))
    # Over budget right after the keep: the new entry is evicted once its request ends.
    assert cache.report()["mem_entries"] == 0 and cache.report()["mem_bytes"] == 0
    assert cache.report()["evictions_mem"] == 1


def test_sliding_window_model_resumes_block_by_block(
    sliding: LoadedModel, tiny: LoadedModel, tmp_path: Path
) -> None:
    """Ring-buffer layers are kept block by block: a fork inside an earlier prompt resumes
    at its last common block, past the window (8) too, and a block costs what the plain
    model's does (no padding)."""
    cached, spy, fresh, fspy = engine_pair(sliding, tmp_path)
    assert cached.cache.trimmable
    p = prompt(22)
    run(cached, spy, p)
    again = run(cached, spy, p)
    assert again.stats.cached_tokens == 22  # the same prompt: its tail too
    check_same(again, spy, run(fresh, fspy, p), fspy, 22)
    fork = p[:13] + prompt(8, seed=4)
    forked = run(cached, spy, fork)
    assert forked.stats.cached_tokens == 12
    check_same(forked, spy, run(fresh, fspy, fork), fspy, len(fork))
    report = cached.cache.report()
    plain, *_ = engine_pair(tiny, tmp_path / "plain")
    plain.complete(Request(p, GREEDY))
    assert report["kv_bytes_per_token"] == plain.cache.report()["kv_bytes_per_token"] == 512
    # From disk, in a new cache.
    reopened, spy2, _, _ = engine_pair(sliding, tmp_path)
    longer = p + prompt(5, seed=6)
    warm = run(reopened, spy2, longer)
    assert warm.stats.cached_tokens == 20
    check_same(warm, spy2, run(fresh, fspy, longer), fspy, len(longer))


def test_checkpoint_model(tiny: LoadedModel, tmp_path: Path) -> None:
    """A cache kind with no block layout is kept as one whole-state checkpoint per prompt."""
    model = checkpointed(tiny)
    cached, spy, fresh, fspy = engine_pair(model, tmp_path)
    assert not cached.cache.trimmable
    p = prompt(22)
    run(cached, spy, p)
    warm = run(cached, spy, p)
    cold = run(fresh, fspy, p)
    assert warm.stats.cached_tokens == 20  # checkpoint at the last boundary before the end
    check_same(warm, spy, cold, fspy, 22)
    # A fork inside the checkpoint cannot rewind it: a miss, still exact.
    fork = p[:9] + prompt(8, seed=4)
    forked = run(cached, spy, fork)
    assert forked.stats.cached_tokens == 0
    assert forked.tokens == run(fresh, fspy, fork).tokens
    # From disk, in a new cache.
    reopened, spy2, _, _ = engine_pair(model, tmp_path)
    longer = p + prompt(5, seed=6)
    warm = run(reopened, spy2, longer)
    assert warm.stats.cached_tokens == 20
    check_same(warm, spy2, run(fresh, fspy, longer), fspy, len(longer))


def test_processor_path_decodes_the_same_tokens(tiny: LoadedModel) -> None:
    engine = Engine(tiny, block_size=B)
    seen: list[int] = []

    def identity(tokens: mx.array, logits: mx.array) -> mx.array:
        seen.append(tokens.size)
        return logits

    p, sampled = prompt(9), SamplingParams(temperature=0.7, seed=2, max_tokens=7)
    plain = engine.complete(Request(p, sampled))
    processed = engine.complete(Request(p, sampled, [identity]))
    assert processed.tokens == plain.tokens
    # First call: the prompt; then one more token each step (the one just sampled).
    assert seen == list(range(9, 9 + len(plain.tokens)))


def test_a_failing_lane_fails_alone(tiny: LoadedModel) -> None:
    from mlxcache.errors import GenerationError

    engine = Engine(tiny, block_size=B)

    def broken(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.size > 12:
            raise GenerationError("grammar says no")
        return logits

    good = engine.complete(Request(prompt(8, 1), GREEDY))
    ids = [
        engine.submit(Request(prompt(10, 2), GREEDY, [broken])),
        engine.submit(Request(prompt(8, 1), GREEDY)),
    ]
    done = {e.request_id: e.result for e in engine.run() if isinstance(e, Done)}
    assert done[ids[0]].finish_reason == "error" and done[ids[0]].error == "grammar says no"
    assert done[ids[1]].tokens == good.tokens
    with pytest.raises(GenerationError, match="grammar says no"):
        engine.complete(Request(prompt(10, 2), GREEDY, [broken]))
    assert engine.lanes() == []


def test_store_eviction_order_follows_the_policy(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact eviction order of the memory tier: 512 bytes of KV per token, entries of two
    4-token blocks, and a budget that holds two entries plus one 9-token prompt's prefill
    (reserved before it runs)."""
    cache = PromptCache(
        tiny.model, tiny.key, CacheConfig(block_size=4, disk_bytes=0, mem_bytes=10_000)
    )
    engine = Engine(tiny, cache)
    evicted: list[tuple[int, ...]] = []
    remove = cache.mem.index.remove

    def spy(e: Entry) -> None:
        evicted.append(tuple(int(t) for t in e.tokens))
        remove(e)

    monkeypatch.setattr(cache.mem.index, "remove", spy)
    one = SamplingParams(max_tokens=1)
    a, b, c, f = prompt(9, 1), prompt(9, 2), prompt(9, 3), prompt(9, 5)
    for p in (a, b):
        engine.complete(Request(p, one))
    assert engine.complete(Request(a, one)).stats.cached_tokens == 8  # a is used again
    engine.complete(Request(c, one))
    assert evicted == [tuple(b[:8])]  # the least recently used, to make room for c's prefill
    e = a[:8] + prompt(5, 4)  # resumes from a (pinned while it runs), then extends it
    assert engine.complete(Request(e, one)).stats.cached_tokens == 8
    assert evicted[1:] == [tuple(c[:8])]
    assert sorted(len(x.tokens) for x in cache.mem) == [8, 12]
    # e shares a's two blocks, and its tail is remembered: one token past its last full
    # block and its last logits (the tiny model's 262 float32s). Tails go first when short.
    tail = 512 + 262 * 4
    assert cache.report()["mem_bytes"] == 12 * 512 + tail
    assert cache.report()["mem_tails"] == 1
    engine.complete(Request(f, one))
    # a is extended by e: it goes first, though that frees no shared block; then e.
    assert evicted[2:] == [tuple(a[:8]), tuple(e[:12])]
    assert [len(x.tokens) for x in cache.mem] == [8]
    assert cache.report()["mem_bytes"] == 8 * 512 + tail  # f's tail (e's went with e)

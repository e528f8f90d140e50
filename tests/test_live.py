"""The next turn continues from the layers the last reply left (`cache/live.py`): no
block restored or joined, rewound where the turn leaves the conversation, the cache's
canonical blocks kept all the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcache.cache.base import NoCache
from mlxcache.cache.memory import MemoryTier
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="decode KV measured canonical on MLX's CPU backend"
)
PROMPT = [40, 3, 99, 17, 250, 8]
PARAMS = SamplingParams(max_tokens=7)
ENDLESS = frozenset[int]()


def _joins(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths restored by joining kept blocks, as they happen."""
    joined: list[int] = []
    original = MemoryTier._layers

    def spied(self: MemoryTier, entry: Any, length: int) -> Any:
        joined.append(length)
        return original(self, entry, length)

    monkeypatch.setattr(MemoryTier, "_layers", spied)
    return joined


def _cache(tiny: LoadedModel, tmp_path: Path) -> PromptCache:
    return PromptCache(tiny.model, tiny.key, CacheConfig(block_size=4), root=tmp_path / "kv")


def test_turns_continue_from_the_reply_layers_without_a_restore(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(tiny, _cache(tiny, tmp_path), decode_matches_prefill=True)
    cold = Engine(tiny, NoCache(tiny.model, 4))
    joined = _joins(monkeypatch)
    first = engine.complete(Request(PROMPT, PARAMS, stop_tokens=ENDLESS))
    conversation = [*PROMPT, *first.tokens]  # 13 tokens: mid-block
    for turn in range(2):
        follow = Request([*conversation, 11, 12 + turn], PARAMS, stop_tokens=ENDLESS)
        got = engine.complete(follow)
        assert got.stats.cached_tokens == len(conversation)
        assert got.tokens == cold.complete(follow).tokens
        conversation = [*follow.tokens, *got.tokens]
    # An edited turn leaves the conversation mid-block: the layers are rewound there.
    edited = Request([*conversation[:10], 5, 6, 7], PARAMS, stop_tokens=ENDLESS)
    got = engine.complete(edited)
    assert got.stats.cached_tokens == 10
    assert got.tokens == cold.complete(edited).tokens
    assert joined == [], f"blocks joined for {joined}"
    # The canonical blocks are kept all the same: a new process resumes them from disk.
    again = _cache(tiny, tmp_path)
    assert again.cached_length(np.array(conversation)) == len(conversation) // 4 * 4


def test_without_the_probe_the_reply_layers_are_not_held(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(tiny, _cache(tiny, tmp_path))
    first = engine.complete(Request(PROMPT, PARAMS, stop_tokens=ENDLESS))
    follow = Request([*PROMPT, *first.tokens, 11, 12], PARAMS, stop_tokens=ENDLESS)
    joined = _joins(monkeypatch)
    got = engine.complete(follow)
    assert got.stats.cached_tokens == 4 and joined == [4]


def test_memory_shed_drops_the_live_layers_first(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They sit outside the budget: a shed (the memory limit's admission) lets them go;
    the next turn then restores the kept blocks and the reply's tail, as exactly."""
    cache = _cache(tiny, tmp_path)
    engine = Engine(tiny, cache, decode_matches_prefill=True)
    first = engine.complete(Request(PROMPT, PARAMS, stop_tokens=ENDLESS))
    follow = Request([*PROMPT, *first.tokens, 11, 12], PARAMS, stop_tokens=ENDLESS)
    cache.shed(0)
    joined = _joins(monkeypatch)
    got = engine.complete(follow)
    assert joined == [12] and got.stats.cached_tokens == len(PROMPT) + len(first.tokens)
    assert got.tokens == Engine(tiny, NoCache(tiny.model, 4)).complete(follow).tokens

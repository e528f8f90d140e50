"""The next turn continues from the layers the last reply left (`cache/live.py`): no
block restored or joined, rewound where the turn leaves the conversation, the cache's
canonical blocks kept all the same."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from tinymodel import write_sliding

from mlxcache import membudget
from mlxcache.cache.base import Lease, NoCache
from mlxcache.cache.live import UNBOUNDED, Live, whole_until
from mlxcache.cache.memory import MemoryTier
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.decode_batch import DecodeBatch
from mlxcache.engine import Engine, Request
from mlxcache.membudget import Footprint, MemoryBudget
from mlxcache.model import LoadedModel, load
from mlxcache.ring import TimeRing
from mlxcache.sampling import SamplingParams
from mlxcache.types import new_layers

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


def test_warm_ahead_leaves_the_live_layers_that_hold_its_prefix_whole(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-ahead of a next turn's prefix whose full blocks the live layers already hold
    (they end inside the reply) has nothing to compute: it leaves them as they are, and
    the next turn resumes the whole reply from them (it used to cut them back to its
    prefix, and the turn resumed there, re-prefilling the reply's last partial block)."""
    engine = Engine(tiny, _cache(tiny, tmp_path), decode_matches_prefill=True)
    first = engine.complete(Request(PROMPT[:4], PARAMS, stop_tokens=ENDLESS))
    conversation = [*PROMPT[:4], *first.tokens]  # 11 tokens: blocks to 8, then 3
    engine.warm(conversation)  # its full blocks: 8 tokens
    list(engine.run(warm=True))
    joined = _joins(monkeypatch)
    got = engine.complete(Request([*conversation, 11, 12], PARAMS, stop_tokens=ENDLESS))
    assert got.stats.cached_tokens == len(conversation) and joined == []


WINDOW = 24


@pytest.fixture(scope="module")
def windowed(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny model with a sliding-window first layer `WINDOW` wide (a `TimeRing`)."""
    folder = tmp_path_factory.mktemp("windowed") / "model"
    return load(str(write_sliding(tiny.path, folder, window=WINDOW)))


def _conversation(
    engine: Engine, cold: Engine, turns: int, first: list[int] = PROMPT
) -> tuple[list[int], list[int]]:
    """`turns` turns of two new tokens each after a first prompt, every reply checked
    against `cold`'s; returns the conversation and each turn's cached tokens."""
    got = engine.complete(Request(first, PARAMS, stop_tokens=ENDLESS))
    assert got.tokens == cold.complete(Request(first, PARAMS, stop_tokens=ENDLESS)).tokens
    conversation, cached = [*first, *got.tokens], []
    for turn in range(turns):
        follow = Request([*conversation, 11, 12 + turn], PARAMS, stop_tokens=ENDLESS)
        got = engine.complete(follow)
        assert got.tokens == cold.complete(follow).tokens, f"turn {turn + 2}"
        cached.append(got.stats.cached_tokens)
        conversation = [*follow.tokens, *got.tokens]
    return conversation, cached


def test_a_sliding_window_continues_from_its_ring_inside_the_window(
    windowed: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ring that has dropped no position is rewound like plain KV: inside the window
    the turns continue from the reply's layers (nothing joined), merged chunks and all,
    and each reply is the cold run's; the canonical blocks are kept all the same."""
    engine = Engine(windowed, _cache(windowed, tmp_path), decode_matches_prefill=True)
    cold = Engine(windowed, NoCache(windowed.model, 4))
    joined = _joins(monkeypatch)
    first = [*PROMPT, *range(30, 38)]  # 14 tokens: one merged chunk of three blocks and more
    conversation, cached = _conversation(engine, cold, 1, first)  # 14 + 7, 2 + 7 tokens
    assert cached == [21] and joined == []
    # The canonical blocks are kept all the same, the merged chunk's each: a new process
    # resumes them from disk.
    again = _cache(windowed, tmp_path)
    assert again.cached_length(np.array(conversation)) == 28


def test_past_its_window_a_ring_resumes_from_the_kept_blocks(
    windowed: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a turn would continue past the window (the ring drops positions there), the
    next one restores the kept blocks and the reply's tail, and stays the cold run's."""
    engine = Engine(windowed, _cache(windowed, tmp_path), decode_matches_prefill=True)
    cold = Engine(windowed, NoCache(windowed.model, 4))
    joined = _joins(monkeypatch)
    conversation, cached = _conversation(engine, cold, 3)
    assert len(conversation) == 40 and cached == [13, 22, 31]
    assert joined == [28], "the third turn (from 31 > 23 tokens) restores its blocks"
    # An edited turn inside the window: the ring past it has dropped positions.
    edited = Request([*conversation[:10], 5, 6, 7], PARAMS, stop_tokens=ENDLESS)
    got = engine.complete(edited)
    assert got.stats.cached_tokens == 10 and joined == [28, 8]
    assert got.tokens == cold.complete(edited).tokens


def test_which_layers_can_be_rewound_and_how_far(tiny: LoadedModel) -> None:
    """Plain KV without bound; a ring up to its size less one, until it drops a position;
    the held layers are refused once they cannot be rewound."""
    assert whole_until(new_layers(tiny.model)) == UNBOUNDED
    ring = TimeRing(max_size=6)
    layers = [*new_layers(tiny.model)[:1], ring]
    assert whole_until(layers) == 5
    keys = mx.zeros((1, 1, 4, 2))
    ring.update_and_fetch(keys, keys)
    ring.update_and_fetch(keys, keys)  # 8 positions, none dropped: rewinds up to 5
    assert whole_until(layers) == 5
    live = Live.hold(np.arange(8), layers)
    assert live is not None
    assert live.reach(np.arange(8), 5) == 5 and live.reach(np.arange(8), 6) == 0
    ring.update_and_fetch(keys[..., :1, :], keys[..., :1, :])  # drops 3 positions
    assert whole_until(layers) == 0 and Live.hold(np.arange(9), layers) is None


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


def test_the_live_layers_count_as_freeable_and_go_when_room_is_needed(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation's live KV is part of what the process holds, and dropping it gives
    it back: a request that fits once it is dropped is admitted (no 429), the live layers
    dropped for it and the memory tier kept."""
    cache = _cache(tiny, tmp_path)
    Engine(tiny, cache, decode_matches_prefill=True).complete(
        Request(PROMPT, PARAMS, stop_tokens=ENDLESS)
    )
    assert cache._live is not None
    live, tier = cache._live.nbytes, cache.mem.nbytes
    assert live > 0 and cache.held() == tier + live
    mx.clear_cache()  # MLX's pool (freeable too) is empty: the cache's bytes alone count
    budget = MemoryBudget(1 << 30, 1 << 20, Footprint.of(tiny.model, tiny.config), 4)
    budget.reserved[(0, 99)] = running = 1 << 20  # another request runs
    request = Request([*PROMPT, 7], PARAMS)
    need = budget.need(len(request.tokens), PARAMS.max_tokens)
    resident = [budget.limit - running - need + live]  # over by exactly the live bytes
    monkeypatch.setattr(membudget, "resident_bytes", lambda: resident[0])
    shed = cache.shed

    def giving_back(n: int) -> int:
        freed = shed(n)
        resident[0] -= freed
        return freed

    monkeypatch.setattr(cache, "shed", giving_back)
    budget.check(request, cache)  # no MemoryBusyError
    assert budget.admit(1, len(request.tokens), PARAMS.max_tokens, cache)
    assert cache._live is None and cache.mem.nbytes == tier


def _left_a_batch(tiny: LoadedModel, cache: PromptCache) -> None:
    """Three rows decode a step as a batch; the middle one leaves and is held live."""
    rows = [new_layers(tiny.model) for _ in range(3)]
    batch = DecodeBatch()
    for r, layers in enumerate(rows):
        tiny.model(mx.array([[*PROMPT[: 2 + r], 9]]), cache=layers)
        batch.join(r, layers, mx.array([5]))
    mx.eval(batch.forward(tiny.model))
    batch.leave(1, rows[1])  # its 4 tokens and the step's
    cache.keep_live(np.array([*PROMPT[:3], 9, 5]), Lease(cache, rows[1], 5))


def test_live_layers_out_of_a_batched_decode_hold_their_row_alone(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """A row leaving a batched decode gets lazy copies of the batch's arrays; held as the
    live layers they are evaluated, so the batch's arrays (every row's KV) are freed."""
    cache = _cache(tiny, tmp_path)
    _left_a_batch(tiny, cache)  # MLX's first use of these shapes allocates for good
    cache.shed(0)
    gc.collect()
    before = mx.get_active_memory()
    _left_a_batch(tiny, cache)
    gc.collect()
    assert cache._live is not None
    own = cache._live.nbytes
    assert own == sum(2 * c.keys.nbytes for c in cache._live.layers) > 0
    # The row's own bytes (and MLX's small bookkeeping): the batch's arrays, three padded
    # rows of KV, would hold more than twice as much.
    assert own <= mx.get_active_memory() - before < 2 * own

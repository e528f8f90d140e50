"""A memory budget for the process (`--mem-limit`): what it holds stays under a limit.

The process holds the model, the prompt cache's memory tier, the running requests' own
KV and staging, and MLX's pool of freed buffers; all of it is resident memory, so the
budget is measured as such (`resident_bytes`). Before a request starts, its growth is
estimated (`Footprint`: its prompt's and reply's KV at the model's measured bytes per
token, and one prefill chunk's activations); if what the process holds plus that growth
(plus what running requests reserved) would pass the limit, room is made: MLX's buffer
pool first, then the memory tier's entries in its eviction order (with a disk tier they
stay resumable from disk). A request that still does not fit waits, before any forward,
for running requests to end (the server refuses it up front instead, `MemoryBusyError`:
429, retry later), and one that cannot fit even alone is refused (`MemoryLimitError`).

The estimate is an upper bound on a request's own memory (KV capacity is counted in
mlx-lm's allocation steps, every prefill row's logits are counted), so a budget that
admits a request is not passed by it; the process's own baseline (Python, the tokenizer)
is measured, not estimated.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import mlx.core as mx
import psutil
from mlx_lm.models.cache import RotatingKVCache

from mlxcache.cache.base import PrefixCache
from mlxcache.config import CacheConfig, human_bytes
from mlxcache.errors import MemoryBusyError, MemoryLimitError, Setting, Worded
from mlxcache.model import LoadedModel
from mlxcache.prefill import MERGED_BLOCKS
from mlxcache.sysmem import release_unused
from mlxcache.types import Model, as_module, new_layers

if TYPE_CHECKING:
    from mlxcache.request import Request

COPIES = 4
"""A prompt's KV exists up to this many more times while its request runs: the copy
restored from the cache, the blocks staged as its prefill completes them, the copy the
memory tier keeps, and room for the rest (measured on SmolLM2: a request's peak resident
growth beyond its own caches is 3.3-3.6 times its prompt's KV)."""

POOL_SHARE = 8
"""MLX's buffer pool is kept to an eighth of the budget (its default: the device's memory)."""

_PROCESS = psutil.Process()


def resident_bytes() -> int:
    """The process's resident memory, or MLX's own if that is larger (Metal's buffers on a
    Mac are not all counted as resident)."""
    return max(_PROCESS.memory_info().rss, mx.get_active_memory() + mx.get_cache_memory())


T = TypeVar("T")


def peak_during(fn: Callable[[], T], every: float = 0.005) -> tuple[T, int]:
    """`fn()`, and the most the process's resident memory rose above its start while it
    ran (sampled every `every` seconds on a thread of its own, and at its end): a model's
    load passes what it then holds (its tokenizer's parse, `model.tokenizer`)."""
    start = _PROCESS.memory_info().rss
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every):
            peak[0] = max(peak[0], _PROCESS.memory_info().rss)

    sampler = threading.Thread(target=sample, name="mlxcache-load-peak", daemon=True)
    sampler.start()
    try:
        result = fn()
    finally:
        done.set()
        sampler.join()
    return result, max(peak[0], _PROCESS.memory_info().rss) - start


@dataclass(frozen=True, slots=True)
class _Layer:
    per_token: int  # bytes each position adds (0: a recurrent state)
    fixed: int  # bytes whatever the length
    cap: int | None  # positions kept at most (a sliding window), None: all
    step: int  # positions allocated at a time


def _nbytes(state: Any) -> int:
    if isinstance(state, mx.array):
        return state.nbytes
    return sum(_nbytes(s) for s in state) if isinstance(state, list | tuple) else 0


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a request of a given length adds to the process's memory, for one model."""

    layers: tuple[_Layer, ...]
    row_bytes: int  # one prefill row's activations, without attention scores
    heads: int

    @classmethod
    def of(cls, model: Model, config: dict[str, Any]) -> Footprint:
        """Measured on the model's own caches after a one-token forward (a position's bytes,
        or what a recurrent layer holds whatever the length), activations from its config."""
        caches = new_layers(model)
        model(mx.array([[1]]), cache=caches)
        mx.eval([c.state for c in caches])
        layers = []
        for c in caches:
            size = _nbytes(c.state)
            keys = getattr(c, "keys", None)
            if keys is None:  # a recurrent state: one size
                layers.append(_Layer(0, size, None, 1))
                continue
            first = keys[0] if isinstance(keys, tuple) else keys  # quantized: a triple
            per = size // max(int(first.shape[-2]), 1)  # over what is allocated
            cap = int(c.max_size) if isinstance(c, RotatingKVCache) else None
            layers.append(_Layer(per, 0, cap, max(int(getattr(c, "step", 1) or 1), 1)))
        text = config.get("text_config") or config
        words = sum(int(text.get(k) or 0) for k in ("vocab_size", "hidden_size"))
        words += 3 * int(text.get("intermediate_size") or 0) + 3 * int(text.get("hidden_size") or 0)
        heads = int(text.get("num_attention_heads") or 0)
        return cls(tuple(layers), 4 * words, heads)

    def kv(self, tokens: int, allocated: bool = True) -> int:
        """The bytes a request's caches hold at `tokens` positions (`allocated`: as mlx-lm
        allocates them, in steps; else the positions alone)."""
        total = 0
        for layer in self.layers:
            kept = tokens if layer.cap is None else min(tokens, layer.cap)
            if allocated:
                kept = -(-kept // layer.step) * layer.step
            total += layer.fixed + layer.per_token * kept
        return total

    def need(self, prompt: int, max_tokens: int, chunk: int) -> int:
        """A request's most: its caches at the end of its reply, its prompt's KV `COPIES`
        times more, and a prefill chunk's activations at the end of the prompt (attention
        scores as float32)."""
        rows = min(chunk, prompt)
        copies = COPIES * self.kv(prompt, allocated=False)
        return (
            self.kv(prompt + max_tokens)
            + copies
            + rows * (self.row_bytes + 4 * self.heads * prompt)
        )


@dataclass(slots=True)
class MemoryBudget:
    """The process's memory kept under `limit` bytes (see the module's doc).

    Args:
        limit: the budget, in bytes.
        floor: what the process held once the model was loaded (its least).
        footprint: the model's `Footprint`.
        chunk: the widest prefill chunk (merged: `prefill.MERGED_BLOCKS` blocks).
        reserved: what running requests reserved, by (budget, request id): one dict shared
            by the budgets of several models in one process (`fleet`), so each admits
            beside the others' requests.
    """

    limit: int
    floor: int
    footprint: Footprint
    chunk: int
    reserved: dict[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        mx.set_cache_limit(self.limit // POOL_SHARE)

    def need(self, prompt: int, max_tokens: int) -> int:
        return self.footprint.need(prompt, max_tokens, self.chunk)

    def check(self, request: Request, cache: PrefixCache, now: bool = True) -> None:
        """Refuse a request that would not fit even alone in the process as it was with
        only the model loaded (`MemoryLimitError`) or, `now`, beside the running requests'
        room once what `cache` holds in memory and MLX's pool are given back
        (`MemoryBusyError`). Reads only: any thread."""
        need = self.need(len(request.tokens), request.sampling.max_tokens)
        if self.floor + need > self.limit:
            raise self._too_big(need)
        others = sum(list(self.reserved.values()))  # list(): one call, safe across threads
        freeable = cache.held() + mx.get_cache_memory()
        if now and others and resident_bytes() - freeable + need + others > self.limit:
            raise MemoryBusyError(
                "the memory budget is held by running requests: retry when they end "
                f"(this one needs about {human_bytes(need)})"
            )

    def admit(self, rid: int, prompt: int, max_tokens: int, cache: PrefixCache) -> bool:
        """Make room for request `rid` before its first forward (from what `cache` holds in
        memory, and MLX's pool) and reserve its estimate until `release`; False when it
        must wait for running requests to end. While others run, the memory tier is shed
        only when that and the pool can make the room: else the wait is for them, and the
        tier keeps what it holds (a request waiting its turn polls again and again).

        Raises:
            MemoryLimitError: no request runs, and it still does not fit.
        """
        need = self.need(prompt, max_tokens)
        others = sum(v for r, v in list(self.reserved.items()) if r != (id(self), rid))

        def over() -> int:
            return resident_bytes() + need + others - self.limit

        excess = over()
        if excess > 0 and (not others or excess <= cache.held() + mx.get_cache_memory()):
            cache.shed(excess)
            release_unused()
        if over() <= 0:
            self.reserved[(id(self), rid)] = need
            return True
        if others:
            return False
        raise self._too_big(need)

    def release(self, rid: int) -> None:
        """Request `rid` ended: its room is free."""
        self.reserved.pop((id(self), rid), None)

    def _too_big(self, need: int) -> MemoryLimitError:
        left = max(self.limit - self.floor, 0)
        return MemoryLimitError(
            Worded(
                f"this request needs about {human_bytes(need)} of memory, and ",
                Setting("mem_limit", "the memory limit"),
                f" {human_bytes(self.limit)} leaves {human_bytes(left)} beside the model: "
                "raise it, or shorten the prompt or max tokens",
            )
        )


TIER_SHARE = 2
"""Of what the budget leaves beside the loaded model, the memory tier keeps at most half
(the rest: running requests, staging, MLX's pool)."""


def budgeted(loaded: LoadedModel, config: CacheConfig) -> tuple[CacheConfig, MemoryBudget]:
    """The budget of `config.mem_limit` for `loaded` (loaded now), and `config` with its
    memory tier fitted inside it.

    Raises:
        MemoryLimitError: the limit is below what the process already holds.
    """
    mx.eval(as_module(loaded.model).parameters())  # the weights count: read them now
    held = resident_bytes()
    if held >= config.mem_limit:
        raise MemoryLimitError(
            Worded(
                Setting("mem_limit", "the memory limit"),
                f" {human_bytes(config.mem_limit)} is below what the process holds with the "
                f"model loaded ({human_bytes(held)})",
            )
        )
    tier = min(config.mem_bytes, (config.mem_limit - held) // TIER_SHARE)
    footprint = Footprint.of(loaded.model, loaded.config)
    budget = MemoryBudget(config.mem_limit, held, footprint, widest_chunk(config.block_size))
    return replace(config, mem_bytes=tier), budget


def widest_chunk(block_size: int) -> int:
    """The widest prefill chunk a request's room must hold: `MERGED_BLOCKS` blocks, where
    the probe allows merging them."""
    return MERGED_BLOCKS * block_size

"""The contract between the engine and a prefix cache, its counters, and the cache that keeps
nothing."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mlxcache.types import Layers, Model, new_layers


@dataclass(slots=True)
class CacheStats:
    """Counters since the cache was opened (see `store.PromptCache.report`)."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0
    disk_hits: int = 0
    evictions_mem: int = 0
    evictions_disk: int = 0
    dropped_corrupt: int = 0
    disk_errors: int = 0


class Keeper(Protocol):
    """What a `Lease` hands its calls to: the cache that restored it."""

    def capture(self, n: int, lease: Lease) -> None: ...

    def keep(self, tokens: np.ndarray, lease: Lease) -> None: ...

    def keep_tail(self, tokens: np.ndarray, lease: Lease, logits: Any) -> None: ...

    def keep_live(self, tokens: np.ndarray, lease: Lease) -> None: ...

    def release(self, lease: Lease) -> None: ...


class LeaseError(RuntimeError):
    """A lease used after its release, or released twice: a bug in the caller."""


@dataclass(slots=True, eq=False)
class Lease:
    """What one request holds of a prefix cache, from `PrefixCache.restore` to `release`.

    Fresh per-layer caches (`layers`) holding the first `length` prompt tokens, the entry
    they came from (pinned until the release), and what the request stages on the way to
    `keep`: the blocks it captured, which of their recurrent states are extras, and where
    its prompt left the entry it resumed from. All of it is this lease's own, dropped with
    it: nothing is keyed by anything another request could reuse. `logits` (the last
    prompt token's) come only with a whole prompt seen before: then `length` is the whole
    prompt and nothing is left to prefill. Released exactly once: `release()` or the end
    of a `with` block; a second release, or a keep after it, raises `LeaseError`.
    """

    keeper: Keeper
    layers: Layers
    length: int
    entry: Any = None
    logits: Any = None
    tier: str = ""
    """Where the resumed prefix came from: "memory", "disk", or "" (nothing resumed)."""
    branch: int | None = None
    """The last block this prompt shares with the entry it resumed from."""
    staged: dict[int, Any] = field(default_factory=dict)
    """Blocks captured (`capture`) by number, until kept."""
    extras: deque[int] = field(default_factory=deque)
    """Staged blocks whose recurrent states are extras (memory only), oldest first."""
    released: bool = False

    def capture(self, n: int) -> None:
        """The block ending at `n` is in `layers`, right after the canonical chunk or
        decode step that completed it (the last one, or one of a merged chunk's): note it
        now if only this moment shows it (sliding windows drop it later, recurrent state
        moves on); `keep` stores it."""
        self._check()
        self.keeper.capture(n, self)

    def keep(self, tokens: np.ndarray) -> None:
        """Store the first len(tokens) positions of `layers` (a whole number of blocks)."""
        self._check()
        self.keeper.keep(tokens, self)

    def keep_tail(self, tokens: np.ndarray, logits: Any) -> None:
        """Remember a whole prompt's state past its last full block, and its last logits,
        so that the same prompt again resumes with nothing to prefill. Without logits (a
        reply's decode KV): only for resuming mid-block (`restore(decode_matches_prefill=True)`)."""
        self._check()
        self.keeper.keep_tail(tokens, self, logits)

    def keep_live(self, tokens: np.ndarray) -> None:
        """Hand `layers` (holding exactly the KV of `tokens`, decode KV measured canonical)
        to the cache by reference: the next turn that follows them continues from them
        (`restore(decode_matches_prefill=True)`). The lane must not touch them afterwards."""
        self._check()
        self.keeper.keep_live(tokens, self)

    def release(self) -> None:
        """Unpin the entry and forget what was staged and not kept."""
        self._check()
        self.released = True
        self.keeper.release(self)

    def _check(self) -> None:
        if self.released:
            raise LeaseError("this lease was released already")

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.release()


class PrefixCache(Protocol):
    """What the engine needs from a prompt cache."""

    block_size: int
    trimmable: bool
    """Whether the model's state can be rewound (all plain KV layers)."""

    def restore(
        self,
        tokens: np.ndarray,
        count: bool = True,
        decode_matches_prefill: bool = False,
        whole: bool = False,
    ) -> Lease:
        """A lease on fresh layers restored to the longest reusable prefix of `tokens`;
        `count` False: warm-ahead work, left out of the hit and miss counters;
        `decode_matches_prefill` (as the device was measured: `invariance`): the prefix
        may end inside a block (the prefill then starts there); `whole`: it may be all of
        `tokens` (work that needs no logits), else it stops a token short of the end."""
        ...

    def cached_length(
        self, tokens: np.ndarray, whole: bool = False, decode_matches_prefill: bool = False
    ) -> int:
        """How many of `tokens` a restore (of these arguments) would resume now (a lookup:
        nothing is copied); without `decode_matches_prefill`, whole blocks."""
        ...

    def report(self) -> dict[str, Any]:
        """Counters and sizes, JSON-able."""
        ...

    def held(self) -> int:
        """The bytes kept in memory (what `shed` may free, but for pinned entries)."""
        ...

    def shed(self, n_bytes: int) -> int:
        """Free about `n_bytes` of what is kept in memory; returns the bytes freed."""
        ...


def with_probe(tokens: Any) -> np.ndarray:
    """`tokens` and one id past them that matches nothing: the index's lookups leave a
    prompt at least one token to prefill (for its logits), so they stop a block short of
    a prompt of whole blocks; with the probe they reach every full block of `tokens`
    (a `whole` lookup, inside the cache)."""
    return np.append(np.asarray(tokens, dtype=np.int32), np.int32(-1))


def is_trimmable(layers: Layers, block_size: int) -> bool:
    """True when the store keeps these layers block by block (plain KV, sliding-window and
    recurrent layers: `layout.Layout`), so a prompt resumes at any block boundary of a
    prefix it shares; False for other cache kinds, kept as whole-state checkpoints."""
    from mlxcache.cache.layout import Layout

    return Layout.of(layers, block_size) is not None


class NoCache:
    """Prefills every request from token 0 and keeps nothing (`--no-cache`)."""

    def __init__(self, model: Model, block_size: int) -> None:
        self._model = model
        self.block_size = block_size
        self.trimmable = is_trimmable(new_layers(model), block_size)

    def restore(
        self,
        tokens: np.ndarray,
        count: bool = True,
        decode_matches_prefill: bool = False,
        whole: bool = False,
    ) -> Lease:
        return Lease(_KEEPS_NOTHING, new_layers(self._model), 0)

    def cached_length(
        self, tokens: np.ndarray, whole: bool = False, decode_matches_prefill: bool = False
    ) -> int:
        return 0

    def report(self) -> dict[str, Any]:
        return {"pinned_entries": 0}

    def held(self) -> int:
        return 0

    def shed(self, n_bytes: int) -> int:
        return 0


class _Nothing:
    """The keeper of a cache that keeps nothing."""

    def capture(self, n: int, lease: Lease) -> None:
        return None

    def keep(self, tokens: np.ndarray, lease: Lease) -> None:
        return None

    def keep_tail(self, tokens: np.ndarray, lease: Lease, logits: Any) -> None:
        return None

    def keep_live(self, tokens: np.ndarray, lease: Lease) -> None:
        return None

    def release(self, lease: Lease) -> None:
        return None


_KEEPS_NOTHING = _Nothing()

"""The contract between the engine and a prefix cache, its counters, and the cache that keeps
nothing."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(slots=True)
class Resume:
    """Where a request starts: fresh per-layer caches holding `length` prompt tokens.

    `lease` is the cache's own handle (a pinned entry); hand it back with `release`.
    `logits` (the last prompt token's) come only with a whole prompt seen before: then
    `length` is the whole prompt and nothing is left to prefill.
    """

    layers: Layers
    length: int
    lease: Any = None
    logits: Any = None
    tier: str = ""
    """Where the resumed prefix came from: "memory", "disk", or "" (nothing resumed)."""


class PrefixCache(Protocol):
    """What the engine needs from a prompt cache."""

    block_size: int
    trimmable: bool
    """Whether the model's state can be rewound (all plain KV layers)."""

    def restore(self, tokens: np.ndarray, count: bool = True, anywhere: bool = False) -> Resume:
        """Fresh layers restored to the longest reusable prefix of `tokens` (pinned);
        `count` False: warm-ahead work, left out of the hit and miss counters; `anywhere`:
        the prefix may end inside a block (only where the device was measured
        shape-invariant: the prefill then starts there)."""
        ...

    def capture(self, tokens: np.ndarray, layers: Layers) -> None:
        """`layers` hold exactly `tokens` (whole blocks), right after the canonical chunk
        that ended them: note the last block now if only this moment shows it (sliding
        windows drop it later, recurrent state moves on). `keep` with the same layers
        stores it; `release` forgets what was not kept."""
        ...

    def keep(self, tokens: np.ndarray, layers: Layers) -> None:
        """Store the first len(tokens) positions of `layers` (a whole number of blocks)."""
        ...

    def cached_length(self, tokens: np.ndarray) -> int:
        """How many of `tokens` a restore would resume now (a lookup: nothing is copied)."""
        ...

    def keep_tail(self, tokens: np.ndarray, layers: Layers, logits: Any) -> None:
        """Remember a whole prompt's state past its last full block, and its last logits,
        so that the same prompt again resumes with nothing to prefill. Without logits (a
        reply's decode KV): only for resuming mid-block (`restore(anywhere=True)`)."""
        ...

    def release(self, resume: Resume) -> None:
        """Unpin what `restore` pinned."""
        ...

    def report(self) -> dict[str, Any]:
        """Counters and sizes, JSON-able."""
        ...


def with_probe(tokens: Any) -> np.ndarray:
    """`tokens` and one id past them that matches nothing. A lookup leaves a prompt at least
    one token to prefill (for its logits), so it stops a block short of a prompt of whole
    blocks; with the probe it reaches every full block of `tokens`."""
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

    def restore(self, tokens: np.ndarray, count: bool = True, anywhere: bool = False) -> Resume:
        return Resume(new_layers(self._model), 0)

    def capture(self, tokens: np.ndarray, layers: Layers) -> None:
        return None

    def keep(self, tokens: np.ndarray, layers: Layers) -> None:
        return None

    def cached_length(self, tokens: np.ndarray) -> int:
        return 0

    def keep_tail(self, tokens: np.ndarray, layers: Layers, logits: Any) -> None:
        return None

    def release(self, resume: Resume) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {"pinned_entries": 0}

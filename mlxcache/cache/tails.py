"""The tails the memory tier remembers: of the last few whole prompts of a trimmable model,
the state past the last full block and the last token's logits, as the prompt's own last
prefill chunk computed them (the same prompt again resumes whole, nothing to prefill); and
of finished replies where decode KV is canonical, the state alone (to resume mid-block).

A tail goes with the entry holding the full blocks it continues (`drop_of`), and tails go
first when memory is short (`drop_oldest`), the least recently used first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxcache.cache.index import Entry
from mlxcache.cache.layout import Block
from mlxcache.cache.layout import nbytes as block_nbytes

MAX_TAILS = 32
"""Whole prompts whose tails the memory tier remembers (the most recently used)."""


@dataclass(slots=True)
class Tail:
    """A whole prompt's state past its last full block, and its last logits (None for a
    reply's tail, kept only to resume mid-block: see `MemoryTier.partial`)."""

    key: str  # digest of the prompt's tokens
    base: Entry  # holds the prompt's full blocks; the tail goes with it
    kv: Block  # positions [last full block end, prompt end) (maybe none), states at the end
    logits: mx.array | None
    prefix: str  # digest of the tokens before the tail (the full blocks)
    ids: np.ndarray  # the tail's own tokens

    @property
    def nbytes(self) -> int:
        return block_nbytes(self.kv) + (0 if self.logits is None else int(self.logits.nbytes))


class Tails:
    """Remembered tails by prompt digest, the least recently used first, and their bytes."""

    def __init__(self, limit: int = MAX_TAILS) -> None:
        self._by_key: OrderedDict[str, Tail] = OrderedDict()
        self.limit = limit
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Tail]:
        return iter(list(self._by_key.values()))

    def whole(self, key: str) -> Tail | None:
        """The tail of the prompt whose digest is `key`, if it has logits (a whole prompt's)."""
        tail = self._by_key.get(key)
        return tail if tail is not None and tail.logits is not None else None

    def used(self, tail: Tail) -> None:
        self._by_key.move_to_end(tail.key)

    def add(self, tail: Tail) -> None:
        """Remember `tail` (in place of its prompt's earlier one); past `limit` the least
        recently used goes."""
        self.drop(tail.key)
        self._by_key[tail.key] = tail
        self.nbytes += tail.nbytes
        while len(self._by_key) > self.limit:
            self.drop_oldest()

    def drop(self, key: str) -> None:
        tail = self._by_key.pop(key, None)
        if tail is not None:
            self.nbytes -= tail.nbytes

    def drop_oldest(self) -> bool:
        """Forget the least recently used tail; False when there is none."""
        if not self._by_key:
            return False
        self.drop(next(iter(self._by_key)))
        return True

    def drop_of(self, entry: Entry) -> None:
        """Forget the tails continuing `entry`'s blocks (it is being evicted)."""
        for key in [k for k, tail in self._by_key.items() if tail.base is entry]:
            self.drop(key)

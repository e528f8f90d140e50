"""Requests that take their decode steps as one batch (where the device allows it exactly).

Each decoding request's caches move into one batched cache per layer when it joins (the
cache class's own `merge`: mlx-lm's left-padded `BatchKVCache` for plain KV, `ArraysCache`
rows for recurrent state, `ring.TimeBatchRing` for sliding windows kept in time order), and
back into its own caches when it leaves; every step is then one forward for all of them.
This runs only where `invariance.batch_matches_solo` measured that a row decoded in such a
batch gets bitwise the logits it gets alone (rows joining and leaving on the way included):
a reply still does not depend on who else is running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from mlxcache.ring import TimeRing
from mlxcache.types import LayerCache, Model


def batchable(layers: Sequence[LayerCache]) -> bool:
    """Whether every layer's cache has a batched form whose rows step as they would alone:
    plain KV, recurrent state, sliding windows kept in time order (`ring.TimeBatchRing`;
    without kept first positions, which mlx-lm's batched ring has no room for)."""
    return all(
        type(c) is KVCache or isinstance(c, ArraysCache) or (type(c) is TimeRing and c.keep == 0)
        for c in layers
    )


class DecodeBatch:
    """The rows (request ids) decoding together, their caches and their next inputs."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self._inputs: dict[int, mx.array] = {}
        self._cache: list[Any] = []

    def __contains__(self, rid: object) -> bool:
        return rid in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rid: int, layers: Sequence[LayerCache], y: mx.array) -> None:
        """Add a request whose caches are `layers` and whose next input token is `y`."""
        merged = [type(c).merge([c]) for c in layers]  # type: ignore[attr-defined]
        if not self.rows:
            self._cache = merged
        else:
            for batch, one in zip(self._cache, merged, strict=True):
                batch.extend(one)
        self.rows.append(rid)
        self._inputs[rid] = y

    def forward(self, model: Model) -> mx.array:
        """One decode step for every row: logits (rows, vocab), in `rows` order."""
        y = mx.concatenate([self._inputs.pop(rid).reshape(1, 1) for rid in self.rows])
        return model(y, cache=self._cache)[:, -1, :]

    def wait(self, rid: int, y: mx.array) -> None:
        """A row's next input token."""
        self._inputs[rid] = y

    def sync(self, rid: int, layers: Sequence[LayerCache]) -> None:
        """Copy the row's caches out of the batch into its own `layers` (it stays in it)."""
        self._copy_out(rid, layers)

    def leave(self, rid: int, layers: Sequence[LayerCache]) -> None:
        """Put the row's caches back into its own `layers`, and drop it."""
        self._copy_out(rid, layers)
        self.drop(rid)

    def _copy_out(self, rid: int, layers: Sequence[LayerCache]) -> None:
        i = self.rows.index(rid)
        for batch, own in zip(self._cache, layers, strict=True):
            own.state = batch.extract(i).state

    def drop(self, rid: int) -> None:
        """Forget a row (cancelled, failed or left)."""
        i = self.rows.index(rid)
        del self.rows[i]
        self._inputs.pop(rid, None)
        if not self.rows:
            self._cache = []
            return
        keep = [j for j in range(len(self.rows) + 1) if j != i]
        for batch in self._cache:
            batch.filter(keep)

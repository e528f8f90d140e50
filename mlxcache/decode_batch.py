"""Requests that take their decode steps as one batch (where the device allows it exactly).

Each decoding request's KV moves into one left-padded mlx-lm `BatchKVCache` per layer
when it joins, and back into its own caches when it leaves; every step is then one
forward for all of them. This runs only where `invariance.batch_matches_solo` measured
that a row decoded in such a batch gets bitwise the logits it gets alone (rows joining and
leaving on the way included): a reply still does not depend on who else is running.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from mlxcache.types import KVLayer, Model


class DecodeBatch:
    """The rows (request ids) decoding together, their caches and their next inputs."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self._inputs: dict[int, mx.array] = {}
        self._cache: list[BatchKVCache] = []

    def __contains__(self, rid: object) -> bool:
        return rid in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rid: int, layers: Sequence[KVLayer], y: mx.array) -> None:
        """Add a request whose caches are `layers` and whose next input token is `y`."""
        merged = [BatchKVCache.merge([c]) for c in layers]
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

    def leave(self, rid: int, layers: Sequence[KVLayer]) -> None:
        """Put the row's KV back into its own caches `layers`, and drop it."""
        i = self.rows.index(rid)
        for batch, own in zip(self._cache, layers, strict=True):
            row = batch.extract(i)
            own.keys, own.values, own.offset = row.keys, row.values, row.offset
        self.drop(rid)

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

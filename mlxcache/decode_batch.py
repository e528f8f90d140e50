"""Requests that take their decode steps as one batch (where the device allows it exactly).

Each decoding request's caches move into one batched cache per layer when it joins (the
cache class's own `merge`: mlx-lm's left-padded `BatchKVCache` for plain KV, `ArraysCache`
rows for recurrent state, `ring.TimeBatchRing` for sliding windows kept in time order), and
back into its own caches when it leaves; every step is then one forward for all of them.
This runs only where `invariance.batch_matches_solo` measured that a row decoded in such a
batch gets bitwise the logits it gets alone (rows joining and leaving on the way included):
a reply still does not depend on who else is running.

A drafted request's row may feed its last token and its drafts in the same forward (a
verify, `decode._drafted`) while the other rows feed one token: rows narrower than the
widest are padded with their own last token, and each row then drops what it must not keep
(the padding's KV, its rejected drafts': `rewind`) by rolling it into its left padding, as
mlx-lm's `BatchKVCache.finalize` does for right-padded prompts. That needs plain KV in
every layer (`plain`) and the probe's word that such rows are one-row steps
(`invariance.batch_verify_width`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

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


def plain(layers: Sequence[LayerCache]) -> bool:
    """Whether every layer holds plain KV, whose batched rows can each drop their last
    positions (rows of other widths may then share a forward)."""
    return all(type(c) is KVCache for c in layers)


class DecodeBatch:
    """The rows (request ids) decoding together, their caches and their next inputs."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self._inputs: dict[int, mx.array] = {}
        self._drop: dict[int, int] = {}  # last positions a row's KV loses before it is read
        self._cache: list[Any] = []

    def __contains__(self, rid: object) -> bool:
        return rid in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, rid: int, layers: Sequence[LayerCache], y: mx.array) -> None:
        """Add a request whose caches are `layers` and whose next inputs are `y` (a token,
        or a verify's token and drafts)."""
        self._settle()
        merged = [type(c).merge([c]) for c in layers]  # type: ignore[attr-defined]
        if not self.rows:
            self._cache = merged
        else:
            for batch, one in zip(self._cache, merged, strict=True):
                batch.extend(one)
        self.rows.append(rid)
        self._inputs[rid] = y

    def forward(self, model: Model) -> list[mx.array]:
        """One forward for every row: each row's logits (its inputs' count, vocab), in
        `rows` order."""
        self._settle()
        inputs = [self._inputs.pop(rid).reshape(-1) for rid in self.rows]
        sizes = [x.size for x in inputs]
        width = max(sizes)
        if width > 1:
            if not all(isinstance(c, BatchKVCache) for c in self._cache):
                raise ValueError("rows of several tokens need plain KV in every layer")
            self._drop = {rid: width - n for rid, n in zip(self.rows, sizes, strict=True)}
            inputs = [mx.concatenate([x, mx.repeat(x[-1:], width - x.size)]) for x in inputs]
        logits = model(mx.stack(inputs), cache=self._cache)
        return [logits[i, :n] for i, n in enumerate(sizes)]

    def wait(self, rid: int, y: mx.array) -> None:
        """A row's next inputs (a token, or a verify's token and drafts)."""
        self._inputs[rid] = y

    def rewind(self, rid: int, n: int) -> None:
        """The row's last `n` positions (rejected drafts) leave its KV."""
        self._drop[rid] = self._drop.get(rid, 0) + n

    def _settle(self) -> None:
        """Take out of the KV what rows must drop: the positions every row drops are
        trimmed; a row's others are rolled into its left padding (mlx-lm's right padding),
        and the padding every row has is cut off the front (as `BatchKVCache.filter`)."""
        drops = [self._drop.pop(rid, 0) for rid in self.rows]
        if not any(drops):
            return
        least = min(drops)
        extra = [d - least for d in drops]
        for c in self._cache:
            c.trim(least)
            if any(extra):
                c.prepare(right_padding=extra)
                c.finalize()
            pad = min(c.left_padding.tolist())
            if pad > 0:
                c.keys, c.values = c.keys[..., pad:, :], c.values[..., pad:, :]
                c._idx -= pad
                c.left_padding -= pad

    def sync(self, rid: int, layers: Sequence[LayerCache]) -> None:
        """Copy the row's caches out of the batch into its own `layers` (it stays in it)."""
        self._copy_out(rid, layers)

    def leave(self, rid: int, layers: Sequence[LayerCache]) -> None:
        """Put the row's caches back into its own `layers`, and drop it."""
        self._copy_out(rid, layers)
        self.drop(rid)

    def _copy_out(self, rid: int, layers: Sequence[LayerCache]) -> None:
        self._settle()
        i = self.rows.index(rid)
        for batch, own in zip(self._cache, layers, strict=True):
            own.state = batch.extract(i).state

    def drop(self, rid: int) -> None:
        """Forget a row (cancelled, failed or left)."""
        self._settle()
        i = self.rows.index(rid)
        del self.rows[i]
        self._inputs.pop(rid, None)
        if not self.rows:
            self._cache = []
            return
        keep = [j for j in range(len(self.rows) + 1) if j != i]
        for batch in self._cache:
            batch.filter(keep)

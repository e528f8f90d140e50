"""Requests that take their decode steps as one batch (where the device allows it exactly).

Each decoding request's caches move into one batched cache per layer when it joins (the
cache class's own `merge`: mlx-lm's left-padded `BatchKVCache` for plain KV, `ArraysCache`
rows for recurrent state, `ring.TimeBatchRing` for sliding windows kept in time order), and
back into its own caches when it leaves; every step is then one forward for all of them.
This runs only where `invariance.batch_matches_solo` measured that a row decoded in such a
batch gets bitwise the logits it gets alone (rows joining and leaving on the way included):
a reply still does not depend on who else is running.

A drafted request's row may feed its last token and its drafts in the same forward (a
verify, `decode.Reply._drafted`) while the other rows feed one token: rows narrower than the
widest are padded with their own last token. Recurrent layers (`ArraysCache`) stop each
row's state at its own length (`lengths`, which mlx-lm's
recurrent layers honor, most of them: the probe finds the others); in the
KV and sliding-window layers each row drops what it must not keep (the padding, its
rejected drafts': `rewind`) by rolling it into its left padding, as mlx-lm's
`BatchKVCache.finalize` does for right-padded prompts (a time-ordered window holds its
window less one and the new positions, so what a row keeps is its solo ring's). A
recurrent state cannot drop positions: a row whose drafts are rejected takes its state
back from before the forward, drops all of that forward's positions, and feeds the
accepted tokens again at the head of its next row (without drafts then, so that this
never compounds; their logits are not returned). All of this runs only where the probe
found such rows one-row steps (`invariance.batch_verify_width`).
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


class DecodeBatch:
    """The rows (request ids) decoding together, their caches and their next inputs."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self._inputs: dict[int, mx.array] = {}
        self._drop: dict[int, int] = {}  # last positions a row's KV loses before it is read
        self._cache: list[Any] = []
        self._fed: dict[int, mx.array] = {}  # each row's inputs to the last forward (unpadded)
        self._before: tuple[list[int], list[list[Any]]] = ([], [])  # rows, recurrent states
        self._again: dict[int, mx.array] = {}  # accepted tokens a restored row feeds again
        self._model: Model | None = None

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
        `rows` order. A row feeding accepted tokens again feeds its first input only."""
        self._settle()
        self._model = model
        heads = [self._again.pop(rid, None) for rid in self.rows]
        inputs = [self._inputs.pop(rid).reshape(-1) for rid in self.rows]
        inputs = [
            x if h is None else mx.concatenate([h, x[:1]])
            for x, h in zip(inputs, heads, strict=True)
        ]
        sizes = [x.size for x in inputs]
        width = max(sizes)
        recurrent = self._recurrent() if width > 1 else []
        if width > 1:
            self._drop = {rid: width - n for rid, n in zip(self.rows, sizes, strict=True)}
            self._fed = dict(zip(self.rows, inputs, strict=True))
            self._before = (list(self.rows), [list(c.cache) for c in recurrent])
            inputs = [mx.concatenate([x, mx.repeat(x[-1:], width - x.size)]) for x in inputs]
            for c in recurrent:
                c.lengths = mx.array(sizes)
        try:
            logits = model(mx.stack(inputs), cache=self._cache)
        finally:
            for c in recurrent:
                c.lengths = None
        skip = [0 if h is None else h.size for h in heads]
        return [logits[i, s:n] for i, (s, n) in enumerate(zip(skip, sizes, strict=True))]

    def wait(self, rid: int, y: mx.array) -> None:
        """A row's next inputs (a token, or a verify's token and drafts)."""
        self._inputs[rid] = y

    def rewind(self, rid: int, n: int) -> None:
        """The row's last `n` positions (rejected drafts) leave its caches: dropped from
        its KV, or (recurrent layers) the row's state taken back to before the forward and
        the inputs it keeps fed again next time."""
        if n == 0:
            return
        rows, states = self._before
        if not states:
            self._drop[rid] = self._drop.get(rid, 0) + n
            return
        fed = self._fed[rid]
        self._drop[rid] = self._drop.get(rid, 0) + fed.size
        self._again[rid] = fed[: fed.size - n]
        self._restore(rows.index(rid), self.rows.index(rid), states)

    def _restore(self, was: int, at: int, states: list[list[Any]]) -> None:
        """Row `at`'s recurrent states as row `was` held them before the last forward."""
        for c, before in zip(self._recurrent(), states, strict=True):
            c.cache = [
                mx.concatenate([now[:at], old[was : was + 1], now[at + 1 :]])
                for now, old in zip(c.cache, before, strict=True)
            ]

    def _recurrent(self) -> list[Any]:
        """The batch's recurrent layers' caches (their rows cannot drop positions)."""
        return [c for c in self._cache if isinstance(c, ArraysCache)]

    def _settle(self) -> None:
        """Take out of the KV what rows must drop: the positions every row drops are
        trimmed; a row's others are rolled into its left padding (mlx-lm's right padding),
        and the padding every row of plain KV has is cut off the front (as
        `BatchKVCache.filter`; a window's trim cuts it at the next update)."""
        drops = [self._drop.pop(rid, 0) for rid in self.rows]
        if not any(drops):
            return
        least = min(drops)
        extra = [d - least for d in drops]
        for c in self._cache:
            if isinstance(c, ArraysCache):
                continue
            kv = isinstance(c, BatchKVCache)
            c.trim(least)
            if any(extra):
                if kv:
                    c.prepare(right_padding=extra)
                else:  # a window: its `finalize` rolls by offset less `_lengths`
                    c._lengths = c.offset - mx.array(extra)
                c.finalize()
            if kv and (pad := min(c.left_padding.tolist())) > 0:
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
        """The row's caches into `layers`, with the tokens it has to feed again fed (alone)."""
        self._settle()
        i = self.rows.index(rid)
        for batch, own in zip(self._cache, layers, strict=True):
            own.state = batch.extract(i).state
        self._feed_again(rid, layers)

    def _feed_again(self, rid: int, layers: Sequence[LayerCache]) -> None:
        """The accepted tokens the row was to feed again (`rewind`) into its own `layers`."""
        again = self._again.get(rid)
        if again is not None and self._model is not None:
            self._model(again.reshape(1, -1), cache=list(layers))

    def drop(self, rid: int) -> None:
        """Forget a row (cancelled, failed or left)."""
        self._settle()
        i = self.rows.index(rid)
        del self.rows[i]
        self._inputs.pop(rid, None)
        self._again.pop(rid, None)
        self._fed.pop(rid, None)
        if not self.rows:
            self._cache = []
            return
        keep = [j for j in range(len(self.rows) + 1) if j != i]
        for batch in self._cache:
            batch.filter(keep)

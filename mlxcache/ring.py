"""A sliding-window layer cache whose positions stay in time order at every step.

mlx-lm's `RotatingKVCache` writes a decode step's keys and values over the oldest slot once
the window is full, so a one-token step attends over the window rotated, while a prefill
chunk attends over it in time order: the same positions summed in another order, other
bits (measured: every decode step past the window differs from chunked prefill). Kept in
time order, a decode step is the same computation as a chunk of one token, so on a device
whose kernels do not depend on a call's width (`invariance`) a reply's own decode KV is
what a canonical prefill of it computes, and can be kept for the next turn.

The cost is a copy of the window per decode step (the trim and append that chunks make):
the window of every sliding layer, a small part of a step's memory traffic.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache


class TimeRing(RotatingKVCache):
    """A `RotatingKVCache` that takes every update, one token too, as prefill chunks do:
    the window in time order, trimmed to its size less one, then the new positions."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._update_concat(keys, values)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        """mlx-lm's masks, but for a one-token step over a cache wider than the window:
        the positions before the window are the first ones here, not a rotated run."""
        if N > 1 or window_size is None or self.max_size <= window_size:
            return super().make_mask(N, window_size, return_array)
        if self.offset < window_size:
            return None
        size = min(self.offset, self.max_size - 1) + 1  # what the update leaves to attend
        return mx.arange(size) >= size - window_size

    @classmethod
    def merge(cls, caches: list[Any]) -> TimeBatchRing:
        return TimeBatchRing.merge(caches)


class TimeBatchRing(BatchRotatingKVCache):
    """mlx-lm's batched ring (left-padded rows), every update taken as a chunk, in time
    order: a row's step is its `TimeRing`'s."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self._update_concat(keys, values)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        """mlx-lm's mask for several new positions, for one too: no rotation, and the
        update's trim (to the window less one) made for every step."""
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        rinds = mx.arange(offset + N)[None]
        linds = (mx.arange(offset, offset + N) if offset else mx.arange(N))[:, None]
        mask = (linds >= rinds) & (linds < rinds + window_size)
        left_padding = self.left_padding
        if (trim_size := self._idx - self.max_size + 1) > 0:
            left_padding = left_padding - trim_size
        return mask & (rinds >= mx.expand_dims(left_padding, (1, 2, 3)))

    def extract(self, idx: int) -> TimeRing:
        row = super().extract(idx)
        ring = TimeRing(max_size=row.max_size, keep=row.keep)
        ring.state = row.state
        return ring


def time_ordered(layers: list[Any]) -> list[Any]:
    """`layers` (fresh, empty) with each of mlx-lm's rotating caches a `TimeRing` of its
    size."""
    return [
        TimeRing(max_size=c.max_size, keep=c.keep) if type(c) is RotatingKVCache else c
        for c in layers
    ]

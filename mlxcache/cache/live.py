"""A conversation's live KV: the layers its last reply (or warm-ahead) left, held by
reference so that the next turn continues from them with nothing restored or joined.

Only where the device was measured to compute decode KV canonically (the engine's
`decode_matches_prefill`: the store is asked `restore(decode_matches_prefill=True)`), and
only as far as the layers hold every position as plain KV does (`whole_until`): then they
rewind by moving an offset, and the held KV is bit for bit what restoring the kept blocks
and tail would give, without the copies.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from mlxcache.cache.radix import common_prefix
from mlxcache.ring import TimeRing
from mlxcache.types import Layers

UNBOUNDED = sys.maxsize
"""`whole_until` of layers that keep every position whatever their length."""


def whole_until(layers: Layers) -> int:
    """Up to which position `layers` (as they are now) hold their KV as plain KV does:
    every position kept, in order, so that they rewind by an offset and a chunk of any
    width fed to them computes what canonical chunks compute. Plain and quantized KV:
    without bound. A sliding window's ring (`TimeRing`) that has kept every position so
    far: up to its size less one, the last position whose update drops none (past it the
    ring's contents depend on the chunks that filled it, `layout._ring_start`). 0 for
    anything else: a ring that dropped positions, a recurrent state."""
    until = UNBOUNDED
    for c in layers:
        if type(c) in (KVCache, QuantizedKVCache):
            continue
        if type(c) is not TimeRing or c._idx != c.offset:
            return 0
        until = min(until, c.max_size - 1)
    return until


@dataclass(slots=True)
class Live:
    """`layers` holding exactly the KV of `tokens` (one owner: the cache, until taken),
    rewindable to any position up to `until` (`whole_until`)."""

    tokens: np.ndarray
    layers: Layers
    until: int

    @classmethod
    def hold(cls, tokens: np.ndarray, layers: Layers) -> Live | None:
        """`layers` held for the next turn, evaluated now: a row that left a batched decode
        holds lazy copies of the batch's arrays, which would keep every row's KV alive.
        None where they cannot be rewound (`whole_until`)."""
        until = whole_until(layers)
        if until == 0:
            return None
        mx.eval(_arrays(layers))
        return cls(np.array(tokens, np.int32), layers, until)

    @property
    def nbytes(self) -> int:
        """The bytes these layers hold (as allocated): what dropping them frees."""
        return sum(a.nbytes for a in _arrays(self.layers))

    def reach(self, tokens: np.ndarray, limit: int) -> int:
        """How far these layers follow `tokens`, at most `limit` tokens; 0 when they follow
        it past `until` (the kept blocks and tail resume it further than they could)."""
        k = min(common_prefix(self.tokens, tokens), limit)
        return k if k <= self.until else 0

    def take(self, k: int) -> Layers:
        """The layers, rewound to their first `k` tokens (handed over: no copy)."""
        for c in self.layers:
            cast(KVCache, c).trim(len(self.tokens) - k)
        return self.layers


def _arrays(layers: Layers) -> list[mx.array]:
    """Every array of the layers' KV, as allocated (quantized KV: its parts)."""
    leaves = tree_flatten([(getattr(c, "keys", None), getattr(c, "values", None)) for c in layers])
    return [leaf[1] for leaf in leaves if isinstance(leaf[1], mx.array)]

"""Canonical prefill: chunks aligned to absolute multiples of the block size.

Floating point results depend on the shapes a kernel sees, so a resumed request must
run exactly the forward calls a fresh one runs from the resume point on. Chunks
`[0,B) [B,2B) ...` plus a last partial chunk make that true by construction.

On a device measured shape-invariant (`invariance`: a token's KV does not depend on the
chunk it was computed in), a resume may also start inside a block: its first chunk runs to
the next boundary, and the chunks after it are the canonical ones again. There, as far as
the layers hold every position as plain KV does (`live.whole_until`: plain and quantized
KV, a sliding window up to its size less one), consecutive chunks are also merged up to
`MERGED_BLOCKS` blocks wide: the same KV bit for bit (the probe measures chunks that
wide), in fewer forwards (a chat turn's few new tokens in one).
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import mlx.core as mx
import numpy as np

from mlxcache.cache.live import whole_until
from mlxcache.last_logits import last_logits
from mlxcache.types import Layers, Model

MERGED_BLOCKS = 4
"""The most blocks one merged chunk spans (`schedule(merge_to=)`): wide enough for a chat
turn's new tokens, narrow enough that other requests' steps still run between chunks."""


def schedule(
    start: int,
    end: int,
    block_size: int,
    decode_matches_prefill: bool = False,
    merge_to: int = 0,
) -> list[tuple[int, int]]:
    """The (start, stop) chunks that prefill tokens [start, end), aligned to `block_size`.

    Args:
        decode_matches_prefill: `start` may be inside a block (a device measured
            shape-invariant only).
        merge_to: consecutive chunks that end by this position merged up to
            `MERGED_BLOCKS` blocks wide, still ending on block boundaries (a
            shape-invariant device, as far as the layers keep every position: see the
            module's doc); 0: none merged.

    Raises:
        ValueError: if `start` is not a block boundary (and not `decode_matches_prefill`)
            or the range is empty.
    """
    if start % block_size and not decode_matches_prefill:
        raise ValueError(f"prefill must start at a block boundary, got {start} (B={block_size})")
    if not 0 <= start < end:
        raise ValueError(f"empty prefill range [{start}, {end})")
    bounds = [start, *range(start // block_size * block_size + block_size, end, block_size), end]
    head = [b for b in bounds if b <= merge_to]
    if len(head) > 2:
        bounds = _merged(head, MERGED_BLOCKS * block_size) + bounds[len(head) :]
    return list(pairwise(bounds))


def _merged(bounds: list[int], widest: int) -> list[int]:
    """The fewest of `bounds` (the first and last kept) no two consecutive of which are
    more than `widest` apart (consecutive `bounds` are at most `widest` apart)."""
    kept = [bounds[0]]
    for before, bound in pairwise(bounds):
        if bound - kept[-1] > widest:
            kept.append(before)
    return [*kept, bounds[-1]]


def chunks_for(
    layers: Layers, end: int, start: int, block_size: int, decode_matches_prefill: bool = False
) -> list[tuple[int, int]]:
    """The chunks that prefill tokens [start, end) into `layers` (`schedule`): merged, on a
    device measured shape-invariant (`decode_matches_prefill`), as far as `layers` keep
    every position (`live.whole_until`)."""
    merge_to = whole_until(layers) if decode_matches_prefill else 0
    return schedule(start, end, block_size, decode_matches_prefill, merge_to)


def run_chunk(model: Model, layers: Layers, x: mx.array, logits: bool) -> mx.array | None:
    """One chunk's forward, `x` (its tokens) into `layers`, evaluated. `logits` (the
    prompt's last chunk): the last token's, the LM head applied to it alone
    (`last_logits`), shaped (1, vocab); else None, the LM head never evaluated."""
    inputs = x.reshape(1, -1)
    if not logits:
        model(inputs, cache=layers)
        mx.eval([c.state for c in layers])
        return None
    out = last_logits(model, inputs, layers)
    mx.eval(out, [c.state for c in layers])
    return out


def prefill(
    model: Model,
    layers: Layers,
    tokens: np.ndarray,
    start: int,
    block_size: int,
    decode_matches_prefill: bool = False,
) -> Iterator[tuple[int, mx.array | None]]:
    """Run the canonical prefill of tokens[start:] into `layers` (`chunks_for`) and yield
    (stop, logits) after each chunk (`run_chunk`): logits with the final chunk only."""
    end = len(tokens)
    for s, e in chunks_for(layers, end, start, block_size, decode_matches_prefill):
        yield e, run_chunk(model, layers, mx.array(tokens[s:e]), e == end)

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


def prefill(
    model: Model,
    layers: Layers,
    tokens: np.ndarray,
    start: int,
    block_size: int,
    decode_matches_prefill: bool = False,
) -> Iterator[tuple[int, mx.array | None]]:
    """Run the canonical prefill of tokens[start:] into `layers` (`decode_matches_prefill`:
    see `schedule`; its chunks merged there as far as `layers` keep every position).

    Yields (stop, logits) after each chunk, evaluated, so the caller can checkpoint at
    block boundaries and interleave other requests. Logits (of the last prompt token)
    come with the final chunk only, the LM head applied to that token alone
    (`last_logits`): earlier chunks leave the LM head unevaluated.
    """
    merge_to = whole_until(layers) if decode_matches_prefill else 0
    chunks = schedule(start, len(tokens), block_size, decode_matches_prefill, merge_to)
    for s, e in chunks:
        x = mx.array(tokens[None, s:e])
        if e < len(tokens):
            model(x, cache=layers)  # its logits are never evaluated: no LM head
            mx.eval([c.state for c in layers])
            yield e, None
        else:
            logits = last_logits(model, x, layers)
            mx.eval(logits, [c.state for c in layers])
            yield e, logits

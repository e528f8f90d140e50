"""Canonical prefill: chunks aligned to absolute multiples of the block size.

Floating point results depend on the shapes a kernel sees, so a resumed request must
run exactly the forward calls a fresh one runs from the resume point on. Chunks
`[0,B) [B,2B) ...` plus a last partial chunk make that true by construction.

On a device measured shape-invariant (`invariance`: a token's KV does not depend on the
chunk it was computed in), a resume may also start inside a block: its first chunk runs to
the next boundary, and the chunks after it are the canonical ones again.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise

import mlx.core as mx
import numpy as np

from mlxcache.types import Layers, Model


def schedule(
    start: int, end: int, block_size: int, decode_matches_prefill: bool = False
) -> list[tuple[int, int]]:
    """The (start, stop) chunks that prefill tokens [start, end), aligned to `block_size`.

    Args:
        decode_matches_prefill: `start` may be inside a block (a device measured
            shape-invariant only).

    Raises:
        ValueError: if `start` is not a block boundary (and not `decode_matches_prefill`)
            or the range is empty.
    """
    if start % block_size and not decode_matches_prefill:
        raise ValueError(f"prefill must start at a block boundary, got {start} (B={block_size})")
    if not 0 <= start < end:
        raise ValueError(f"empty prefill range [{start}, {end})")
    bounds = [start, *range(start // block_size * block_size + block_size, end, block_size), end]
    return list(pairwise(bounds))


def prefill(
    model: Model,
    layers: Layers,
    tokens: np.ndarray,
    start: int,
    block_size: int,
    decode_matches_prefill: bool = False,
) -> Iterator[tuple[int, mx.array | None]]:
    """Run the canonical prefill of tokens[start:] into `layers` (`decode_matches_prefill`: see
    `schedule`).

    Yields (stop, logits) after each chunk, evaluated, so the caller can checkpoint at
    block boundaries and interleave other requests. Logits (of the last prompt token)
    come with the final chunk only: earlier chunks leave the LM head unevaluated.
    """
    chunks = schedule(start, len(tokens), block_size, decode_matches_prefill)
    for s, e in chunks:
        out = model(mx.array(tokens[None, s:e]), cache=layers)
        states = [c.state for c in layers]
        if e < len(tokens):
            mx.eval(states)
            yield e, None
        else:
            logits = out[:, -1, :]
            mx.eval(logits, states)
            yield e, logits

"""`mlxcache bench chunks`: prefill throughput per chunk size on the current device.

The block size is also the prefill chunk, so it trades reuse (small blocks resume more of
a prompt) against throughput (small chunks use the device less well). This measures the
throughput side: the same prompt prefilled canonically with each chunk size, rounds
interleaved so machine noise hits every size alike. The suggested block size is the
smallest one (not under 16) within 10% of the best throughput.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.model import load
from mlxcache.prefill import prefill

SIZES = (8, 16, 32, 64, 128, 256, 512)
MIN_BLOCK = 16
TOLERANCE = 0.10


def _prefill_tps(model: Any, tokens: np.ndarray, chunk: int) -> float:
    layers = make_prompt_cache(model)
    start = time.perf_counter()
    for _ in prefill(model, layers, tokens, 0, chunk):
        pass
    return len(tokens) / (time.perf_counter() - start)


def suggest(tps: dict[int, float]) -> int:
    """The smallest size (not under MIN_BLOCK) within TOLERANCE of the best throughput."""
    best = max(tps.values())
    fits = [s for s, v in tps.items() if s >= MIN_BLOCK and v >= (1 - TOLERANCE) * best]
    return min(fits) if fits else max(tps, key=lambda s: tps[s])


def run(
    model: str | None = None,
    tokens: int = 512,
    rounds: int = 2,
    sizes: tuple[int, ...] = SIZES,
) -> dict[str, Any]:
    """Median prefill tokens/s per chunk size over `rounds` interleaved rounds."""
    loaded = load(model)
    rng = np.random.default_rng(0)
    vocab = int(loaded.model.args.vocab_size) if hasattr(loaded.model, "args") else 1000
    ids = rng.integers(100, vocab - 1, size=tokens).astype(np.int32)
    _prefill_tps(loaded.model, ids[: min(tokens, 64)], 32)  # warm up kernels and allocator
    samples: dict[int, list[float]] = {s: [] for s in sizes}
    for _ in range(rounds):
        for s in sizes:
            samples[s].append(_prefill_tps(loaded.model, ids, s))
    tps = {s: statistics.median(v) for s, v in samples.items()}
    best = max(tps, key=lambda s: tps[s])
    return {
        "bench": "chunks",
        "device": str(mx.default_device()),
        "model": loaded.name,
        "tokens": tokens,
        "rounds": rounds,
        "tps": {str(s): round(v, 3) for s, v in tps.items()},
        "ratio_to_best": {str(s): round(v / tps[best], 4) for s, v in tps.items()},
        "best": best,
        "suggested_block_size": suggest(tps),
    }

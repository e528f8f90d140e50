"""Whether a model's decode steps compute canonical KV on this device: measured, not assumed.

Resumed == fresh holds because only KV computed by canonical prefill chunks is kept. Where
the device's kernels give the same bits whatever a call's shape (MLX's CPU backend, as
measured), the KV a decode step computes one token at a time is bitwise the KV a chunked
prefill computes for the same tokens, and a reply's KV can be kept as it stands: no
re-prefill of the reply (follow lanes) for the next turn to resume past it. Metal's
kernels differ by call shape (GEMV for one row, GEMM for several), so there the probe
fails and the canonical path runs.

The probe compares, bit for bit, every layer's keys and values and the logits of a decode
run against chunked prefills of the same tokens at several chunk sizes. Its answer is
kept per (model key, device, MLX and mlx-lm versions) in `<cache dir>/probes.json`.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxcache.fileio import write_atomic
from mlxcache.model import LoadedModel

PROBES = "probes.json"


def decode_matches_prefill(model: Any, block_size: int) -> bool:
    """True when decoding tokens one by one leaves bitwise the KV and logits that prefilling
    them in chunks of `block_size` (and of 3) leaves, on every layer. Only plain KV models
    are probed (their blocks are cut out of decode KV as it stands)."""
    layers = make_prompt_cache(model)
    if not all(type(c) is KVCache for c in layers):
        return False
    n = block_size + 1
    ids = (mx.arange(n, dtype=mx.int32) * 7 + 3) % 97 + 1  # any ids: the weights decide
    decoded = make_prompt_cache(model)
    logits = [model(ids[None, i : i + 1], cache=decoded)[0, -1] for i in range(n)]
    mx.eval(logits, [c.state for c in decoded])
    for chunk in sorted({block_size, 3}):
        chunked = make_prompt_cache(model)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            out = model(ids[None, start:stop], cache=chunked)[0, -1]
            if not mx.array_equal(out, logits[stop - 1]).item():
                return False
        for a, b in zip(decoded, chunked, strict=True):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                if not mx.array_equal(x[..., :n, :], y[..., :n, :]).item():
                    return False
    return True


def _key(loaded: LoadedModel, block_size: int) -> str:
    import mlx_lm

    device = str(mx.default_device())
    version = getattr(mx, "__version__", "?")
    return f"{loaded.key}|{block_size}|{device}|{version}|{mlx_lm.__version__}"


def kept_decode(loaded: LoadedModel, block_size: int, directory: Path) -> bool:
    """The probe's answer for `loaded` on this device, from `directory`'s record or run now
    (and recorded; a record that cannot be written is only a lost shortcut)."""
    path = directory / PROBES
    try:
        record = json.loads(path.read_text())
        record = record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        record = {}
    key = _key(loaded, block_size)
    if isinstance(record.get(key), bool):
        return bool(record[key])
    record[key] = decode_matches_prefill(loaded.model, block_size)
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=1))
    return bool(record[key])

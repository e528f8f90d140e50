"""Whether a model's decode steps compute canonical KV on this device: measured, not assumed.

Resumed == fresh holds because only KV computed by canonical prefill chunks is kept. Where
the device's kernels give the same bits whatever a call's shape (MLX's CPU backend, as
measured), the KV a decode step computes one token at a time is bitwise the KV a chunked
prefill computes for the same tokens, and a reply's KV can be kept as it stands: no
re-prefill of the reply (follow lanes) for the next turn to resume past it. Metal's
kernels differ by call shape (GEMV for one row, GEMM for several), so there the probe
fails and the canonical path runs.

The probe compares, bit for bit, every layer's keys and values and the logits of a decode
run against chunked prefills of the same tokens at several chunk sizes. A second probe
decodes rows of different lengths as one batch (mlx-lm's left-padded `BatchKVCache`, with
a row leaving and one joining on the way) against each row decoded alone: where the bits
agree, lanes may decode together and a reply still does not depend on who else runs.
The answers are kept per (model key, block size, device, MLX and mlx-lm versions) in
`<cache dir>/probes.json`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxcache.cache.layout import kv_tag
from mlxcache.config import MAX_DRAFT
from mlxcache.draft import Checkpoint, snapshot
from mlxcache.fileio import write_atomic
from mlxcache.model import LoadedModel
from mlxcache.prefill import prefill
from mlxcache.types import KVLayer, LayerCache, Model, new_layers

PROBES = "probes.json"


def decode_matches_prefill(model: Model, block_size: int) -> bool:
    """True when decoding tokens one by one leaves bitwise the KV and logits that prefilling
    them in chunks of `block_size` (and of 3) leaves, on every layer. Only models of plain
    or quantized KV are probed (their blocks are cut out of decode KV as it stands)."""
    if not _attention(model):
        return False
    n = block_size + 1
    ids = (mx.arange(n, dtype=mx.int32) * 7 + 3) % 97 + 1  # any ids: the weights decide
    decoded = _kv_layers(model)
    logits = [model(ids[None, i : i + 1], cache=decoded)[0, -1] for i in range(n)]
    mx.eval(logits, [c.state for c in decoded])
    for chunk in sorted({block_size, 3}):
        chunked = _kv_layers(model)
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            out = model(ids[None, start:stop], cache=chunked)[0, -1]
            if not mx.array_equal(out, logits[stop - 1]).item():
                return False
        for a, b in zip(decoded, chunked, strict=True):
            for x, y in zip(_parts(a), _parts(b), strict=True):
                if not mx.array_equal(x[..., :n, :], y[..., :n, :]).item():
                    return False
    return True


def _parts(c: KVLayer) -> list[mx.array]:
    """A layer's keys and values, each quantized one as its three arrays."""
    keys, values = c.keys, c.values
    return [*keys, *values] if isinstance(keys, tuple) else [keys, values]


def batch_matches_solo(model: Model) -> bool:
    """True when rows decoded together (left-padded, one leaving and one joining midway)
    give bitwise the logits each gives decoded alone. Plain KV models only (mlx-lm
    batches no other cache)."""
    if not all(type(c) is KVCache for c in new_layers(model)):
        return False
    prompts = [[(7 * i + 3 * r) % 97 + 1 for i in range(n)] for r, n in enumerate((3, 6, 8, 4))]
    steps = 3

    def prefilled(p: list[int]) -> tuple[list[LayerCache], int]:
        layers = new_layers(model)
        first = model(mx.array([p]), cache=layers)[0, -1]
        return layers, int(mx.argmax(first).item())  # type: ignore[arg-type]

    solo = []  # each row's tokens in and logits out, decoded alone
    for p in prompts:
        layers, y = prefilled(p)
        seen = []
        for _ in range(steps):
            out = model(mx.array([[y]]), cache=layers)[0, -1]
            seen.append((y, out))
            y = int(mx.argmax(out).item())  # type: ignore[arg-type]
        solo.append(seen)
    rows = [0, 1, 2]
    batch = [
        BatchKVCache.merge(list(layers))
        for layers in zip(*(prefilled(prompts[r])[0] for r in rows), strict=True)
    ]
    at = dict.fromkeys(rows, 0)
    for step in range(steps + 2):
        if step == 1:  # row 0 leaves, row 3 joins
            for c in batch:
                c.filter([1, 2])
            joined = prefilled(prompts[3])[0]
            for c, j in zip(batch, joined, strict=True):
                c.extend(BatchKVCache.merge([j]))
            rows, at[3] = [1, 2, 3], 0
        live = [r for r in rows if at[r] < steps]
        if len(live) < len(rows):
            break
        ys = mx.array([[solo[r][at[r]][0]] for r in rows])
        out = model(ys, cache=batch)[:, -1]
        for i, r in enumerate(rows):
            if not mx.array_equal(out[i], solo[r][at[r]][1]).item():
                return False
            at[r] += 1
    return True


def _attention(model: Model) -> bool:
    """Whether every layer of `model` keeps plain or quantized KV (the caches probed)."""
    return all(type(c) in (KVCache, QuantizedKVCache) for c in new_layers(model))


def _kv_layers(model: Model) -> list[KVLayer]:
    """Fresh caches of a model that `_attention` found plain or quantized KV."""
    return [cast(KVLayer, c) for c in new_layers(model)]


def _key(loaded: LoadedModel, block_size: int) -> str:
    import mlx_lm

    device = str(mx.default_device())
    version = getattr(mx, "__version__", "?")
    quant = kv_tag(new_layers(loaded.model))  # quantized attention: other kernels
    key = f"{loaded.key}|{block_size}|{device}|{version}|{mlx_lm.__version__}"
    return f"{key}|{quant}" if quant else key


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write(directory: Path, key: str, found: dict[str, Any]) -> None:
    """Add `found` to `key`'s record (a record that cannot be written is only a lost
    shortcut)."""
    path = directory / PROBES
    record = _read(path)
    known = record.get(key)
    record[key] = {**(known if isinstance(known, dict) else {}), **found}
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(record, indent=1))


def _known(directory: Path, key: str) -> dict[str, Any]:
    known = _read(directory / PROBES).get(key)
    return known if isinstance(known, dict) else {}


Note = Callable[[str], None]
"""Told before a probe measures (it takes seconds on a real model): what is happening."""


def probe(
    loaded: LoadedModel, block_size: int, directory: Path, on_note: Note | None = None
) -> dict[str, bool]:
    """{"decode": decode KV is canonical, "batch": rows may decode together} for `loaded`
    on this device, from `directory`'s record or measured now (and recorded)."""
    key = _key(loaded, block_size)
    known = _known(directory, key)
    if all(isinstance(known.get(k), bool) for k in ("decode", "batch")):
        return {"decode": known["decode"], "batch": known["batch"]}
    if on_note is not None:
        on_note(f"measuring what this device computes exactly for {loaded.name} (once)")
    found = {
        "decode": decode_matches_prefill(loaded.model, block_size),
        "batch": batch_matches_solo(loaded.model),
    }
    _write(directory, key, found)
    return found


VERIFY_WIDTHS = (2, 3, 5, MAX_DRAFT + 1)
"""The verify forward widths the probe tries (k + 1 rows for k drafted tokens)."""


@dataclass(frozen=True, slots=True)
class Verify:
    """What the verify probe found: the widest forward whose rows are bitwise one-row
    decode steps (1: none is), and what that forward costs in one-row steps' time."""

    width: int
    cost: float


def verify_probe(
    loaded: LoadedModel, block_size: int, directory: Path | None, on_note: Note | None = None
) -> Verify:
    """`verify_width` and its cost for `loaded` on this device, from `directory`'s record
    or measured now (and recorded; None: measured, not recorded, as in a sharded run where
    every rank must make the same forwards)."""
    key = _key(loaded, block_size)
    known = {} if directory is None else _known(directory, key)
    width, cost = known.get("verify"), known.get("verify_cost")
    if isinstance(width, int) and isinstance(cost, float):
        return Verify(width, cost)
    if on_note is not None:
        on_note(f"measuring how exactly this device verifies drafts for {loaded.name} (once)")
    found = Verify(*verify_width(loaded.model, block_size))
    if directory is not None:
        _write(directory, key, {"verify": found.width, "verify_cost": found.cost})
    return found


def verify_width(model: Model, block_size: int) -> tuple[int, float]:
    """The widest of `VERIFY_WIDTHS` whose drafting is bitwise plain decoding, and the
    time of a forward that wide over a one-row step's (1 and 1.0 where none is).

    For each width w, from a prefix prefilled canonically (long enough that any ring
    buffer has wrapped): a verify forward of w rows, all accepted; a second one of which
    only the first half is kept (`draft.Checkpoint` takes the rest back); two one-row
    steps; a third verify. Every row's logits must equal, bit for bit, those of one-row
    steps over the same tokens from the same prefix. Any family: plain KV is trimmed, other
    caches are restored from a copy and fed again, as decode does.
    """
    fresh = new_layers(model)
    window = max((int(c.max_size) for c in fresh if isinstance(c, RotatingKVCache)), default=0)
    start = (window // block_size + 1) * block_size + 3  # mid-block, as decode mostly is
    widest = max(VERIFY_WIDTHS)
    ids = [(7 * i + 3) % 97 + 1 for i in range(start + 4 * widest)]
    prefix = new_layers(model)
    for _ in prefill(model, prefix, np.asarray(ids[:start], np.int32), 0, block_size):
        pass
    saved = [snapshot(c.state) for c in prefix]

    def at_prefix() -> list[LayerCache]:
        layers = new_layers(model)
        for c, state in zip(layers, saved, strict=True):
            c.state = snapshot(state)
        return layers

    layers = at_prefix()
    plain = [model(mx.array([[t]]), cache=layers)[0, -1] for t in ids[start:]]
    mx.eval(plain)

    def same(layers: list[LayerCache], at: int, n: int) -> bool:
        rows = model(mx.array([ids[start + at : start + at + n]]), cache=layers)[0]
        return all(mx.array_equal(rows[i], plain[at + i]).item() for i in range(n))

    best = 1
    for w in VERIFY_WIDTHS:
        layers = at_prefix()
        if not same(layers, 0, w):
            continue
        mark = Checkpoint(layers)
        if not same(layers, w, w):
            continue
        kept = w // 2 + 1
        mark.rewind(model, ids[start + w : start + w + kept], w - kept)
        at = w + kept
        if not (same(layers, at, 1) and same(layers, at + 1, 1) and same(layers, at + 2, w)):
            continue
        best = w
    return best, _cost(model, at_prefix, best) if best > 1 else 1.0


def _cost(model: Model, at_prefix: Callable[[], list[LayerCache]], width: int) -> float:
    """The time of a `width`-row forward over a one-row forward's (the fastest of 3 each)."""

    def fastest(n: int) -> float:
        times = []
        for _ in range(3):
            layers = at_prefix()
            mx.eval([c.state for c in layers])
            t = time.perf_counter()
            mx.eval(model(mx.array([[5] * n]), cache=layers))
            times.append(time.perf_counter() - t)
        return min(times)

    return round(fastest(width) / max(fastest(1), 1e-9), 3)

"""Whether a model's decode steps compute canonical KV on this device: measured, not assumed.

Resumed == fresh holds because only KV computed by canonical prefill chunks is kept. Where
the device's kernels give the same bits whatever a call's shape (MLX's CPU backend, as
measured), the KV a decode step computes one token at a time is bitwise the KV a chunked
prefill computes for the same tokens, and a reply's KV can be kept as it stands: no
re-prefill of the reply (follow lanes) for the next turn to resume past it. Metal's
kernels differ by call shape (GEMV for one row, GEMM for several), so there the probe
fails and the canonical path runs. The same verdict lets a prefill merge its canonical
chunks (`prefill.schedule(merge_to=)`): the probe compares such chunks too.

The probe compares, bit for bit, the logits and the blocks as the store cuts them (every
layer's keys and values, a sliding window's positions, a recurrent state) of a decode run
against chunked prefills of the same tokens at several chunk sizes, past any sliding
window. A second probe decodes rows of different lengths as one batch (`DecodeBatch`,
with a row leaving, one joining and one going on alone on the way) against each row
decoded alone: where the bits agree, lanes may decode together and a reply still does not
depend on who else runs. A third (`verify_width`) measures drafting's verify forwards,
and a fourth (`batch_verify_width`) verify forwards of drafted rows inside a decode batch.
The answers are kept per (model key, block size, device, MLX and mlx-lm versions, KV
quantization, probe version) in `<cache dir>/probes.json`.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlxcache.cache.layout import Layout, kv_tag
from mlxcache.cache.live import whole_until
from mlxcache.config import MAX_DRAFT
from mlxcache.decode_batch import DecodeBatch, batchable
from mlxcache.draft import Checkpoint, snapshot
from mlxcache.events import Probing
from mlxcache.fileio import write_atomic
from mlxcache.model import LoadedModel
from mlxcache.prefill import MERGED_BLOCKS, prefill, schedule
from mlxcache.ring import TimeRing
from mlxcache.types import LayerCache, Model, new_layers

PROBES = "probes.json"
PROBE_VERSION = "p7"
"""What the probes measure, in their records' keys: "p2" probed every block layout (sliding
windows kept in time order, recurrent state), "p3" drafted rows of every batchable layout
in a decode batch, "p4" records the verify probe's verdict per width, "p5" measures merged
prefill chunks as well (`decode`), "p6" merged chunks from a block boundary too (one
exactly `MERGED_BLOCKS` blocks wide), "p7" merged chunks of sliding windows too, inside
the window (`live.whole_until`); older records are not read."""


Tick = Callable[[], None]
"""Told as a probe finishes each of its steps (`Probing`)."""


def _nothing() -> None:
    pass


def decode_matches_prefill(model: Model, block_size: int) -> bool:
    """True when decoding tokens one by one gives bitwise the logits, and leaves bitwise the
    blocks and state, that prefilling them in chunks of `block_size` (and of 3) gives, for
    any model whose layers the store keeps block by block (`Layout`): plain, quantized and
    sliding-window KV, recurrent state. Compared: every position's logits, every block
    as the store cuts it right after the step that completes it, and the last partial
    block with the recurrent state at the end (what a kept reply's tail holds). As far
    as the layers keep every position (`live.whole_until`), chunks merged
    `MERGED_BLOCKS` blocks wide too (`_merged_matches`): a turn's prefill runs in them
    where this holds.

    With sliding windows, the run starts from a canonical prefix shortly before the
    smallest window and runs a few blocks past it: the steps where a window is full and
    drops a position are the ones a ring buffer's layout could change."""
    layout = Layout.of(new_layers(model), block_size)
    if layout is None:
        return False
    window = min(layout.windows, default=0)
    start = max(0, ((window - 1) // block_size - 1) * block_size) if window else 0
    n = start + (3 if window else 1) * block_size + 1
    ids = [(7 * i + 3) % 97 + 1 for i in range(n)]  # any ids: the weights decide
    at_prefix = _prefixed(model, ids[:start], block_size)
    decoded = _run(model, layout, at_prefix(), ids, start, 1, block_size)
    for chunk in sorted({block_size, 3}):
        chunked = _run(model, layout, at_prefix(), ids, start, chunk, block_size)
        if not _same_run(decoded, chunked):
            return False
    return _merged_matches(model, layout, block_size)


def _merged_matches(model: Model, layout: Layout, block_size: int) -> bool:
    """Whether prefill chunks merged as `schedule(merge_to=)` merges them give bitwise the
    logits and blocks the canonical chunks give (as far as the layers keep every
    position, `live.whole_until`: cut at the end): the first starting inside a block, as
    a turn's does, and starting on a boundary, a chunk exactly `MERGED_BLOCKS` blocks
    wide, as a prompt's."""
    until = whole_until(new_layers(model))
    return all(_merged_from(model, layout, block_size, start, until) for start in (3, block_size))


def _merged_from(model: Model, layout: Layout, block_size: int, start: int, until: int) -> bool:
    """`_merged_matches` for a prompt resumed at `start`, merged up to `until`."""
    n = min(start + MERGED_BLOCKS * block_size + 2, until + 1)
    if n - start < 2:  # no chunk to merge: nothing differs
        return True
    ids = [(5 * i + 2) % 97 + 1 for i in range(n)]
    at_prefix = _prefixed(model, ids[:start], block_size)
    runs = []
    for merge_to in (0, until):
        layers: list[LayerCache] = at_prefix()
        logits: dict[int, mx.array] = {}
        for s, e in schedule(start, n, block_size, decode_matches_prefill=True, merge_to=merge_to):
            _feed(model, layers, ids, s, e, logits)
        bounds = [*range(0, n, block_size), n]
        runs.append((logits, {e: layout.cut(layers, s, e) for s, e in pairwise(bounds)}))
    return _same_run(runs[0], runs[1])


_Blocks = dict[int, dict[str, mx.array]]


def _run(
    model: Model,
    layout: Layout,
    layers: list[LayerCache],
    ids: list[int],
    start: int,
    chunk: int,
    block: int,
) -> tuple[dict[int, mx.array], _Blocks]:
    """Logits by position of ids[start:] fed in chunks of `chunk`, and the blocks cut where
    a chunk ends on a block boundary, with the last partial block (keyed -1)."""
    logits: dict[int, mx.array] = {}
    blocks: _Blocks = {}
    n = len(ids)
    for s in range(start, n, chunk):
        e = min(s + chunk, n)
        _feed(model, layers, ids, s, e, logits)
        if e % block == 0:
            blocks[e] = layout.cut(layers, e - block, e)
    blocks[-1] = layout.cut(layers, n // block * block, n)
    return logits, blocks


def _feed(
    model: Model,
    layers: list[LayerCache],
    ids: list[int],
    start: int,
    stop: int,
    logits: dict[int, mx.array],
) -> None:
    """Feed ids[start:stop] in one forward, evaluated; its logits kept by position."""
    out = model(mx.array([ids[start:stop]]), cache=layers)[0]
    mx.eval(out)
    logits.update({i: out[i - start] for i in range(start, stop)})


def _same_run(
    a: tuple[dict[int, mx.array], _Blocks], b: tuple[dict[int, mx.array], _Blocks]
) -> bool:
    """Whether two runs' logits agree bit for bit, and the blocks both cut."""
    if not all(mx.array_equal(a[0][i], b[0][i]).item() for i in a[0]):
        return False
    for k in a[1].keys() & b[1].keys():
        x, y = a[1][k], b[1][k]
        if x.keys() != y.keys() or not all(mx.array_equal(x[m], y[m]).item() for m in x):
            return False
    return True


def _prefixed(model: Model, prefix: list[int], block_size: int) -> Callable[[], list[LayerCache]]:
    """A maker of fresh layers holding `prefix`, prefilled once, canonically."""
    if not prefix:
        return lambda: new_layers(model)
    layers = new_layers(model)
    for _ in prefill(model, layers, np.asarray(prefix, np.int32), 0, block_size):
        pass
    saved = [snapshot(c.state) for c in layers]

    def at_prefix() -> list[LayerCache]:
        fresh = new_layers(model)
        for c, state in zip(fresh, saved, strict=True):
            c.state = snapshot(state)
        return fresh

    return at_prefix


def batch_matches_solo(model: Model, block_size: int) -> bool:
    """True when rows decoded together in a `DecodeBatch` (left-padded, one leaving and one
    joining midway, one going on alone after it leaves) give bitwise the logits each gives
    decoded alone. Models whose caches batch (`decode_batch.batchable`) only."""
    at_prefix = _batch_prefix(model, block_size)
    return at_prefix is not None and _rows_match(model, at_prefix, 1)


def _batch_prefix(model: Model, block_size: int) -> Callable[[], list[LayerCache]] | None:
    """Where the batch probes' rows start (None: the model's caches do not batch): with
    sliding windows past the smallest window (a shared prefix that fills it, prefilled in
    chunks of `block_size`)."""
    fresh = new_layers(model)
    if not batchable(fresh):
        return None
    window = min((int(c.max_size) for c in fresh if isinstance(c, TimeRing)), default=0)
    return _prefixed(model, [(5 * i + 1) % 97 + 1 for i in range(window)], block_size)


def _rows_match(model: Model, at_prefix: Callable[[], list[LayerCache]], width: int) -> bool:
    """Whether rows decoded as one `DecodeBatch` after `at_prefix` (prompts of different
    lengths, so left-padded; row 0 leaving and row 3 joining at the second step; the first
    row left going on alone after it leaves the batch) read bitwise the logits each reads
    decoded alone, greedily. `width` > 1: rows 0 and 3 verify `width` - 1 drafts, all
    accepted; row 1 as many with one wrong midway (the rest rejected: `DecodeBatch.rewind`;
    with recurrent state its next forward feeds the accepted ones again, and it leaves with
    them to feed again); row 2 steps one token (padded to the width)."""
    prompts = [[(7 * i + 3 * r) % 97 + 1 for i in range(n)] for r, n in enumerate((3, 6, 8, 4))]
    steps = 3

    def prefilled(p: list[int]) -> tuple[list[LayerCache], int]:
        layers = at_prefix()
        first = model(mx.array([p]), cache=layers)[0, -1]
        return layers, int(mx.argmax(first).item())  # type: ignore[arg-type]

    solo = []  # each row's greedy tokens, and the logits after each, decoded alone
    for p in prompts:
        layers, y = prefilled(p)
        seq, seen = [y], []
        for _ in range(steps * width + 2):
            out = model(mx.array([[seq[-1]]]), cache=layers)[0, -1]
            seen.append(out)
            seq.append(int(mx.argmax(out).item()))  # type: ignore[arg-type]
        solo.append((seq, seen))
    batch, own, at = DecodeBatch(), {}, dict[int, int]()
    kept = {0: width, 1: max(width // 2, 1), 2: 1, 3: width}  # rows read per forward

    def inputs(r: int) -> list[int]:
        got = solo[r][0][at[r] : at[r] + (1 if r == 2 else width)]
        if kept[r] < len(got):
            got[kept[r]] = got[kept[r]] - 1 if got[kept[r]] else 1  # a wrong draft
        return got

    def join(r: int) -> None:
        own[r], at[r] = prefilled(prompts[r])[0], 0
        batch.join(r, own[r], mx.array(inputs(r)))

    for r in (0, 1, 2):
        join(r)
    for step in range(steps):
        if step == 1:  # row 0 leaves, row 3 joins
            batch.drop(0)
            join(3)
        rows = batch.forward(model)
        for i, r in enumerate(batch.rows):
            n = min(kept[r], rows[i].shape[0])
            if not all(mx.array_equal(rows[i][j], solo[r][1][at[r] + j]).item() for j in range(n)):
                return False
            batch.rewind(r, rows[i].shape[0] - n)
            at[r] += n
        for r in batch.rows:
            batch.wait(r, mx.array(inputs(r)))
    r = batch.rows[0]  # leaves, and goes on alone from its own caches
    batch.leave(r, own[r])
    out = model(mx.array([[solo[r][0][at[r]]]]), cache=own[r])[0, -1]
    return bool(mx.array_equal(out, solo[r][1][at[r]]).item())


def key_parts(loaded: LoadedModel, block_size: int) -> dict[str, str]:
    """Everything a probe's verdict depends on, each a part of its record's key (a part
    left out would let one setting read another's answers: tests/test_invariance.py
    varies each)."""
    import mlx_lm

    return {
        "model": loaded.key,  # the weights (a sharded run: its topology too)
        "block_size": str(block_size),  # the probes' canonical prefill chunks
        "device": str(mx.default_device()),  # its kernels
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_lm": mlx_lm.__version__,  # the model classes and caches
        "probe": PROBE_VERSION,  # what the probes measure
        "kv": kv_tag(new_layers(loaded.model)),  # quantized attention (bits, group): other kernels
    }


def _key(loaded: LoadedModel, block_size: int) -> str:
    parts = key_parts(loaded, block_size)
    quant = parts.pop("kv")
    key = "|".join(parts.values())
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


Note = Callable[[Probing], None]
"""Told as a probe measures (seconds to minutes on a real model): what, and how far."""


@dataclass(frozen=True, slots=True)
class Measure:
    """What a probe measures (`Probing.what`, `Probing.why`), in how many steps, and how:
    `run(tick)` returns the record's fields, calling `tick` after each step."""

    what: str
    why: str
    steps: int
    run: Callable[[Tick], dict[str, Any]]


def _recorded(
    loaded: LoadedModel,
    block_size: int,
    directory: Path | None,
    fields: dict[str, type],
    measure: Measure,
    on_note: Note | None,
    valid: Callable[[dict[str, Any]], bool] = lambda _known: True,
) -> dict[str, Any]:
    """`fields` of `loaded`'s record in `directory` where each is there with its type (and
    the record is `valid`), else measured now (`on_note` told as it goes: `Probing`) and
    recorded. `directory` None: measured, not recorded, as in a sharded run where every
    rank must make the same forwards."""
    key = _key(loaded, block_size)
    known = {} if directory is None else _known(directory, key)
    if all(isinstance(known.get(k), t) for k, t in fields.items()) and valid(known):
        return {k: known[k] for k in fields}
    tell = on_note or (lambda _event: None)
    start, done = time.perf_counter(), 0

    def told(steps: int) -> None:
        elapsed = time.perf_counter() - start
        tell(Probing(measure.what, measure.why, loaded.name, steps, measure.steps, elapsed))

    def tick() -> None:  # the last step is told once, as the end
        nonlocal done
        done = min(done + 1, measure.steps - 1)
        told(done)

    told(0)
    found = measure.run(tick)
    told(measure.steps)
    if directory is not None:
        _write(directory, key, found)
    return found


def recorded_probe(loaded: LoadedModel, block_size: int, directory: Path) -> dict[str, bool] | None:
    """`probe`'s answer where `directory` records it (a file read: no forward), else None."""
    known = _known(directory, _key(loaded, block_size))
    if not all(isinstance(known.get(k), bool) for k in PROBED):
        return None
    return {k: known[k] for k in PROBED}


PROBED = ("decode", "batch")
"""The fields `probe` records."""


def probe(
    loaded: LoadedModel, block_size: int, directory: Path, on_note: Note | None = None
) -> dict[str, bool]:
    """{"decode": decode KV is canonical, "batch": rows may decode together} for `loaded`
    on this device, from `directory`'s record or measured now (and recorded)."""

    def run(tick: Tick) -> dict[str, Any]:
        decode = decode_matches_prefill(loaded.model, block_size)
        tick()
        batch = batch_matches_solo(loaded.model, block_size)
        return {"decode": decode, "batch": batch}

    measure = Measure(
        "what this device computes exactly",
        "decode steps against prefill chunks (a reply's KV kept for the next turn), batched "
        "rows against solo ones (requests decoding together)",
        2,
        run,
    )
    return _recorded(loaded, block_size, directory, dict.fromkeys(PROBED, bool), measure, on_note)


VERIFY_WIDTHS = (2, 3, 5, MAX_DRAFT + 1)
"""The verify forward widths the probe tries (k + 1 rows for k drafted tokens)."""


@dataclass(frozen=True, slots=True)
class Verify:
    """What the verify probe found: each probed width's verdict (its rows bitwise one-row
    decode steps) and its forward time in one-row steps'."""

    passed: dict[int, bool]
    costs: dict[int, float]

    @property
    def width(self) -> int:
        """The widest drafting may use: a probed width that passed with every narrower one
        (1: width 2 failed). A verify forward carries up to k drafts, and fewer where lookup
        finds fewer or the reply's budget ends, so every width up to k + 1 runs."""
        return _contiguous(self.passed)


def _contiguous(passed: dict[int, bool]) -> int:
    """The widest width that passed with every narrower one (1: the narrowest failed)."""
    width = 1
    for w in sorted(passed):
        if not passed[w]:
            break
        width = w
    return width


def verify_probe(
    loaded: LoadedModel, block_size: int, directory: Path | None, on_note: Note | None = None
) -> Verify:
    """`verify_width` and its costs for `loaded` on this device, from `directory`'s record
    or measured now (and recorded; None: measured, not recorded, as in a sharded run where
    every rank must make the same forwards)."""

    def run(tick: Tick) -> dict[str, Any]:
        passed, costs = verify_width(loaded.model, block_size, tick)
        return {
            "verify": {str(w): ok for w, ok in passed.items()},
            "verify_costs": {str(w): c for w, c in costs.items()},
        }

    measure = Measure(
        "how exactly this device verifies drafts",
        f"forwards of {', '.join(map(str, VERIFY_WIDTHS))} rows against one-row decode steps, "
        "and what each costs (for drafting)",
        len(VERIFY_WIDTHS) + 1,
        run,
    )
    found = _recorded(
        loaded,
        block_size,
        directory,
        {"verify": dict, "verify_costs": dict},
        measure,
        on_note,
        lambda known: (
            _read_costs(known["verify_costs"]) is not None
            and _read_passed(known["verify"]) is not None
        ),
    )
    costs = cast(dict[int, float], _read_costs(found["verify_costs"]))
    return Verify(cast(dict[int, bool], _read_passed(found["verify"])), costs)


def _read_passed(recorded: dict[Any, Any]) -> dict[int, bool] | None:
    """A record's verdict per width, or None where it is damaged."""
    try:
        passed = {int(w): ok for w, ok in recorded.items()}
    except (TypeError, ValueError):
        return None
    whole = sorted(passed) == list(VERIFY_WIDTHS)
    return passed if whole and all(isinstance(ok, bool) for ok in passed.values()) else None


def _read_costs(recorded: dict[Any, Any]) -> dict[int, float] | None:
    """A record's verify costs (width: time over one row's), or None where it is damaged."""
    try:
        costs = {int(w): float(c) for w, c in recorded.items()}
    except (TypeError, ValueError):
        return None
    return costs if sorted(costs) == list(VERIFY_WIDTHS) and min(costs.values()) > 0 else None


def verify_width(
    model: Model, block_size: int, tick: Tick = _nothing
) -> tuple[dict[int, bool], dict[int, float]]:
    """Whether drafting at each of `VERIFY_WIDTHS` is bitwise plain decoding, and the time
    of a forward of each of them over a one-row step's.

    For each width w, from a prefix prefilled canonically (long enough that any ring
    buffer has wrapped): a verify forward of w rows, all accepted; a second one of which
    only the first half is kept (`draft.Checkpoint` takes the rest back); two one-row
    steps; a third verify. Every row's logits must equal, bit for bit, those of one-row
    steps over the same tokens from the same prefix. Any family: plain KV is trimmed, other
    caches are restored from a copy and fed again, as decode does.
    """
    layout = Layout.of(new_layers(model), block_size)
    window = max(layout.windows if layout else [], default=0)
    start = (window // block_size + 1) * block_size + 3  # mid-block, as decode mostly is
    widest = max(VERIFY_WIDTHS)
    ids = [(7 * i + 3) % 97 + 1 for i in range(start + 4 * widest)]
    at_prefix = _prefixed(model, ids[:start], block_size)

    layers = at_prefix()
    plain = [model(mx.array([[t]]), cache=layers)[0, -1] for t in ids[start:]]
    mx.eval(plain)

    def same(layers: list[LayerCache], at: int, n: int) -> bool:
        rows = model(mx.array([ids[start + at : start + at + n]]), cache=layers)[0]
        return all(mx.array_equal(rows[i], plain[at + i]).item() for i in range(n))

    def passes(w: int) -> bool:
        layers = at_prefix()
        if not same(layers, 0, w):
            return False
        mark = Checkpoint(layers)
        if not same(layers, w, w):
            return False
        kept = w // 2 + 1
        mark.rewind(model, ids[start + w : start + w + kept], w - kept)
        at = w + kept
        return same(layers, at, 1) and same(layers, at + 1, 1) and same(layers, at + 2, w)

    passed = {}
    for w in VERIFY_WIDTHS:
        passed[w] = passes(w)
        tick()
    return passed, _costs(model, at_prefix, list(VERIFY_WIDTHS))


def batch_verify_probe(
    loaded: LoadedModel, block_size: int, directory: Path | None, on_note: Note | None = None
) -> int:
    """`batch_verify_width` for `loaded` on this device, from `directory`'s record or
    measured now (and recorded; None: as `verify_probe`)."""
    measure = Measure(
        "how exactly this device verifies drafts in a batch",
        "drafted rows inside a decode batch against one-row decode steps",
        1,
        lambda _tick: {"batch_verify": batch_verify_width(loaded.model, block_size)},
    )
    found = _recorded(loaded, block_size, directory, {"batch_verify": int}, measure, on_note)
    return int(found["batch_verify"])


def batch_verify_width(model: Model, block_size: int) -> int:
    """The widest of `VERIFY_WIDTHS` at which drafted rows in a `DecodeBatch` are bitwise
    one-row steps (`_rows_match`: rows of different widths, all, some and none of their
    drafts accepted, the rejected drafts and the padding taken out of the caches), every
    narrower one passing too (a batch's forward is as wide as its widest row: any width up
    to k + 1 runs); 1 where width 2 fails or the model's caches do not batch."""
    at_prefix = _batch_prefix(model, block_size)
    if at_prefix is None:
        return 1
    passed: dict[int, bool] = {}
    for w in VERIFY_WIDTHS:  # the narrowest first: a failure ends the search
        passed[w] = _rows_match(model, at_prefix, w)
        if not passed[w]:
            break
    return _contiguous(passed)


def _costs(
    model: Model, at_prefix: Callable[[], list[LayerCache]], widths: list[int]
) -> dict[int, float]:
    """Each width's forward time over a one-row forward's (the fastest of 3 each)."""

    def fastest(n: int) -> float:
        times = []
        for _ in range(3):
            layers = at_prefix()
            mx.eval([c.state for c in layers])
            t = time.perf_counter()
            mx.eval(model(mx.array([[5] * n]), cache=layers))
            times.append(time.perf_counter() - t)
        return min(times)

    one = max(fastest(1), 1e-9)
    return {w: round(fastest(w) / one, 3) for w in widths}

"""`mlxcache bench index`: prompt index latency vs mlx-lm's `LRUPromptCache`, same workload.

The workload is one chat of `turns` turns growing from 8k to 30k tokens, every other turn a
fork from a recent earlier state (an edit or a regenerate). Per turn: look the prompt up,
then keep prompt + reply floored to whole blocks (B: the device's default block size,
unless given), evicting down to `slots`
entries. So that the index is full for the second half of the chat (and victims are picked
among `slots` entries), it first holds entries of other chats (other first blocks, as other
system prompts would have): as many as the first half of the chat leaves free.
Both caches run interleaved in the same process, on the same token ids: numpy arrays for the
index (what the engine passes), lists for mlx-lm (what its server passes).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from mlxcache.cache.index import PromptIndex
from mlxcache.config import default_block_size

START, END = 8_000, 30_000
USER, FORK_CUT, MIN_REPLY = 40, 60, 16  # a user message; most an edit cuts; shortest reply
VOCAB = 32_000
MODEL = "bench"  # mlx-lm's caches are keyed by model; any hashable will do
GOAL_SPEEDUP, GOAL_VICTIM_MS, GOAL_TAIL, GOAL_SCALE = 10.0, 0.05, 3.0, 2.0
COUNTS = ("evictions", "hits", "hit_tokens", "mlx_lm_hit_tokens")
T = TypeVar("T")
Ids = npt.NDArray[np.int32]


class _Layer:
    """The smallest stand-in for an mlx-lm trimmable layer cache (it is deep-copied)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    @property
    def nbytes(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, self.offset)
        self.offset -= n
        return n


def _conversation(rng: random.Random, turns: int) -> list[tuple[Ids, Ids]]:
    """(prompt, prompt + reply) per turn. Even turns continue the chat with a user message;
    odd turns fork from one of the last four turns (regenerate, or edit its user message).
    Replies are as long as it takes to keep the chat on its 8k to 30k growth schedule."""
    state = _ids(rng, START)
    out: list[tuple[Ids, Ids]] = []
    for t in range(turns):
        if t % 2 and out:
            prompt, _ = rng.choice(out[-4:])
            if rng.random() < 0.5:
                prompt = np.concatenate([prompt[: -rng.randint(1, FORK_CUT)], _ids(rng, USER)])
        else:
            prompt = np.concatenate([state, _ids(rng, USER)])
        target = START + (END - START) * (t + 1) // turns
        state = np.concatenate([prompt, _ids(rng, max(MIN_REPLY, target - len(prompt)))])
        out.append((prompt, state))
    return out


def _background(rng: random.Random, n: int, B: int) -> list[Ids]:
    """`n` entries of other chats, 100 per chat, each one block longer than the last."""
    out: list[Ids] = []
    while len(out) < n:
        chat = _ids(rng, 4 * B + 100 * B)
        out.extend(chat[: (5 + k) * B] for k in range(min(100, n - len(out))))
    return out


def _ids(rng: random.Random, n: int) -> Ids:
    return np.array([rng.randrange(VOCAB) for _ in range(n)], dtype=np.int32)


def _timed(samples: list[float], fn: Callable[[], T]) -> T:
    t0 = time.perf_counter_ns()
    out = fn()
    samples.append((time.perf_counter_ns() - t0) / 1e6)
    return out


def _keep(index: PromptIndex, kept: Ids, prompt: Ids, slots: int) -> int:
    index.add(kept)
    evicted = 0
    while len(index) > slots:
        victim = index.victim(prompt=prompt)
        if victim is None:
            break
        index.remove(victim)
        evicted += 1
    return evicted


def _one_run(
    seed: int, slots: int, turns: int, ms: dict[str, list[float]], B: int
) -> dict[str, int]:
    from mlx_lm.models.cache import LRUPromptCache

    rng = random.Random(seed)
    chat = _conversation(rng, turns)
    first_half = {state[: len(state) // B * B].tobytes() for _, state in chat[: turns // 2]}
    background = _background(rng, max(0, slots - len(first_half)), B)
    index, theirs = PromptIndex(B), LRUPromptCache(max_size=slots)
    for kept in background:
        _keep(index, kept, kept, slots)
        theirs.insert_cache(MODEL, kept.tolist(), [_Layer(len(kept))])
    counts = dict.fromkeys(COUNTS, 0)
    counts["background_entries"] = len(background)
    counts["max_prompt_tokens"] = max(len(p) for p, _ in chat)
    # Collections are run between turns, untimed: the millions of small dicts of mlx-lm's
    # token trie would otherwise make either side pay for the other's garbage.
    gc.collect()
    gc.disable()
    try:
        for t, (prompt, state) in enumerate(chat):
            _turn(t, index, theirs, prompt, state[: len(state) // B * B], slots, ms, counts)
            gc.collect(0)
    finally:
        gc.enable()
    return counts


def _turn(
    t: int,
    index: PromptIndex,
    theirs: Any,
    prompt: Ids,
    kept: Ids,
    slots: int,
    ms: dict[str, list[float]],
    counts: dict[str, int],
) -> None:
    p_list, k_list = prompt.tolist(), kept.tolist()

    def ours() -> None:
        m = _timed(ms["lookup"], lambda: index.lookup(prompt))
        _timed(ms["victim"], lambda: index.victim(prompt=prompt))
        counts["evictions"] += _timed(ms["keep"], lambda: _keep(index, kept, prompt, slots))
        counts["hits"] += m is not None
        counts["hit_tokens"] += m.length if m else 0

    def mlx_lm() -> None:
        _, rest = _timed(ms["mlx_lm_lookup"], lambda: theirs.fetch_nearest_cache(MODEL, p_list))
        counts["mlx_lm_hit_tokens"] += len(p_list) - len(rest)
        _timed(ms["mlx_lm_keep"], lambda: theirs.insert_cache(MODEL, k_list, [_Layer(len(k_list))]))

    for side in (ours, mlx_lm) if t % 2 else (mlx_lm, ours):
        side()


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def run(
    slots: int = 200, runs: int = 3, turns: int = 220, block_size: int | None = None
) -> dict[str, Any]:
    """Measure lookup, keep and victim latency of the index and of mlx-lm's cache.

    `block_size` defaults to the device's default block size (what the engine uses).

    Returns:
        A JSON-ready dict: p50/p99 in milliseconds per operation, speedups, goals met.
    """
    ms: dict[str, list[float]] = {
        k: [] for k in ("lookup", "keep", "victim", "mlx_lm_lookup", "mlx_lm_keep")
    }
    B = block_size or default_block_size()
    runs_counts = [_one_run(r, slots, turns, ms, B) for r in range(runs)]
    totals = {k: sum(c[k] for c in runs_counts) for k in COUNTS}
    totals["background_entries"] = runs_counts[0]["background_entries"]
    totals["max_prompt_tokens"] = runs_counts[0]["max_prompt_tokens"]
    p = {k: {"p50_ms": _pct(v, 50), "p99_ms": _pct(v, 99)} for k, v in ms.items()}
    ratios = {
        "lookup_p50_speedup": p["mlx_lm_lookup"]["p50_ms"] / p["lookup"]["p50_ms"],
        "keep_p50_speedup": p["mlx_lm_keep"]["p50_ms"] / p["keep"]["p50_ms"],
        "victim_p99_over_p50": p["victim"]["p99_ms"] / p["victim"]["p50_ms"],
    }
    goals = {
        "lookup_10x": ratios["lookup_p50_speedup"] >= GOAL_SPEEDUP,
        "keep_10x": ratios["keep_p50_speedup"] >= GOAL_SPEEDUP,
        "victim_p50_le_0.05ms": p["victim"]["p50_ms"] <= GOAL_VICTIM_MS,
        "victim_p99_le_3x_p50": ratios["victim_p99_over_p50"] <= GOAL_TAIL,
    }
    rounded = {k: {q: round(x, 4) for q, x in v.items()} for k, v in p.items()}
    return {
        "bench": "index",
        "slots": slots,
        "runs": runs,
        "turns": turns,
        "block_size": B,
        **totals,
        "ms": rounded,
        "ratios": {k: round(v, 2) for k, v in ratios.items()},
        "goals": goals,
        "pass": all(goals.values()),
    }


def run_scaled(
    slots: int, runs: int, turns: int, scale_slots: int = 0, block_size: int | None = None
) -> dict[str, Any]:
    """`run`, plus (with `scale_slots`) the same workload at that many slots, nested under
    "scale", and the goal that victim p50 stays within 2x."""
    result = run(slots, runs, turns, block_size)
    if scale_slots:
        big = run(scale_slots, runs, turns, block_size)
        ratio = big["ms"]["victim"]["p50_ms"] / max(result["ms"]["victim"]["p50_ms"], 1e-9)
        keep = ("slots", "background_entries", "evictions", "ms", "ratios", "goals")
        result["scale"] = {k: big[k] for k in keep} | {"victim_p50_ratio": round(ratio, 2)}
        result["goals"]["victim_scale_le_2x"] = ratio <= GOAL_SCALE
        result["pass"] = all(result["goals"].values()) and big["pass"]
    return result


def main(argv: list[str] | None = None) -> None:
    """Print the figures to stderr and one JSON line to stdout."""
    ap = argparse.ArgumentParser(prog="python -m mlxcache.bench.index_bench")
    ap.add_argument("--slots", type=int, default=200)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--turns", type=int, default=220)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument(
        "--scale-slots",
        type=int,
        default=0,
        help="also run with this many slots and check victim p50 stays within 2x",
    )
    args = ap.parse_args(argv)
    result = run_scaled(args.slots, args.runs, args.turns, args.scale_slots, args.block_size)
    for op, q in result["ms"].items():
        print(f"{op:>14}: p50 {q['p50_ms']:8.4f} ms   p99 {q['p99_ms']:8.4f} ms", file=sys.stderr)
    for key in ("ratios", "goals", "scale"):
        if key in result:
            print(f"{key}: {result[key]}", file=sys.stderr)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()

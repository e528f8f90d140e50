"""`mlxcache bench reuse`: how much of a shared prefix each model family resumes.

Every family of `bench.families` (tiny random instances of mlx-lm's classes, with the
embedded model's tokenizer) and optionally a real model run three workloads on token ids:
(a) a 4-turn chat with warm-ahead after each reply, then a fork that edits turn 3;
(b) two prompts sharing half their tokens; (c) the same prompt twice; (d) a 4-turn chat
sent back to back (each next turn the moment the reply ends, followed, on an engine set
as chat and serve open it), with the tokens re-prefilled on each turn beyond what it
added. Per family: the share of prompt tokens resumed on each, against full attention
(qwen3) on the same workload, bytes kept per token against the KV the model computes per
token, cold time to first token against `mlx_lm.stream_generate`'s on the same weights,
and whether every reply equals a `--no-cache` run. Goals: at least 0.9 x full
attention's share on each workload, back to back no more re-prefilled than full
attention (a turn to the token) where the probe lets a family keep its replies as decoded
(`decode_kv` "kept"), else no more than each reply's last partial block, at most 1.5 x
the model's KV per token, no reply different from cold, and for a real model
(`--model`) cold TTFT at most 1.1 x mlx-lm's.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.bench.families import FAMILIES, build
from mlxcache.cache.base import NoCache
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.events import Done
from mlxcache.model import LoadedModel, load
from mlxcache.runtime import measured
from mlxcache.sampling import SamplingParams
from mlxcache.types import as_module, as_wrapper, new_layers

PARAMS = SamplingParams(max_tokens=8)
GOAL_COLD_TTFT = 1.1
"""For a real model (`--model`): on the tiny families a forward's fixed cost dominates, and
canonical chunks of B make many more forwards than mlx-lm's one (reported, no goal)."""
TURN = 21
REFERENCE = "qwen3"
"""The full-attention family every other one is compared with."""


class _Pair:
    """A cached engine and a cold one on the same model; every reply compared."""

    def __init__(self, loaded: LoadedModel, directory: Path, block_size: int) -> None:
        config = CacheConfig(block_size=block_size, directory=directory)
        self.cache = PromptCache(loaded.model, loaded.key, config, root=directory / "kv")
        self.engine = Engine(loaded, self.cache)
        self.cold = Engine(loaded, NoCache(loaded.model, block_size))
        self.equal = True

    def ask(self, tokens: list[int]) -> tuple[int, list[int]]:
        """(tokens resumed, reply) of one request."""
        got = self.engine.complete(Request(tokens, PARAMS))
        self.equal &= got.tokens == self.cold.complete(Request(tokens, PARAMS)).tokens
        return got.stats.cached_tokens, got.tokens

    def warm(self, tokens: list[int]) -> None:
        """Warm-ahead of the next turn, run to its end (as in a chat's idle time)."""
        self.engine.warm(tokens)
        list(self.engine.run(warm=True))


def _workloads(pair: _Pair, rng: np.random.Generator, vocab: int) -> dict[str, float]:
    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(100, vocab, size=n)]

    history, asked, resumed, prompts = ids(48), [], 0, 0
    for turn in range(4):
        history = history + ids(24)
        asked.append(history)
        cached, reply = pair.ask(history)
        if turn:
            resumed, prompts = resumed + cached, prompts + len(history)
        history = history + reply
        pair.warm(history)
    fork = asked[2][:-24] + ids(24)
    cached, _ = pair.ask(fork)
    chat = (resumed + cached) / (prompts + len(fork))
    shared = ids(64)
    pair.ask(shared + ids(64))
    second = shared + ids(64)
    half = pair.ask(second)[0] / len(second)
    again = ids(96)
    pair.ask(again)
    same = pair.ask(again)[0] / len(again)
    return {
        "chat_fork": round(chat, 3),
        "half_shared": round(half, 3),
        "same_twice": round(same, 3),
    }


def _back_to_back(
    loaded: LoadedModel, directory: Path, block_size: int, rng: np.random.Generator, vocab: int
) -> tuple[list[int], float, bool]:
    """A 4-turn chat whose next turn comes the moment the reply ends (as agents send it: no
    idle time for warm-ahead), each request followed, on an engine opened as chat and serve
    open it (what the probe allows). Turns of 21 tokens and replies of 8 end mid-block, as
    real ones do. Returns the tokens re-prefilled on turns 2-4 beyond the ones each turn
    added, the share of those turns' prompts resumed, and whether replies were kept as
    decoded (the probe passed)."""
    pair = _Pair(loaded, directory, block_size)
    engine, allowed = pair.engine, measured(loaded, pair.cache.config)
    engine.decode_matches_prefill, engine.batch_decode = allowed["decode"], allowed["batch"]
    history = [int(t) for t in rng.integers(100, vocab, size=48)]
    again, resumed, prompts = [], 0, 0
    for turn in range(4):
        history = history + [int(t) for t in rng.integers(100, vocab, size=TURN)]
        rid = engine.submit(Request(history, PARAMS, follow=True))
        done = next(e for e in list(engine.run()) if isinstance(e, Done) and e.request_id == rid)
        stats = done.result.stats
        if turn:
            again.append(stats.prefilled_tokens - TURN)
            resumed, prompts = resumed + stats.cached_tokens, prompts + len(history)
        history = history + done.result.tokens
    return again, round(resumed / prompts, 3), allowed["decode"]


def _cold_ttft_vs_mlx_lm(loaded: LoadedModel, block_size: int, rounds: int = 3) -> float:
    """Our cold time to the first token of a prompt of up to 256 tokens over
    `mlx_lm.stream_generate`'s on the same weights (the fastest of `rounds` each,
    interleaved)."""
    from mlx_lm import stream_generate

    n = min(256, loaded.context_length - 2)
    ids = [int(t) for t in np.random.default_rng(11).integers(100, 1000, size=n)]
    cold = Engine(loaded, NoCache(loaded.model, block_size))
    model, tokenizer = as_module(loaded.model), as_wrapper(loaded.tokenizer)
    ours, theirs = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        cold.complete(Request(ids, SamplingParams(max_tokens=1)))
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        next(iter(stream_generate(model, tokenizer, ids, max_tokens=1)))
        theirs.append(time.perf_counter() - start)
    return round(min(ours) / max(min(theirs), 1e-9), 3)


def _kv_bytes_per_token(loaded: LoadedModel) -> int:
    """K and V bytes one token takes in the model's own attention layers (no padding)."""
    layers = new_layers(loaded.model)
    loaded.model(mx.zeros((1, 4), dtype=mx.int32), cache=layers)
    return sum(
        int(a.shape[1] * a.shape[3] * a.itemsize)
        for c in layers  # the layers that keep keys and values, whatever their kind
        for a in (getattr(c, "keys", None), getattr(c, "values", None))
        if a is not None
    )


def _kept_bytes_per_token(loaded: LoadedModel, directory: Path, block_size: int) -> float:
    """Disk bytes of one kept prompt of 6 blocks (its blocks and recurrent states), per token."""
    pair = _Pair(loaded, directory, block_size)
    n = 6 * block_size
    pair.ask([int(t) for t in np.random.default_rng(7).integers(100, 1000, size=n + 1)])
    return pair.cache.report()["disk_bytes"] / n


def _family(
    name: str, loaded: LoadedModel, root: Path, block_size: int, vocab: int
) -> dict[str, Any]:
    pair = _Pair(loaded, root / name / "cache", block_size)
    shares = _workloads(pair, np.random.default_rng(0), vocab)
    kept = _kept_bytes_per_token(loaded, root / name / "bytes", block_size)
    rng = np.random.default_rng(1)
    again, back, kept_replies = _back_to_back(loaded, root / name / "back", block_size, rng, vocab)
    model_kv = _kv_bytes_per_token(loaded)
    kinds = sorted({type(c).__name__ for c in new_layers(loaded.model)})
    return {
        "bench": "reuse",
        "family": name,
        "caches": kinds,
        "trimmable": pair.cache.trimmable,
        **shares,
        "back_to_back": back,
        "decode_kv": "kept" if kept_replies else "re-prefilled",
        "reprefilled_per_turn": again,
        "cold_ttft_vs_mlx_lm": _cold_ttft_vs_mlx_lm(loaded, block_size),
        "kept_bytes_per_token": round(kept, 1),
        "model_kv_bytes_per_token": model_kv,
        "bytes_ratio": round(kept / model_kv, 3) if model_kv else None,
        "equal_to_no_cache": pair.equal,
    }


def _reprefill_goal(row: dict[str, Any], full: dict[str, Any], block_size: int) -> int:
    """The most a family may re-prefill over turns 2-4 back to back: what full attention
    does where its replies are kept as decoded; where the probe refused that (this
    device computes its decode steps otherwise than prefill), each turn's last partial
    block of the reply, which only a canonical prefill of it can give."""
    if row["decode_kv"] == "kept":
        return int(sum(full["reprefilled_per_turn"]))
    return (block_size - 1) * len(row["reprefilled_per_turn"])


def run(model: str | None, block_size: int) -> list[dict[str, Any]]:
    """One row per family (and `model`, when given), then the summary row with the goals."""
    embedded = load()
    vocab = int(embedded.config.get("vocab_size") or len(embedded.tokenizer.vocab))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxcache-reuse-") as tmp:
        root = Path(tmp)
        for name, config in FAMILIES.items():
            # A window of two blocks at least: a sliding layer holds no block longer than its
            # window, so a reply's blocks are kept as decoded only where one fits in it (a
            # real model's window is hundreds of tokens; the probe refuses a smaller one).
            window = config.get("sliding_window")
            overrides = {} if window is None else {"sliding_window": max(window, 2 * block_size)}
            folder = build(
                root / "models" / name, embedded.path, config, vocab_size=vocab, **overrides
            )
            rows.append(_family(name, load(str(folder)), root, block_size, vocab))
        if model is not None:
            rows.append(_family(model, load(model), root, block_size, vocab))
    full = next(r for r in rows if r["family"] == REFERENCE)
    work = ("chat_fork", "half_shared", "same_twice", "back_to_back")
    failures = [
        f"{r['family']}: {w} {r[w]} < 0.9 x {full[w]}"
        for r in rows
        for w in work
        if r[w] < 0.9 * full[w]
    ]
    failures += [
        f"{r['family']}: replies differ from --no-cache" for r in rows if not r["equal_to_no_cache"]
    ]
    failures += [
        f"{r['family']}: re-prefilled {r['reprefilled_per_turn']} tokens on turns 2-4 back to "
        f"back, full attention {full['reprefilled_per_turn']}"
        for r in rows
        if sum(r["reprefilled_per_turn"]) > _reprefill_goal(r, full, block_size)
    ]
    failures += [
        f"{r['family']}: cold TTFT {r['cold_ttft_vs_mlx_lm']} x mlx-lm's"
        for r in rows[len(FAMILIES) :]
        if r["cold_ttft_vs_mlx_lm"] > GOAL_COLD_TTFT
    ]
    failures += [
        f"{r['family']}: {r['bytes_ratio']} x the model's KV per token"
        for r in rows
        if r["bytes_ratio"] is not None and r["bytes_ratio"] > 1.5
    ]
    summary = {
        "bench": "reuse",
        "block_size": block_size,
        "families": len(rows),
        "failures": failures,
        "pass": not failures,
    }
    return [*rows, summary]

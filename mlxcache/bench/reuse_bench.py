"""`mlxcache bench reuse`: how much of a shared prefix each model family resumes.

Every family of `bench.families` (tiny random instances of mlx-lm's classes, with the
embedded model's tokenizer) and optionally a real model run three workloads on token ids:
(a) a 4-turn chat with warm-ahead after each reply, then a fork that edits turn 3;
(b) two prompts sharing half their tokens; (c) the same prompt twice. Per family: the
share of prompt tokens resumed on each, against full attention (qwen3) on the same
workload, bytes kept per token against the KV the model computes per token, and whether
every reply equals a `--no-cache` run. Goals: at least 0.9 x full attention's share on
each workload, at most 1.5 x the model's KV per token, no reply different from cold.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.bench.families import FAMILIES, build
from mlxcache.cache.base import NoCache
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel, load
from mlxcache.sampling import SamplingParams
from mlxcache.types import new_layers

PARAMS = SamplingParams(max_tokens=8)
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
    model_kv = _kv_bytes_per_token(loaded)
    kinds = sorted({type(c).__name__ for c in new_layers(loaded.model)})
    return {
        "bench": "reuse",
        "family": name,
        "caches": kinds,
        "trimmable": pair.cache.trimmable,
        **shares,
        "kept_bytes_per_token": round(kept, 1),
        "model_kv_bytes_per_token": model_kv,
        "bytes_ratio": round(kept / model_kv, 3) if model_kv else None,
        "equal_to_no_cache": pair.equal,
    }


def run(model: str | None, block_size: int) -> list[dict[str, Any]]:
    """One row per family (and `model`, when given), then the summary row with the goals."""
    embedded = load()
    vocab = int(embedded.config.get("vocab_size") or len(embedded.tokenizer.vocab))
    rows = []
    with tempfile.TemporaryDirectory(prefix="mlxcache-reuse-") as tmp:
        root = Path(tmp)
        for name, config in FAMILIES.items():
            folder = build(root / "models" / name, embedded.path, config, vocab_size=vocab)
            rows.append(_family(name, load(str(folder)), root, block_size, vocab))
        if model is not None:
            rows.append(_family(model, load(model), root, block_size, vocab))
    full = next(r for r in rows if r["family"] == REFERENCE)
    work = ("chat_fork", "half_shared", "same_twice")
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

"""`mlxcache bench decode`: our decode loop against `mlx_lm.stream_generate`, interleaved.

Same model, prompt, token count and greedy sampling; rounds alternate between the two so
machine noise hits both alike. The figure of merit is the ratio of median tokens/s.
"""

from __future__ import annotations

import statistics
from typing import Any

from mlxcache.engine import Engine, Request
from mlxcache.model import load
from mlxcache.sampling import SamplingParams
from mlxcache.types import as_module, as_wrapper

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _ours(engine: Engine, ids: list[int], tokens: int) -> float:
    # No stop tokens: both sides generate exactly `tokens` tokens.
    result = engine.complete(
        Request(ids, SamplingParams(max_tokens=tokens), stop_tokens=frozenset())
    )
    return result.stats.decode_tps


def _mlx_lm(engine: Engine, ids: list[int], tokens: int) -> float:
    from mlx_lm import stream_generate

    tokenizer = as_wrapper(engine.loaded.tokenizer)
    model = as_module(engine.model)
    responses = list(stream_generate(model, tokenizer, ids, max_tokens=tokens))
    return float(responses[-1].generation_tps)


def run(
    model: str | None = None, tokens: int = 32, rounds: int = 3, adapter: str | None = None
) -> dict[str, Any]:
    """Median decode tokens/s of both loops over `rounds` interleaved rounds, and their ratio
    (`adapter`: both run the model with it, mlx-lm's loop on the same module)."""
    engine = Engine(load(model, adapter=adapter))
    ids = engine.encoder.encode(PROMPT)
    _ours(engine, ids, 4)  # warm up kernels and allocator for both
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(_ours(engine, ids, tokens))
        theirs.append(_mlx_lm(engine, ids, tokens))
    ratio = statistics.median(ours) / statistics.median(theirs)
    return {
        "bench": "decode",
        "tokens": tokens,
        "rounds": rounds,
        "ours_tps": round(statistics.median(ours), 3),
        "mlx_lm_tps": round(statistics.median(theirs), 3),
        "ratio": round(ratio, 4),
        "goal": 0.97,
        "pass": ratio >= 0.97,
    }

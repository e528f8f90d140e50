"""`mlxcache bench json`: what JSON mode costs, and what the prompt cache saves a batch.

1. Decode tokens/s of JSON mode against plain generation, same model, prompt and token
   count, rounds interleaved so machine noise hits both alike (goal: ratio >= 0.95). The
   schema keeps the reply inside one long string, so both sides decode `tokens` tokens.
2. Seconds per request of an N-line JSONL batch whose lines share a long instruction
   prefix, with the prompt cache and without; the outputs must be the same bytes.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.modes.batch import read_input
from mlxcache.modes.json_mode import JsonTask, plan_batch, request, run_batch
from mlxcache.runtime import open_engine
from mlxcache.sampling import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper."
# A string the grammar cannot close before `tokens` tokens: decoding never ends early.
LONG_STRING = {
    "type": "object",
    "properties": {"story": {"type": "string", "minLength": 4000}},
    "required": ["story"],
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
COUNTRIES = ["France", "Italy", "Spain", "Germany", "Japan", "Egypt", "Peru", "Canada"]
INSTRUCTIONS = " ".join(
    [
        "You are a careful geography assistant working for an atlas publisher.",
        "Every answer is checked by an editor, so be exact and never guess.",
        "Use the official English name of each place, without articles or comments.",
        "When a country has several capitals, give the seat of government.",
        "Do not add the country, region, population or any other detail to the answer.",
    ]
    * 3
)


def _tps(engine: Engine, ids: list[int], tokens: int, constrained: bool) -> float:
    params = SamplingParams(max_tokens=tokens)
    if constrained:
        req = request(engine, ids, JsonTask.create(LONG_STRING), params)
    else:  # no stop tokens: exactly `tokens` tokens, like the constrained side
        req = Request(ids, params, stop_tokens=frozenset())
    result = engine.complete(req)
    if result.stats.generated_tokens != tokens:
        raise RuntimeError(f"expected {tokens} tokens, got {result.stats.generated_tokens}")
    return result.stats.decode_tps


def decode_ratio(engine: Engine, tokens: int, rounds: int) -> dict[str, Any]:
    """Median decode tokens/s of JSON mode and plain generation over interleaved rounds."""
    ids = engine.encoder.encode_chat([{"role": "user", "content": PROMPT}])
    _tps(engine, ids, 4, constrained=True)  # warm up kernels, allocator, llguidance tokenizer
    plain, constrained = [], []
    for _ in range(rounds):
        plain.append(_tps(engine, ids, tokens, constrained=False))
        constrained.append(_tps(engine, ids, tokens, constrained=True))
    ratio = statistics.median(constrained) / statistics.median(plain)
    return {
        "plain_tps": round(statistics.median(plain), 3),
        "json_tps": round(statistics.median(constrained), 3),
        "ratio": round(ratio, 4),
        "ratio_goal": 0.95,
        "ratio_pass": ratio >= 0.95,
    }


def _batch(engine: Engine, task: JsonTask, folder: Path, name: str, tokens: int) -> dict[str, Any]:
    lines = read_input(folder / "in.jsonl")
    params = SamplingParams(max_tokens=tokens)
    plan = plan_batch(engine, task, lines, folder / "in.jsonl", folder / f"{name}.jsonl", params)
    summary = run_batch(engine, task, plan)
    records = [json.loads(x) for x in (folder / f"{name}.jsonl").read_text().splitlines()]
    return {
        "s_per_request": round(summary.seconds / max(summary.ran, 1), 3),
        "cached_tokens": summary.cached_tokens,
        "prompt_tokens": summary.prompt_tokens,
        "outputs": [json.dumps(r["output"]) for r in records],
    }


def batch_speedup(
    model: str | None, lines: int, block_size: int, tokens: int = 12
) -> dict[str, Any]:
    """Time per request of `lines` requests sharing INSTRUCTIONS, cached vs not."""
    task = JsonTask.create(CITY, INSTRUCTIONS)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prompts = [f"What is the capital of {COUNTRIES[i % len(COUNTRIES)]}?" for i in range(lines)]
        (folder / "in.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        # Memory tier only: a disk tier left by an earlier run would flatter the cached side.
        cached = open_engine(model, CacheConfig(block_size=block_size, disk_bytes=0))
        with_cache = _batch(cached, task, folder, "cached", tokens)
        fresh = open_engine(model, CacheConfig(enabled=False, block_size=block_size))
        without = _batch(fresh, task, folder, "fresh", tokens)
    speedup = without["s_per_request"] / max(with_cache["s_per_request"], 1e-9)
    return {
        "lines": lines,
        "block_size": block_size,
        "prefix_tokens": len(fresh.encoder.encode_chat(task.messages("")[:1])),
        "cache_s_per_request": with_cache["s_per_request"],
        "no_cache_s_per_request": without["s_per_request"],
        "speedup": round(speedup, 3),
        "cached_tokens": with_cache["cached_tokens"],
        "prompt_tokens": with_cache["prompt_tokens"],
        "same_outputs": with_cache["outputs"] == without["outputs"],
    }


def run(
    model: str | None = None,
    tokens: int = 32,
    rounds: int = 3,
    lines: int = 6,
    block_size: int = 64,
) -> dict[str, Any]:
    """Both measurements as one JSON-able dict (the CLI prints it as one line).

    Args:
        model: model spec (default: the embedded SmolLM2).
        tokens: tokens decoded per round of the tokens/s comparison.
        rounds: interleaved rounds of each side.
        lines: batch size of the cache comparison (the issue's Metal figure is 50).
        block_size: cache block length; the shared prefix must span at least one block.
    """
    engine = open_engine(model, CacheConfig(enabled=False))
    result: dict[str, Any] = {"bench": "json", "tokens": tokens, "rounds": rounds}
    result.update(decode_ratio(engine, tokens, rounds))
    result.update(batch_speedup(model, lines, block_size))
    return result

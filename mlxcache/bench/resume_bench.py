"""`mlxcache bench resume`: time to first token with the prompt cache vs without, same run.

Four figures, each against its baseline measured beside it:
- a growing multi-turn chat: warm TTFT vs (restore + prefill of the non-reused tokens);
- a fresh cache instance (empty memory) resuming the chat from the disk tier vs cold;
- a second process reusing a long shared prefix (default ~1.5k tokens) from disk vs the
  first, cold process;
- bytes stored for a forked conversation vs the bytes of its unique tokens.

The chat stays short (this CPU prefills ~10 tokens/s); `--turns` grows it on faster machines.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel, load
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams

TURN = "Tell me one more short fact about the sea, the sky, and the mountains, please."
PARAMS = SamplingParams(max_tokens=4)


def _chat(
    warm: Engine, cold: Engine, turns: int
) -> tuple[list[dict[str, Any]], list[float], list[dict[str, str]]]:
    """A growing chat, each turn warm and cold: per-turn rows, warm/expected ratios, messages."""
    messages: list[dict[str, str]] = []
    ratios, rows = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{TURN} ({turn + 1})"})
        ids = warm.encoder.encode_chat(messages)
        w = warm.complete(Request(ids, PARAMS)).stats
        c = cold.complete(Request(ids, PARAMS)).stats
        rows.append(
            {
                "prompt": c.prompt_tokens,
                "cached": w.cached_tokens,
                "warm_ttft": round(w.ttft_s, 3),
                "cold_ttft": round(c.ttft_s, 3),
            }
        )
        if turn:  # turn 0 has nothing to resume from
            expected = w.restore_s + c.ttft_s * w.prefilled_tokens / c.prompt_tokens
            ratios.append(w.ttft_s / expected)
        messages.append({"role": "assistant", "content": "A fact."})
    return rows, ratios, messages


def _fork_bytes(loaded: LoadedModel, base: list[dict[str, str]], block_size: int) -> float:
    """Bytes stored for two branches off one prefix, over the bytes of their unique tokens."""
    cache = make_cache(loaded, CacheConfig(block_size=block_size, disk_bytes=0))
    forked = Engine(loaded, cache)
    unique: set[tuple[int, ...]] = set()
    for branch in ("rivers", "deserts"):
        ids = forked.encoder.encode_chat(
            [*base, {"role": "user", "content": f"Now tell me about {branch}."}]
        )
        forked.complete(Request(ids, PARAMS))
        kept = len(ids) // block_size * block_size
        unique.update(tuple(ids[:i]) for i in range(1, kept + 1))
    report = cache.report()
    return float(report["mem_bytes"] / (len(unique) * report["kv_bytes_per_token"]))


def _in_process(
    model: str | None, directory: Path, block_size: int, messages: list[dict[str, str]]
) -> dict[str, Any]:
    """Stats of one request run by a new process on `directory`."""
    path = directory / "messages.json"
    path.write_text(json.dumps(messages))
    argv = [
        sys.executable,
        "-m",
        "mlxcache.bench.child",
        model or "",
        str(directory),
        str(block_size),
        str(path),
    ]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    stats: dict[str, Any] = json.loads(out.stdout)
    return stats


def _second_process(model: str | None, prefix_tokens: int, block_size: int) -> dict[str, Any]:
    """A process keeps a long shared prefix (cold); a second one reuses it from disk."""
    # ~8.6 tokens per rule with the SmolLM2 tokenizer
    words = " ".join(f"Rule {i}: answer plainly." for i in range(prefix_tokens * 10 // 86 + 1))
    with tempfile.TemporaryDirectory(prefix="mlxcache-bench-") as tmp:
        first = _in_process(
            model,
            Path(tmp),
            block_size,
            [{"role": "system", "content": words}, {"role": "user", "content": "Name a fruit."}],
        )
        second = _in_process(
            model,
            Path(tmp),
            block_size,
            [{"role": "system", "content": words}, {"role": "user", "content": "Name a color."}],
        )
    return {
        "prefix_prompt_tokens": first["prompt_tokens"],
        "first_process_ttft": round(first["ttft_s"], 3),
        "second_process_ttft": round(second["ttft_s"], 3),
        "second_process_cached": second["cached_tokens"],
        "second_vs_first": round(second["ttft_s"] / first["ttft_s"], 3),
    }


def run(
    model: str | None = None, turns: int = 4, block_size: int = 16, prefix_tokens: int = 1500
) -> dict[str, Any]:
    """Run the three measurements; context grows by ~`turns` x 25 tokens (slow CPUs: keep small)."""
    loaded = load(model)
    cold = Engine(loaded, make_cache(loaded, CacheConfig(enabled=False, block_size=block_size)))
    with tempfile.TemporaryDirectory(prefix="mlxcache-bench-") as tmp:
        config = CacheConfig(block_size=block_size, directory=Path(tmp))
        warm = Engine(loaded, make_cache(loaded, config))
        rows, ratios, messages = _chat(warm, cold, turns)
        # A new cache instance: memory empty, the disk tier holds the conversation's blocks.
        ids = warm.encoder.encode_chat(messages)
        reopened = Engine(loaded, make_cache(loaded, config))
        disk = reopened.complete(Request(ids, PARAMS)).stats
    fresh = cold.complete(Request(ids, PARAMS)).stats
    stored_ratio = _fork_bytes(loaded, messages[:-2], block_size)
    median = statistics.median(ratios) if ratios else float("inf")
    result: dict[str, Any] = {
        "bench": "resume",
        "turns": rows,
        "warm_vs_expected_median": round(median, 3),
        "disk_ttft": round(disk.ttft_s, 3),
        "cold_ttft": round(fresh.ttft_s, 3),
        "disk_cached_tokens": disk.cached_tokens,
        "disk_vs_cold": round(disk.ttft_s / fresh.ttft_s, 3),
        "stored_vs_unique_bytes": round(stored_ratio, 3),
        **_second_process(model, prefix_tokens, block_size),
        "goals": {
            "warm_vs_expected": 1.2,
            "disk_vs_cold": 0.25,
            "second_vs_first": 0.25,
            "stored_vs_unique_bytes": 1.2,
        },
    }
    result["pass"] = (
        median <= 1.2
        and disk.ttft_s / fresh.ttft_s <= 0.25
        and result["second_vs_first"] <= 0.25
        and stored_ratio <= 1.2
    )
    return result

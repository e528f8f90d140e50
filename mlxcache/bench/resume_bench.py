"""`mlxcache bench resume`: time to first token with the prompt cache vs without, same run.

Three figures, each against its baseline measured beside it:
- a growing multi-turn chat: warm TTFT vs (restore + prefill of the non-reused tokens);
- a fresh cache instance (empty memory) resuming a shared prefix from the disk tier vs cold;
- bytes stored for a forked conversation vs the bytes of its unique tokens.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.model import load
from mlxcache.sampling import SamplingParams

TURN = "Tell me one more short fact about the sea, the sky, and the mountains, please."
PARAMS = SamplingParams(max_tokens=4)


def run(model: str | None = None, turns: int = 4, block_size: int = 16) -> dict[str, Any]:
    """Run the three measurements; context grows by ~`turns` x 25 tokens (slow CPUs: keep small)."""
    loaded = load(model)
    root = Path(tempfile.mkdtemp(prefix="mlxcache-bench-"))
    config = CacheConfig(block_size=block_size, directory=root)
    warm = Engine(loaded, PromptCache(loaded.model, loaded.key, config, root=root / "kv"))
    cold = Engine(loaded, block_size=block_size)
    messages: list[dict[str, str]] = []
    ratios, rows = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{TURN} ({turn + 1})"})
        ids = warm.encode_chat(messages)
        w = warm.complete(Request(ids, PARAMS)).stats
        c = cold.complete(Request(ids, PARAMS)).stats
        expected = w.restore_s + c.ttft_s * w.prefilled_tokens / c.prompt_tokens
        rows.append(
            {
                "prompt": c.prompt_tokens,
                "cached": w.cached_tokens,
                "warm_ttft": round(w.ttft_s, 3),
                "cold_ttft": round(c.ttft_s, 3),
            }
        )
        if turn:  # turn 0 has nothing to resume from
            ratios.append(w.ttft_s / expected)
        messages.append({"role": "assistant", "content": "A fact."})

    # A new cache instance: memory empty, the disk tier holds the conversation's blocks.
    ids = warm.encode_chat(messages)
    reopened = Engine(loaded, PromptCache(loaded.model, loaded.key, config, root=root / "kv"))
    disk = reopened.complete(Request(ids, PARAMS)).stats
    fresh = cold.complete(Request(ids, PARAMS)).stats

    # A forked conversation: two branches off one prefix share its blocks.
    fork_cache = PromptCache(
        loaded.model, loaded.key, CacheConfig(block_size=block_size, disk_bytes=0)
    )
    forked = Engine(loaded, fork_cache)
    base = messages[:-2]
    unique: set[tuple[int, ...]] = set()
    for branch in ("rivers", "deserts"):
        bids = forked.encode_chat(
            [*base, {"role": "user", "content": f"Now tell me about {branch}."}]
        )
        forked.complete(Request(bids, PARAMS))
        kept = len(bids) // block_size * block_size
        unique.update(tuple(bids[:i]) for i in range(1, kept + 1))
    report = fork_cache.report()
    stored_ratio = report["mem_bytes"] / (len(unique) * report["kv_bytes_per_token"])
    result = {
        "bench": "resume",
        "turns": rows,
        "warm_vs_expected_median": round(statistics.median(ratios), 3) if ratios else None,
        "disk_ttft": round(disk.ttft_s, 3),
        "cold_ttft": round(fresh.ttft_s, 3),
        "disk_cached_tokens": disk.cached_tokens,
        "disk_vs_cold": round(disk.ttft_s / fresh.ttft_s, 3),
        "stored_vs_unique_bytes": round(stored_ratio, 3),
        "goals": {"warm_vs_expected": 1.2, "disk_vs_cold": 0.25, "stored_vs_unique_bytes": 1.2},
    }
    result["pass"] = bool(
        ratios
        and statistics.median(ratios) <= 1.2
        and result["disk_vs_cold"] <= 0.25
        and stored_ratio <= 1.2
    )
    return result

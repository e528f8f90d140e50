"""`mlxcache bench distributed`: one model over 1, 2 and 3 local ranks (MLX's ring backend
over loopback, as `mlx.launch -n N --backend ring` runs it).

Each run is a fresh cache directory and three requests: a prompt cold, the same prompt
again (resumed), then another prompt sharing its system prompt. Per number of ranks:
TTFT cold and resumed, decode tokens/s, each against the single process (the baseline),
and every rank's cache counters (rank 0 decides every lookup, so they must agree). On
this machine's CPU the ranks share two cores: the figures measure correctness and
overhead (on Macs the point is memory: a model bigger than one machine). Goals: every
run resumes its repeated prompt exactly (the reply equals the cold one), and every
rank's counters equal rank 0's. A model that cannot be split in N (its heads, its
layers) is reported as skipped for N, with the reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mlxcache.launch import local_ranks

SYSTEM = "You are a concise assistant. Answer in one short sentence."
QUESTIONS = ("What is the capital of France?", "What is the largest planet?")
_TIMEOUT_S = 1800
_COUNTERS = ("hits", "misses", "cached_tokens")


def run(model: str | None, sizes: tuple[int, ...], block_size: int, tokens: int) -> dict[str, Any]:
    """The bench's JSON result (see the module's doc)."""
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mlxcache-bench-dist-") as tmp:
        for size in sizes:
            folder = Path(tmp) / f"ranks{size}"
            folder.mkdir()
            runs[str(size)] = _launch(model, size, folder, block_size, tokens)
    base = runs.get("1", {})
    for row in runs.values():
        if "skipped" in row or "skipped" in base:
            continue
        row["vs_one_process"] = {
            name: round(row[name] / base[name], 3) if base[name] else None
            for name in ("ttft_cold_s", "ttft_resumed_s", "decode_tps")
        }
    ran = [row for row in runs.values() if "skipped" not in row]
    goals = {
        "resumed_equals_cold": all(row["resumed_equals_cold"] for row in ran),
        "ranks_agree": all(row["ranks_agree"] for row in ran),
        "some_run": bool(ran),
    }
    return {"bench": "distributed", "model": model or "smollm2-135m", "ranks": runs, "goals": goals}


def _launch(
    model: str | None, size: int, folder: Path, block_size: int, tokens: int
) -> dict[str, Any]:
    argv = [sys.executable, "-m", "mlxcache.bench.distributed_bench", model or "", str(folder)]
    argv += [str(block_size), str(tokens)]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    if size == 1:  # the baseline: one process, no launcher
        procs = [subprocess.Popen(argv, text=True, **pipes)]
    else:
        procs = local_ranks(argv, size, folder / "hosts.json", **pipes)
    try:
        outs = [p.communicate(timeout=_TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            p.kill()  # no-op for one that has exited
    errors = [
        err.strip().splitlines()[-1]
        for p, (_, err) in zip(procs, outs, strict=True)
        if p.returncode and err.strip()
    ]
    if any(p.returncode for p in procs):
        return {"skipped": errors[0] if errors else "a rank failed"}
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    lead = reports[0]
    counters = [{k: r["cache"][k] for k in _COUNTERS} for r in reports]
    return {
        "ttft_cold_s": lead["ttft_cold_s"],
        "ttft_resumed_s": lead["ttft_resumed_s"],
        "decode_tps": lead["decode_tps"],
        "cached_tokens": lead["cached_tokens"],
        "resumed_equals_cold": lead["resumed_equals_cold"],
        "cache_per_rank": counters,
        "ranks_agree": all(c == counters[0] for c in counters),
        "wall_s": lead["wall_s"],
    }


def child(model: str, directory: str, block_size: str, tokens: str) -> None:
    """One rank (or the single process): rank 0 runs the requests and prints its timings,
    every rank prints its cache counters (one JSON line each)."""
    from mlxcache.config import CacheConfig
    from mlxcache.distributed import follow
    from mlxcache.engine import Request
    from mlxcache.errors import MlxcacheError
    from mlxcache.runtime import open_engine
    from mlxcache.sampling import SamplingParams

    config = CacheConfig(block_size=int(block_size), directory=Path(directory) / "cache")
    try:
        engine = open_engine(model or None, config, on_rank_lost=_lost)
    except MlxcacheError as exc:  # e.g. a model that cannot be split in this many ranks
        _say(str(exc))
        sys.exit(2)
    if engine.ranks is not None and not engine.ranks.leader:
        follow(engine)
        print(json.dumps({"cache": engine.cache.report()}))
        return
    params = SamplingParams(max_tokens=int(tokens))
    start = time.perf_counter()

    def ask(question: str) -> Any:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return engine.complete(Request(engine.encoder.encode_chat(messages), params))

    cold, again, other = ask(QUESTIONS[0]), ask(QUESTIONS[0]), ask(QUESTIONS[1])
    wall = time.perf_counter() - start
    if engine.ranks is not None:
        engine.ranks.close()
    report = {
        "ttft_cold_s": round(cold.stats.ttft_s, 4),
        "ttft_resumed_s": round(again.stats.ttft_s, 4),
        "decode_tps": round(
            sum(r.stats.generated_tokens for r in (cold, again, other))
            / sum(r.stats.decode_s for r in (cold, again, other)),
            3,
        ),
        "cached_tokens": [r.stats.cached_tokens for r in (cold, again, other)],
        "resumed_equals_cold": again.tokens == cold.tokens and again.stats.cached_tokens > 0,
        "wall_s": round(wall, 3),
        "cache": engine.cache.report(),
    }
    print(json.dumps(report))


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _lost(message: str | None) -> None:
    if message is not None:
        _say(message)
    os._exit(1)  # this rank may wait forever for the one that is gone


if __name__ == "__main__":
    child(*sys.argv[1:])

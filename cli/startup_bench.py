"""`mlxcache bench startup`: wall time of the commands that load no model, vs `python -c pass`.

Each command runs in a fresh process, as a user or a script runs it; the rounds are
interleaved so that machine noise hits every command alike. The goal is judged on each
command's fastest round (the time on a quiet machine; the median is reported beside it).
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_S = 0.5
SERVER_GOAL_S = 1.0
"""A short generate sent to a running server (`--server`): no model load, a memory hit."""
_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def commands(schema: Path, cache_dir: Path | None) -> dict[str, list[str]]:
    """The fast commands, by name: each must answer without importing mlx_lm (a model
    file that is not there is refused before)."""
    cli = [sys.executable, "-m", "mlxcache_cli"]
    where = [] if cache_dir is None else ["--cache-dir", str(cache_dir)]
    return {
        "--help": [*cli, "--help"],
        "--version": [*cli, "--version"],
        "typo": [*cli, "genrate"],
        "json --check": [*cli, "json", "--check", "--schema", str(schema)],
        "cache ls": [*cli, "cache", "ls", *where],
        "models ls": [*cli, "models", "ls", *where],
        "missing model": [*cli, "generate", "-m", str(schema.with_name("missing.gguf")), "hi"],
    }


def _time(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one run: CPU time barely moves when other
    work shares the machine, so it tells a slow start from a busy machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def through(url: str, model: str) -> list[str]:
    """A short generate of `model` sent to the server at `url`, with the block size it
    runs (so that it is accepted, when it runs `model`: `mlxcache.remote.differences`)."""
    from mlxcache.remote import Server

    with Server(url) as server:
        found = server.card()["mlxcache"]
    model_args = ["-m", model, "--block-size", str(found["block_size"])]
    return [
        sys.executable,
        "-m",
        "mlxcache_cli",
        "generate",
        "-n",
        "4",
        *model_args,
        "--server",
        url,
        "hi",
    ]


def run(
    rounds: int,
    cache_dir: Path | None = None,
    server: str | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """Min and median wall seconds per command over `rounds`, the least CPU seconds, and
    ratios (fastest wall time) to `python -c pass`; with `server`, a short generate of
    `model` (default: the embedded one) through it (the same prompt each round: after the
    first, a memory-tier hit)."""
    from mlxcache.model.loader import default_spec

    with tempfile.TemporaryDirectory(prefix="mlxcache-startup-") as work:
        schema = Path(work) / "schema.json"
        schema.write_text(json.dumps(_SCHEMA))
        runs = {"python -c pass": [sys.executable, "-c", "pass"], **commands(schema, cache_dir)}
        if server is not None:
            runs["generate --server"] = through(server, model or default_spec())
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
        for argv in runs.values():  # once untimed: the first run fills the OS file cache
            _time(argv)
        for _ in range(rounds):
            for name, argv in runs.items():
                times[name].append(_time(argv))
    base = min(wall for wall, _ in times.pop("python -c pass"))
    rows = {
        name: {
            "min_s": round(min(wall for wall, _ in t), 3),
            "median_s": round(statistics.median(wall for wall, _ in t), 3),
            "cpu_s": round(min(cpu for _, cpu in t), 3),
            "ratio": round(min(wall for wall, _ in t) / base, 1),
        }
        for name, t in times.items()
    }
    limit = {name: SERVER_GOAL_S if name == "generate --server" else GOAL_S for name in rows}
    goals = {f"{name}_le_{limit[name]}s": row["min_s"] <= limit[name] for name, row in rows.items()}
    return {
        "bench": "startup",
        "rounds": rounds,
        "python_s": round(base, 3),
        "commands": rows,
        "goals": goals,
        "pass": all(goals.values()),
    }

"""`mlxcache bench startup`: wall time of the commands that load no model, vs `python -c pass`.

Each command runs in a fresh process, as a user or a script runs it; the rounds are
interleaved so that machine noise hits every command alike. The goal is judged on each
command's fastest round (the time on a quiet machine; the median is reported beside it).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_S = 0.5
_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


def commands(schema: Path, cache_dir: Path | None) -> dict[str, list[str]]:
    """The fast commands, by name: each must answer without importing mlx_lm."""
    cli = [sys.executable, "-m", "mlxcache_cli"]
    where = [] if cache_dir is None else ["--cache-dir", str(cache_dir)]
    return {
        "--help": [*cli, "--help"],
        "--version": [*cli, "--version"],
        "typo": [*cli, "genrate"],
        "json --check": [*cli, "json", "--check", "--schema", str(schema)],
        "cache ls": [*cli, "cache", "ls", *where],
        "models ls": [*cli, "models", "ls", *where],
    }


def _wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False)
    return time.perf_counter() - start


def run(rounds: int, cache_dir: Path | None = None) -> dict[str, Any]:
    """Min and median wall seconds per command over `rounds`, and ratios to `python -c pass`."""
    with tempfile.TemporaryDirectory(prefix="mlxcache-startup-") as work:
        schema = Path(work) / "schema.json"
        schema.write_text(json.dumps(_SCHEMA))
        runs = {"python -c pass": [sys.executable, "-c", "pass"], **commands(schema, cache_dir)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        for argv in runs.values():  # once untimed: the first run fills the OS file cache
            _wall(argv)
        for _ in range(rounds):
            for name, argv in runs.items():
                times[name].append(_wall(argv))
    base = min(times.pop("python -c pass"))
    rows = {
        name: {
            "min_s": round(min(t), 3),
            "median_s": round(statistics.median(t), 3),
            "ratio": round(min(t) / base, 1),
        }
        for name, t in times.items()
    }
    goals = {f"{name}_le_{GOAL_S}s": row["min_s"] <= GOAL_S for name, row in rows.items()}
    return {
        "bench": "startup",
        "rounds": rounds,
        "python_s": round(base, 3),
        "commands": rows,
        "goals": goals,
        "pass": all(goals.values()),
    }

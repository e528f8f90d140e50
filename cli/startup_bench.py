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


ONE_SHOT_GOAL = 0.5
"""A cached one-shot command's wall time, as a share of `mlx_lm.generate`'s on its prompt."""
_SENTENCE = "The cache keeps block {} of this prompt, and a later run resumes from it. "
_ANSWER = {"enum": ["cached", "cold"]}
"""The one-shot json's schema: a reply of a few tokens, complete on any model."""


def one_shot(rounds: int, folder: Path, work: Path) -> dict[str, Any]:
    """A one-shot `generate` (raw, 1 token) and `json` (with a schema) of the mlx-lm model
    `folder` on a ~500-token prompt, fully cached by an untimed first run, against
    `python -m mlx_lm generate` on the same raw prompt (1 token), each a fresh process,
    rounds interleaved: fastest wall seconds, the prompt's tokens, ratios to mlx_lm's."""
    prompt = "".join(_SENTENCE.format(i) for i in range(32))
    schema = work / "schema.json"
    schema.write_text(json.dumps(_ANSWER))
    model = ["-m", str(folder), "--cache-dir", str(work / "cache")]
    cli = [sys.executable, "-m", "mlxcache_cli"]
    runs = {
        "generate": [*cli, "generate", *model, "--raw", "-n", "1", "--json", prompt],
        "json": [*cli, "json", *model, "--schema", str(schema), "-n", "16", prompt],
        "mlx_lm.generate": [
            *(sys.executable, "-m", "mlx_lm", "generate", "--model", str(folder)),
            *("--prompt", prompt, "--max-tokens", "1", "--ignore-chat-template"),
        ],
    }
    first = _checked(runs["generate"])  # untimed: caches the prompt, as the next line
    _checked(runs["json"])
    walls: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, argv in runs.items():
            walls[name].append(_time(argv)[0])
    theirs = min(walls["mlx_lm.generate"])
    ratios = {name: round(min(walls[name]) / theirs, 3) for name in ("generate", "json")}
    goals = {f"{name}_le_{ONE_SHOT_GOAL}x": r <= ONE_SHOT_GOAL for name, r in ratios.items()}
    return {
        "prompt_tokens": json.loads(first)["stats"]["prompt_tokens"],
        "min_s": {name: round(min(w), 3) for name, w in walls.items()},
        "ratio_to_mlx_lm": ratios,
        "goals": goals,
    }


def _checked(argv: list[str]) -> str:
    """What `argv` prints on stdout.

    Raises:
        GenerationError: it failed (its last line on stderr).
    """
    from mlxcache.errors import GenerationError

    done = subprocess.run(
        argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL
    )
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise GenerationError(f"{' '.join(argv[2:4])} failed: {said}")
    return done.stdout


def run(
    rounds: int,
    cache_dir: Path | None = None,
    server: str | None = None,
    model: str | None = None,
    one_shot_rounds: int = 0,
) -> dict[str, Any]:
    """Min and median wall seconds per command over `rounds`, the least CPU seconds, and
    ratios (fastest wall time) to `python -c pass`; with `server`, a short generate of
    `model` (default: the embedded one) through it (the same prompt each round: after the
    first, a memory-tier hit); with `one_shot_rounds`, `one_shot` of `model` over as many
    rounds."""
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
    result: dict[str, Any] = {"bench": "startup", "rounds": rounds, "python_s": round(base, 3)}
    result["commands"] = rows
    if one_shot_rounds:
        from mlxcache.model.loader import model_folder

        with tempfile.TemporaryDirectory(prefix="mlxcache-one-shot-") as work:
            folder = model_folder(model or default_spec(), cache_dir)
            result["one_shot"] = one_shot(one_shot_rounds, folder, Path(work))
        goals |= result["one_shot"].pop("goals")
    return {**result, "goals": goals, "pass": all(goals.values())}

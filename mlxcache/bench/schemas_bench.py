"""`mlxcache bench schemas DIR`: how many real-world JSON Schemas JSON mode takes, and how fast.

Every `*.json` under DIR goes through the same check + grammar compile as `mlxcache json`,
lenient (the default) and `--strict` (the baseline). Reported: compile coverage, refusals
by kind, crashes (any exception other than a refusal: always a bug), compile time
p50/p99/max. With `generate`, the first N compiled schemas also run on a model, greedy,
counting valid / invalid / cut at the token limit. Goals: coverage >= 97%, 0 crashes,
p99 <= 1 s; of generated outputs none invalid, <= 20% at the limit.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from mlxcache.config import CacheConfig
from mlxcache.errors import GrammarError
from mlxcache.fileio import loads_json
from mlxcache.modes.json_mode import JsonTask, read_reply, request
from mlxcache.modes.schema import CompiledSchema, check_schema
from mlxcache.runtime import open_engine
from mlxcache.sampling import SamplingParams

PROMPT = "Write one realistic example document for this schema."
# Refusal kinds, by what their message says (first match wins).
KINDS = (
    ("not valid JSON Schema", "invalid schema"),
    ("$ref cycle", "$ref cycle"),
    ("Unimplemented keys", "unimplemented keyword"),
    ("Unknown format", "unknown format"),
    ("oneOf", "oneOf"),
    ("regex", "regex"),
    ("circular references", "recursive $ref with siblings"),
    ("does not exist", "unresolved $ref"),
    ("not present in a registry", "unresolved $ref"),
    ("Unsatisfiable", "unsatisfiable"),
    ("patternProperty", "overlapping patternProperties"),
    ("too large", "too large"),
    ("intersection stack", "allOf nested too deep"),
    ("integer range", "number range"),
    ("float range", "number range"),
)


def refusal_kind(message: str) -> str:
    """The kind of a refusal message (`KINDS`), "other" when none matches."""
    return next((kind for text, kind in KINDS if text in message), "other")


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def compile_all(files: list[Path], strict: bool) -> dict[str, Any]:
    """Compile every file; coverage, refusals by kind, crashes and compile times."""
    refused: Counter[str] = Counter()
    crashes: list[str] = []
    seconds: list[float] = []
    compiled: dict[Path, CompiledSchema] = {}
    for path in files:
        try:
            schema = loads_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            refused["unreadable"] += 1
            continue
        start = time.perf_counter()
        try:
            compiled[path] = check_schema(schema, strict=strict)
        except GrammarError as exc:
            refused[refusal_kind(str(exc))] += 1
        except Exception as exc:  # a crash is what this bench exists to find
            crashes.append(f"{path.name}: {type(exc).__name__}: {exc}"[:300])
        seconds.append(time.perf_counter() - start)
    seconds.sort()
    return {
        "compiled": compiled,
        "coverage": round(len(compiled) / max(len(files), 1), 4),
        "refused": dict(refused.most_common()),
        "crashes": crashes,
        "compile_ms": {
            "p50": round(1000 * _percentile(seconds, 0.5), 2),
            "p99": round(1000 * _percentile(seconds, 0.99), 2),
            "max": round(1000 * (seconds[-1] if seconds else 0.0), 2),
        },
    }


def generate(
    compiled: dict[Path, CompiledSchema], model: str | None, max_tokens: int
) -> dict[str, Any]:
    """Run each schema once (greedy); count valid, invalid and cut-off replies (naming
    the files of the last two)."""
    engine = open_engine(model, CacheConfig(enabled=False))
    counts: Counter[str] = Counter()
    errors: list[str] = []
    cut: list[str] = []
    params = SamplingParams(max_tokens=max_tokens)
    for path, item in compiled.items():
        task = JsonTask(item)
        ids = engine.encode_chat(task.messages(PROMPT))
        reply = read_reply(task, engine.complete(request(engine, ids, task, params)))
        if reply.error is None:
            counts["valid"] += 1
        elif reply.finish_reason == "length":
            counts["length"] += 1
            cut.append(path.name)
        else:
            counts["invalid"] += 1
            errors.append(f"{path.name}: {reply.error}"[:300])
    return {
        "valid": counts["valid"],
        "invalid": counts["invalid"],
        "length": counts["length"],
        "invalid_errors": errors,
        "length_files": cut,
    }


def run(
    folder: Path, generate_n: int = 0, model: str | None = None, max_tokens: int = 256
) -> dict[str, Any]:
    """The whole bench as one JSON-able dict (the CLI prints it as one line)."""
    files = sorted(folder.rglob("*.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # jsonschema warns about odd regexes in schemas
        lenient = compile_all(files, strict=False)
        strict = compile_all(files, strict=True)
    compiled: dict[Path, CompiledSchema] = lenient.pop("compiled")
    strict.pop("compiled")
    result: dict[str, Any] = {"bench": "schemas", "files": len(files), "compiled": len(compiled)}
    result.update(lenient)
    result["crash_count"] = len(lenient["crashes"])
    result["strict_coverage"] = strict["coverage"]
    result["strict_refused"] = strict["refused"]
    result["goals_pass"] = (
        lenient["coverage"] >= 0.97
        and not lenient["crashes"]
        and lenient["compile_ms"]["p99"] <= 1000
    )
    if generate_n:
        chosen = dict(list(compiled.items())[:generate_n])
        gen = generate(chosen, model, max_tokens)
        gen["goals_pass"] = gen["invalid"] == 0 and gen["length"] <= 0.2 * len(chosen)
        result["generate"] = gen
    return result

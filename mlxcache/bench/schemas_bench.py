"""`mlxcache bench schemas DIR`: how many real-world JSON Schemas JSON mode takes, and how fast.

Every `*.json` under DIR goes through the same check + grammar compile as `mlxcache json`,
lenient (the default) and `--strict` (the baseline). Reported: compile coverage, refusals
by kind, crashes (any exception other than a refusal: always a bug), compile time
p50/p99/max. With `generate`, the first N compiled schemas also run on a model, greedy,
counting valid / invalid / cut at the token limit; with `peer`, the same schemas and prompts
also run through a peer on the same model (`run_peer`). Goals: coverage >= 97%, 0 crashes,
p99 <= 1 s; of generated outputs none invalid and, with a peer, no more cut-offs than the
peer's.
"""

from __future__ import annotations

import json
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llguidance import LLMatcher

from mlxcache.config import CacheConfig
from mlxcache.constrain import grammar_error, processor_for
from mlxcache.errors import GenerationError, GrammarError
from mlxcache.events import Result, Stats
from mlxcache.fileio import loads_json
from mlxcache.model import LoadedModel
from mlxcache.modes.json_mode import JsonReply, JsonTask, read_reply, request
from mlxcache.modes.repeats import describe_loop
from mlxcache.modes.schema import CompiledSchema, check_schema, one_line
from mlxcache.runtime import open_engine
from mlxcache.sampling import SamplingParams
from mlxcache.types import as_module, as_wrapper

PROMPT = "Write one realistic example document for this schema."
PEERS = ("llguidance",)
"""Peers `generate` compares with. llguidance: mlx-lm's own loop (`stream_generate`, greedy)
masked by llguidance, the grammar built from the schema as given with llguidance's defaults.
Not outlines: it installs without torch, but its mlx-lm processors mask logits with a Metal
kernel, which MLX's CPU backend lacks ("[metal_kernel] No Metal back-end")."""
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


def outcome(reply: JsonReply | str) -> str:
    """valid, invalid, length (cut at the token limit) or refused (a peer's refusal: a str)."""
    if isinstance(reply, str):
        return "refused"
    if reply.error is None:
        return "valid"
    return "length" if reply.finish_reason == "length" else "invalid"


def how_it_ends(text: str) -> str:
    """The loop a cut-off reply was in (`describe_loop`), else its last 60 characters."""
    loop = describe_loop(text).removeprefix("; ")
    return loop or "ends " + json.dumps(text[-60:], ensure_ascii=False)


def tally(replies: dict[str, JsonReply]) -> dict[str, Any]:
    """Valid, invalid and cut-off replies by file name: the errors of the invalid ones, the
    files cut off and how each ends."""
    kinds = {name: outcome(reply) for name, reply in replies.items()}
    cut = [name for name, kind in kinds.items() if kind == "length"]
    return {
        "valid": sum(kind == "valid" for kind in kinds.values()),
        "invalid": sum(kind == "invalid" for kind in kinds.values()),
        "length": len(cut),
        "invalid_errors": [
            f"{name}: {replies[name].error}"[:300]
            for name, kind in kinds.items()
            if kind == "invalid"
        ],
        "length_files": cut,
        "length_ends": {name: how_it_ends(replies[name].text) for name in cut},
    }


def plain_grammar(schema: dict[str, Any]) -> str:
    """`schema`'s grammar the way llguidance builds it unasked: the schema as given, no
    keyword skipped, numbers unbounded, whitespace flexible."""
    return str(LLMatcher.grammar_from_json_schema(schema))


def run_peer(
    loaded: LoadedModel, task: JsonTask, ids: list[int], max_tokens: int
) -> JsonReply | str:
    """One reply of the llguidance peer (`PEERS`), checked as mlxcache's are (`read_reply`),
    or why llguidance refuses the schema."""
    from mlx_lm.generate import stream_generate

    grammar = plain_grammar(task.schema)
    problem = grammar_error(grammar)
    if problem is not None:
        return one_line(problem)
    try:
        processor = processor_for(loaded, grammar)
    except GrammarError as exc:
        return one_line(str(exc))
    pieces: list[str] = []
    tokens: list[int] = []
    finish, error = "length", None
    start = time.perf_counter()
    try:
        for response in stream_generate(
            as_module(loaded.model),
            as_wrapper(loaded.tokenizer),
            ids,
            max_tokens=max_tokens,
            logits_processors=[processor],
        ):
            pieces.append(response.text)
            tokens.append(response.token)
            finish = response.finish_reason or finish
    except GenerationError as exc:  # the mask allowed nothing, or the matcher failed
        finish, error = "error", str(exc)
    if finish == "stop":
        tokens.pop()  # the end-of-turn token
    stats = Stats(
        prompt_tokens=len(ids),
        generated_tokens=len(tokens),
        decode_s=time.perf_counter() - start,
    )
    return read_reply(task, Result("".join(pieces), tokens, finish, stats, error))


def generate(
    compiled: dict[Path, CompiledSchema],
    model: str | None,
    max_tokens: int,
    peer: str | None = None,
    on_reply: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run each schema once (greedy) and `tally` the replies; with `peer`, the same prompt
    ids also go through the peer (`run_peer`) on the same loaded model, and its tally (with
    the schemas it refused) is under "peer". `on_reply` gets one line per schema done (a
    run on a slow CPU takes minutes per schema)."""
    engine = open_engine(model, CacheConfig(enabled=False))
    params = SamplingParams(max_tokens=max_tokens)
    ours: dict[str, JsonReply] = {}
    theirs: dict[str, JsonReply] = {}
    refused: dict[str, str] = {}
    seconds = {"mlxcache": 0.0, "peer": 0.0}
    for i, (path, item) in enumerate(compiled.items(), 1):
        task = JsonTask(item)
        ids = engine.encoder.encode_chat(task.messages(PROMPT))
        start = time.perf_counter()
        ours[path.name] = read_reply(task, engine.complete(request(engine, ids, task, params)))
        seconds["mlxcache"] += time.perf_counter() - start
        line = f"{i}/{len(compiled)} {path.name}: mlxcache {outcome(ours[path.name])}"
        if peer is not None:
            start = time.perf_counter()
            reply = run_peer(engine.loaded, task, ids, max_tokens)
            seconds["peer"] += time.perf_counter() - start
            if isinstance(reply, str):
                refused[path.name] = reply
            else:
                theirs[path.name] = reply
            line += f", {peer} {outcome(reply)}"
        if on_reply is not None:
            on_reply(line)
    result = tally(ours)
    result["seconds"] = round(seconds["mlxcache"], 1)
    if peer is not None:
        result["peer"] = {
            "peer": peer,
            **tally(theirs),
            "refused": len(refused),
            "refused_errors": [f"{n}: {why}"[:300] for n, why in refused.items()],
            "seconds": round(seconds["peer"], 1),
        }
    return result


def run(
    folder: Path,
    generate_n: int = 0,
    model: str | None = None,
    max_tokens: int = 256,
    peer: str | None = None,
    on_reply: Callable[[str], None] | None = None,
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
        gen = generate(chosen, model, max_tokens, peer, on_reply)
        gen["goals_pass"] = gen["invalid"] == 0 and (
            peer is None or gen["length"] <= gen["peer"]["length"]
        )
        result["generate"] = gen
    return result

"""`mlxcache bench models`: SmolLM2 and Gemma 3 270M behind one server, under a memory
limit that holds one of them plus a cache, requests alternating between them.

Four servers, one after the other, on the cache directory of the user (where the models'
conversions and the device's probes of them are kept for every later run; no disk tier,
so no prompt is kept there):
- a preparing one (no limit): it converts both models and records their probes, once (a
  conversion's memory is not a model's), then unloads them (keep-alive): what the idle
  server holds, with the libraries a load imports (tens of MB it keeps);
- each model's own server (`serve --models` of it alone, loaded at start): its load time
  (the baseline of a reload), what it adds to the idle server, the most its load added
  (its tokenizer's parse passes what it keeps), and its replies to the prompts (what
  every reply must equal);
- the served pair under `--mem-limit` (default: the idle server, the larger model and
  half the smaller one, or the larger load's peak where that is more): requests
  alternate between the models for `minutes`.

Reported: the switches (unloads), each model's reload time against its own load, the
server's peak resident memory against the limit (goal: at most 5% over), and whether
every reply equals its model's own (goal: all), and errors (goal: none).
"""

from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from mlxcache.errors import ServerError
from mlxcache.server.process import MlxcacheServer

MODELS = ("gemma3-270m", "smollm2-135m")
"""The larger first: the first switch then makes room by the measured size of a model."""
PROMPTS = ("The capital of France is", "Water boils at", "A cache is")
GOAL_PEAK = 1.05
MAX_REFUSED = 50
"""A 429 is retried after its Retry-After, this many times in all (then it is an error)."""
MiB = 1 << 20
_LOADED = re.compile(r"mlxcache: loaded (\S+) \(.*, ([\d.]+) s\)")


def run(minutes: float, tokens: int, mem_limit: int | None) -> dict[str, Any]:
    """The bench (see the module's doc) as one JSON-able dict."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        common = ["--cache-disk", "0", "-n", str(tokens), "--no-warm-ahead"]
        idle = _prepare(root, common)
        own = {m: _solo(root, common, m) for m in MODELS}
        sizes = {m: own[m]["resident"] - idle for m in MODELS}
        peaks = {m: own[m]["load_peak"] for m in MODELS}
        one = max(max(sizes.values()) + min(sizes.values()) // 2, max(peaks.values()))
        limit = mem_limit or idle + one
        served = _served(root, common, limit, minutes, own)
    reloads = {m: served["loads"][m][1:] for m in MODELS}
    peak = served["peak"]
    return {
        "bench": "models",
        "models": list(MODELS),
        "minutes": minutes,
        "max_tokens": tokens,
        "idle_server_mb": round(idle / MiB, 1),
        "model_mb": {m: round(sizes[m] / MiB, 1) for m in MODELS},
        "load_peak_mb": {m: round(peaks[m] / MiB, 1) for m in MODELS},
        "mem_limit_mb": round(limit / MiB, 1),
        "peak_rss_mb": round(peak / MiB, 1),
        "peak_over_limit": round(peak / limit, 3),
        "requests": served["requests"],
        "switches": served["switches"],
        "own_load_s": {m: own[m]["load_s"] for m in MODELS},
        "reload_s_median": {m: _median(reloads[m]) for m in MODELS},
        "reload_vs_own": {
            m: None if not reloads[m] else round(_median(reloads[m]) / own[m]["load_s"], 2)
            for m in MODELS
        },
        "refused_429_retried": served["refused"],
        "errors": len(served["errors"]),
        "first_errors": served["errors"][:3],
        "goals": {
            "peak_within_limit": peak <= GOAL_PEAK * limit,
            "replies_equal_solo": served["requests"] > 0 and not served["mismatches"],
            "no_errors": not served["errors"],
            "switched": served["switches"] >= 2,
        },
    }


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else 0.0


def _models_file(root: Path, name: str, models: tuple[str, ...]) -> str:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump([{"name": m, "model": m} for m in models]))
    return str(path)


def _ps(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/ps", timeout=600) as reply:
        doc: dict[str, Any] = json.load(reply)
    return doc


WAIT_S = 3600.0
"""A bound on one request (a first conversion and probe of Gemma take minutes here)."""


def _ask(url: str, model: str, prompt: str) -> tuple[int, dict[str, Any], float]:
    """(status, body, Retry-After) of a greedy completion of `prompt` by `model`.

    Raises:
        ServerError: the server did not answer.
    """
    body = json.dumps({"model": model, "prompt": prompt, "temperature": 0}).encode()
    request = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=WAIT_S) as response:
            return response.status, json.loads(response.read()), 0.0
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}"), float(exc.headers.get("Retry-After") or 1)
    except OSError as exc:
        raise ServerError(f"bench models: {model} did not answer: {exc}") from exc


def _text(url: str, model: str, prompt: str) -> str:
    """A completion's text (a server that does not answer it fails the bench)."""
    status, doc, _ = _ask(url, model, prompt)
    if status != 200:
        raise ServerError(f"bench models: {model}: {status} {doc.get('error', {}).get('message')}")
    return str(doc["choices"][0]["text"])


def _prepare(root: Path, common: list[str]) -> int:
    """What the idle server holds once its models were loaded and unloaded; both models
    converted and probed."""
    args = ["--models", _models_file(root, "both", MODELS), "--keep-alive", "1s", *common]
    server = MlxcacheServer(args)
    try:
        for model in MODELS:
            _text(server.url, model, PROMPTS[0])
        until = time.monotonic() + 60
        while any(m["loaded"] for m in _ps(server.url)["models"]):
            if time.monotonic() > until:
                raise ServerError("bench models: the models were not unloaded after 1 s idle")
            time.sleep(0.5)
        idle = int(_ps(server.url)["resident_bytes"])
    finally:
        server.stop()
    return idle


def _solo(root: Path, common: list[str], model: str) -> dict[str, Any]:
    """A model's own server: its load time, its replies, and what it then holds."""
    args = ["--models", _models_file(root, model, (model,)), "--load-all", *common]
    server = MlxcacheServer(args)
    try:
        load_s = float(server.wait_for(_LOADED).group(2))
        replies = {p: _text(server.url, model, p) for p in PROMPTS}
        ps = _ps(server.url)
    finally:
        server.stop()
    peak = int(ps["models"][0].get("load_peak_bytes") or 0)
    return {
        "load_s": load_s,
        "replies": replies,
        "resident": ps["resident_bytes"],
        "load_peak": peak,
    }


def _served(
    root: Path, common: list[str], limit: int, minutes: float, own: dict[str, Any]
) -> dict[str, Any]:
    """The pair under the limit, requests alternating, until `minutes` have passed (two
    rounds at least)."""
    args = ["--models", _models_file(root, "both", MODELS), "--mem-limit", str(limit), *common]
    server = MlxcacheServer(args)
    out: dict[str, Any] = {"requests": 0, "refused": 0, "errors": [], "mismatches": []}
    try:
        until = time.monotonic() + 60 * minutes
        turn = 0
        while time.monotonic() < until or turn < 2 * len(MODELS):
            model, prompt = MODELS[turn % len(MODELS)], PROMPTS[(turn // 2) % len(PROMPTS)]
            status, doc, wait = _ask(server.url, model, prompt)
            if status == 429 and out["refused"] < MAX_REFUSED:
                out["refused"] += 1
                time.sleep(wait)
                continue
            turn += 1
            out["requests"] += 1
            if status != 200:
                out["errors"].append(f"{model}: {status} {doc.get('error', {}).get('message')}")
            elif doc["choices"][0]["text"] != own[model]["replies"][prompt]:
                out["mismatches"].append((model, prompt))
        out["peak"] = _peak_rss(server.proc.pid)
    finally:
        server.stop()
    out["loads"] = {m: [] for m in MODELS}
    for line in server.lines:
        found = _LOADED.search(line)
        if found:
            out["loads"][found.group(1)].append(float(found.group(2)))
    out["switches"] = sum(1 for line in server.lines if "mlxcache: unloaded" in line)
    return out


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (Linux: VmHWM; else its RSS now)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    from mlxcache.bench.serve_bench import rss_bytes

    return rss_bytes(pid)

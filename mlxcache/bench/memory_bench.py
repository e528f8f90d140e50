"""`mlxcache bench memory`: memory that stays bounded, and what quantized KV buys and costs.

Three parts (`--only` picks some):
- **soak**: `mlxcache serve --mem-limit B` (B: the idle server's resident size plus a third
  of the conversations' KV at full length, at least 96 MiB, unless given), N growing conversations (each next
  turn sent the moment the last reply ends, `concurrency` at once, a conversation started
  over once it has `turns` turns) for a bounded time; the server's resident size sampled
  every `interval` seconds. Reported: the peak against the budget (goal ≤ 1.1x), the growth
  over the last half (goal: at most 2% of the budget: flat once the cache is full), errors
  (goal 0; a 429 retried after its Retry-After is counted apart), and a sample of replies
  against a cold in-process run of the same messages (goal: every one equal).
- **context**: per KV width (full precision, 8 and 4 bits), a prompt prefilled into a
  memory tier of `cache_mem` and resumed whole from memory, then from disk in a fresh
  cache: KV bytes per token, tokens per MB in memory and on disk, the longest context the
  memory tier holds (capped by the model's), and restore time from disk per 1k tokens beside
  prefill time per 1k tokens. Goal: 4-bit keeps ≥ 3x the tokens per MB of full precision.
- **quality**: quantized KV against full precision, teacher-forced over a document (this
  package's own source text): the mean absolute difference of each next token's
  log-probability and the share of positions whose greedy token changes; and, given a
  regress suite (default: the smoke suite, if here), the share of its greedy reply tokens
  that change. Reported, no goal.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.bench import suite_or_smoke
from mlxcache.bench.serve_bench import idle_report, rss_bytes
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.errors import UserInputError
from mlxcache.membudget import Footprint
from mlxcache.model import LoadedModel, load
from mlxcache.model.kvquant import quantize_kv
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams
from mlxcache.server.process import MlxcacheServer
from mlxcache.types import new_layers

PARTS = ("soak", "context", "quality")
WIDTHS: tuple[int | None, ...] = (None, 8, 4)
GOAL_PEAK = 1.1
GOAL_GROWTH = 0.02
GOAL_Q4_TOKENS = 3.0
GROUPS = (64, 32, 128)
MiB = 1 << 20
SAMPLED_REPLIES = 6
TOPICS = ("rivers", "mountains", "deserts", "forests", "oceans", "glaciers", "islands", "caves")


@dataclass(frozen=True, slots=True)
class SoakSettings:
    """The soak's workload (see the module's doc); `limit` None: chosen (`_auto_limit`)."""

    minutes: float = 20.0
    conversations: int = 12
    concurrency: int = 4
    turns: int = 6
    tokens: int = 16
    limit: int | None = None
    interval: float = 10.0


def run(
    model: str | None,
    parts: tuple[str, ...],
    settings: SoakSettings,
    *,
    context_tokens: int,
    cache_mem: int,
    document_tokens: int,
    suite: Path | None,
) -> dict[str, Any]:
    loaded = load(model)
    result: dict[str, Any] = {"bench": "memory", "model": loaded.name}
    if "soak" in parts:
        result["soak"] = soak(loaded, model, settings)
    if "context" in parts:
        result["context"] = context(loaded, context_tokens, cache_mem)
    if "quality" in parts:
        result["quality"] = quality(loaded, document_tokens, suite_or_smoke(suite))
    return result


# -- soak ---------------------------------------------------------------------------------


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    """(status, JSON body, Retry-After seconds) of a POST."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read()), 0.0
    except urllib.error.HTTPError as exc:
        wait = float(exc.headers.get("Retry-After") or 1)
        return exc.code, json.loads(exc.read() or b"{}"), wait


def _question(conversation: int, turn: int) -> str:
    topic = TOPICS[conversation % len(TOPICS)]
    return f"Conversation {conversation}, question {turn}: name one fact about {topic}, briefly."


class _Clients:
    """The clients of a soak and what they saw."""

    def __init__(self, url: str, model: str, turns: int, tokens: int, until: float) -> None:
        self.url, self.model, self.turns, self.tokens, self.until = url, model, turns, tokens, until
        self.lock = threading.Lock()
        self.errors: list[str] = []
        self.refused = 0
        self.replies = 0
        self.sampled: list[tuple[list[dict[str, str]], str]] = []

    def client(self, owned: list[int]) -> None:
        """Turns of the `owned` conversations, in turn, until the time is up."""
        talks: dict[int, list[dict[str, str]]] = {c: [] for c in owned}
        started = dict.fromkeys(owned, 0)  # how many times each conversation started over
        while time.monotonic() < self.until:
            for c in owned:
                if time.monotonic() >= self.until:
                    return
                if len(talks[c]) >= 2 * self.turns:
                    talks[c], started[c] = [], started[c] + 1
                name = c + 1000 * started[c]
                asked = [*talks[c], {"role": "user", "content": _question(name, len(talks[c]))}]
                reply = self._ask(asked)
                if reply is None:
                    talks[c] = []
                    continue
                talks[c] = [*asked, {"role": "assistant", "content": reply}]

    def _ask(self, messages: list[dict[str, str]]) -> str | None:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.tokens,
            "temperature": 0,
        }
        while True:
            status, doc, wait = _post(f"{self.url}/v1/chat/completions", body)
            if status != 429:
                break
            with self.lock:
                self.refused += 1
            time.sleep(wait)
        if status != 200:
            with self.lock:
                self.errors.append(f"{status}: {doc.get('error', doc)}")
            return None
        text = str(doc["choices"][0]["message"]["content"])
        with self.lock:
            self.replies += 1
            if self.replies % 7 == 1 and len(self.sampled) < SAMPLED_REPLIES:
                self.sampled.append((messages, text))
        return text


def _growth(samples: list[tuple[float, int]]) -> float:
    """Bytes the fitted line over the last half of `samples` rises across that half."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return 0.0
    t = np.array([s[0] for s in half])
    y = np.array([s[1] for s in half], dtype=np.float64)
    slope = float(np.polyfit(t - t[0], y, 1)[0])
    return slope * float(t[-1] - t[0])


def soak(loaded: LoadedModel, model: str | None, settings: SoakSettings) -> dict[str, Any]:
    spec = [] if model is None else ["--model", model]
    with tempfile.TemporaryDirectory() as tmp:
        common = [*spec, "--cache-dir", tmp, "--max-lanes", str(settings.concurrency)]
        limit = settings.limit or _auto_limit(loaded, common, settings)
        server = MlxcacheServer([*common, "--mem-limit", str(limit)])
        try:
            clients = _Clients(
                server.url,
                server.model,
                settings.turns,
                settings.tokens,
                time.monotonic() + 60 * settings.minutes,
            )
            owned = [
                list(range(w, settings.conversations, settings.concurrency))
                for w in range(settings.concurrency)
            ]
            threads = [threading.Thread(target=clients.client, args=(o,)) for o in owned if o]
            start = time.monotonic()
            for thread in threads:
                thread.start()
            samples = []
            while any(t.is_alive() for t in threads):
                samples.append((time.monotonic() - start, rss_bytes(server.proc.pid)))
                for thread in threads:
                    thread.join(timeout=settings.interval / len(threads))
            samples.append((time.monotonic() - start, rss_bytes(server.proc.pid)))
            report = idle_report(server.url)
        finally:
            server.stop()
    cold = Engine(loaded)
    equal = [
        cold.complete(
            Request(cold.encoder.encode_chat(m), SamplingParams(max_tokens=settings.tokens))
        ).text
        == text
        for m, text in clients.sampled
    ]
    peak = max(rss for _, rss in samples)
    growth = _growth(samples)
    return {
        "minutes": settings.minutes,
        "conversations": settings.conversations,
        "concurrency": settings.concurrency,
        "mem_limit_mb": round(limit / MiB, 1),
        "peak_rss_mb": round(peak / MiB, 1),
        "peak_over_limit": round(peak / limit, 3),
        "last_half_growth_mb": round(growth / MiB, 1),
        "samples": len(samples),
        "replies": clients.replies,
        "refused_429_retried": clients.refused,
        "errors": len(clients.errors),
        "first_errors": clients.errors[:3],
        "evictions_mem": report.get("evictions_mem"),
        "replies_checked_cold": len(equal),
        "goals": {
            "peak_within_limit": peak <= GOAL_PEAK * limit,
            "flat_once_full": growth <= GOAL_GROWTH * limit,
            "no_errors": not clients.errors and clients.replies > 0,
            "replies_equal_cold": bool(equal) and all(equal),
        },
    }


def _auto_limit(loaded: LoadedModel, common: list[str], settings: SoakSettings) -> int:
    """The idle server's resident size plus a third of the conversations' KV at full
    length: a budget well under the working set, so the memory tier must evict."""
    server = MlxcacheServer(common)
    try:
        idle = int(idle_report(server.url)["resident_bytes"])
    finally:
        server.stop()
    per_turn = len(loaded.tokenizer.encode(_question(99, 9))) + settings.tokens + 16  # template
    footprint = Footprint.of(loaded.model, loaded.config)
    working = settings.conversations * footprint.kv(settings.turns * per_turn)
    return idle + max(working // 3, 96 * MiB)


# -- context ------------------------------------------------------------------------------


def _document(loaded: LoadedModel, n: int) -> list[int]:
    """`n` tokens of real text: this package's own source, as many modules as it takes."""
    import mlxcache.cache.store
    import mlxcache.engine
    import mlxcache.lanes
    import mlxcache.server.app

    modules = (mlxcache.engine, mlxcache.lanes, mlxcache.cache.store, mlxcache.server.app)
    ids: list[int] = []
    for module in modules * (1 + n // 4000):
        ids += loaded.tokenizer.encode(inspect.getsource(module))
        if len(ids) >= n:
            break
    return ids[:n]


def _width(loaded: LoadedModel, bits: int | None) -> LoadedModel:
    """`loaded` with its KV quantized to `bits` (None: as it is), in groups of mlx-lm's
    default 64 or, where that does not divide the heads, the next that does."""
    if bits is None:
        return loaded
    for group in GROUPS[:-1]:
        with contextlib.suppress(UserInputError):
            return quantize_kv(loaded, bits, group)
    return quantize_kv(loaded, bits, GROUPS[-1])  # its error says which would do


def context(loaded: LoadedModel, n: int, cache_mem: int) -> dict[str, Any]:
    ids = _document(loaded, n)
    params = SamplingParams(max_tokens=1)
    rows: dict[str, Any] = {}
    for bits in WIDTHS:
        model = _width(loaded, bits)
        with tempfile.TemporaryDirectory() as tmp:
            config = CacheConfig(directory=Path(tmp), mem_bytes=cache_mem)
            first = Engine(model, make_cache(model, config))
            cold = first.complete(Request(ids, params)).stats
            again = first.complete(Request([*ids, ids[0]], params)).stats
            report = first.cache.report()
            fresh = Engine(model, make_cache(model, config))  # memory empty: from disk
            disk = fresh.complete(Request([*ids, ids[0]], params)).stats
        per_token = int(report["kv_bytes_per_token"])
        kept = max(report["disk_bytes"], 1)
        name = "full" if bits is None else f"q{bits}"
        rows[name] = {
            "kv_bytes_per_token": per_token,
            "tokens_per_mb_memory": round(MiB / max(per_token, 1), 1),
            "tokens_per_mb_disk": round(again.cached_tokens * MiB / kept, 1),
            "longest_context_in_memory": min(loaded.context_length, cache_mem // max(per_token, 1)),
            "resumed_from_memory": again.cached_tokens,
            "resumed_from_disk": disk.cached_tokens if disk.cached_from == "disk" else 0,
            "prefill_s_per_1k": round(1000 * cold.ttft_s / len(ids), 3),
            "restore_disk_s_per_1k": round(1000 * disk.restore_s / max(disk.cached_tokens, 1), 3),
        }
    ratio = rows["q4"]["tokens_per_mb_memory"] / max(rows["full"]["tokens_per_mb_memory"], 1e-9)
    return {
        "prompt_tokens": len(ids),
        "cache_mem_mb": round(cache_mem / MiB, 1),
        **rows,
        "q4_tokens_per_mb_vs_full": round(ratio, 2),
        "goals": {"q4_keeps_3x": ratio >= GOAL_Q4_TOKENS},
    }


# -- quality ------------------------------------------------------------------------------


def _teacher_forced(
    model: LoadedModel, ids: list[int], chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each position's log-probability of the document's next token, and its greedy pick."""
    layers = new_layers(model.model)
    logprobs, picks = [], []
    for start in range(0, len(ids) - 1, chunk):
        stop = min(start + chunk, len(ids) - 1)
        logits = model.model(mx.array([ids[start:stop]]), cache=layers)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = mx.array(ids[start + 1 : stop + 1])
        logprobs.append(np.array(mx.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0]))
        picks.append(np.array(mx.argmax(lp, axis=-1)))
    return np.concatenate(logprobs), np.concatenate(picks)


def quality(loaded: LoadedModel, n: int, suite: Path | None) -> dict[str, Any]:
    ids = _document(loaded, n)
    base_lp, base_pick = _teacher_forced(loaded, ids, 64)
    out: dict[str, Any] = {"document_tokens": len(ids)}
    replies = None if suite is None else _suite_tokens(loaded, suite)
    for bits in WIDTHS[1:]:
        lp, pick = _teacher_forced(_width(loaded, bits), ids, 64)
        row = {
            "mean_abs_logprob_diff": round(float(np.mean(np.abs(lp - base_lp))), 4),
            "greedy_changed_share": round(float(np.mean(pick != base_pick)), 4),
        }
        if replies is not None and suite is not None:
            row["suite_tokens_changed_share"] = _changed(
                replies, _suite_tokens(_width(loaded, bits), suite)
            )
        out[f"q{bits}"] = row
    return out


def _suite_tokens(loaded: LoadedModel, suite: Path) -> list[list[int]]:
    """Every greedy reply's tokens of the regress suite at `suite`, run alone, no cache."""
    from mlxcache.regress.runner import run_sequential
    from mlxcache.regress.suite import load as load_suite

    cases = load_suite(suite).cases
    engine = Engine(loaded)
    outputs = run_sequential(lambda _case: engine, cases)
    return [o["tokens"] for case in cases for o in outputs[case.name]]


def _changed(base: list[list[int]], other: list[list[int]]) -> float:
    """The share of `base`'s tokens from the first that differs in `other`, reply by reply."""
    total = changed = 0
    for a, b in zip(base, other, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        kept = min(len(a), len(b)) if same is None else same
        total += len(a)
        changed += len(a) - kept
    return round(changed / max(total, 1), 4)

"""`mlxcache bench spec`: speculative decoding against plain decoding, per workload.

Workloads: rewrite a code file with one change (prompt lookup's best case), a JSON batch
whose records repeat their structure, the regress smoke suite (when its file is given or
found), and a free-form chat reply (the worst case). For each workload and drafter, in the
same run as plain decoding: the model's forwards per generated token (what a device where
a verify forward is cheap gains: device-independent), the acceptance rate, decode time
against plain decoding, against `mlx_lm.stream_generate` with the same draft model where
that applies, and byte equality with plain decoding (goal: every byte). With `--draft
auto`, never slower than plain. One JSON line per workload, then a summary line.

Every submission is a new request (a JSON request's grammar matcher serves one reply:
`request.take_processors`), and every JSON reply timed is checked against its schema: a
bench that times broken replies fails (`OutputError`).

`sweep` measures the drafting defaults: each workload's plain replies once, then every
lookup n-gram size and k replayed over them (`draft.replay`: exact, no forward made), with
each k's decode time against plain decoding on this device as the verify probe's measured
forward costs predict it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from mlxcache.bench import suite_or_smoke
from mlxcache.config import MAX_DRAFT, CacheConfig, DraftConfig
from mlxcache.draft import Lookup, replay
from mlxcache.drafting import Drafting, DraftModel, choose, cost_of
from mlxcache.engine import Engine, Request
from mlxcache.errors import OutputError
from mlxcache.events import Result
from mlxcache.model import LoadedModel, load
from mlxcache.modes.json_mode import JsonTask, read_reply, request
from mlxcache.regress.runner import run_sequential, steps
from mlxcache.regress.suite import Case
from mlxcache.regress.suite import load as load_suite
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams
from mlxcache.types import as_module, as_wrapper

GOAL_FORWARDS = 0.5
"""Prompt lookup on the code and JSON workloads: at most this many forwards per token."""
GOAL_AUTO = 1.02
"""--draft auto against plain decoding: decode time over every workload at most this ratio
(the whole run's: where auto decodes plainly, a workload's few seconds differ by noise)."""


def code_file(lines: int) -> str:
    """A Python file of `lines` lines (functions over a `total`), to rewrite with one change."""
    out = ["import math", ""]
    i = 0
    while len(out) < lines:
        out += [
            f"def step_{i}(values, total=0):",
            f'    """Add the values of batch {i} to total."""',
            "    for value in values:",
            f"        total += value * {i + 1}",
            "    return math.floor(total)",
            "",
        ]
        i += 1
    return "\n".join(out[:lines])


def _code(engine: Engine, lines: int, tokens: int) -> list[Request]:
    text = (
        "Rewrite this Python file with the parameter `total` renamed to `amount`. Reply "
        f"with the whole file only.\n\n```python\n{code_file(lines)}\n```"
    )
    ids = engine.encoder.encode_chat([{"role": "user", "content": text}])
    return [Request(ids, SamplingParams(max_tokens=tokens))]


PRODUCTS = {
    "type": "array",
    "minItems": 4,
    "maxItems": 4,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "price": {"type": "number"},
            "in_stock": {"type": "boolean"},
        },
        "required": ["name", "price", "in_stock"],
        "additionalProperties": False,
    },
}


JSON_TOKENS = 160
"""The JSON workload's least token budget, whatever `tokens`: its schema bounds the
document (four records, names of at most 16 characters, numbers' digits capped; SmolLM2
writes 87 and 109 tokens), and a reply cut off is not a valid one to time."""


def _json(engine: Engine, tokens: int) -> list[Request]:
    task = JsonTask.create(PRODUCTS)
    asks = ["List four fruits a shop sells.", "List four tools a shop sells."]
    params = SamplingParams(max_tokens=max(tokens, JSON_TOKENS))
    return [
        request(engine, engine.encoder.encode_chat(task.messages(a)), task, params) for a in asks
    ]


Check = Callable[[Result], str | None]
"""Why a reply is not what its workload asks for (None: it is)."""


def _unchecked(_result: Result) -> str | None:
    return None


def _schema_check(schema: dict[str, Any]) -> Check:
    """A reply's error against `schema` (`json_mode.read_reply`: cut off, or invalid)."""
    task = JsonTask.create(schema)
    return lambda result: read_reply(task, result).error


def _chat(engine: Engine, tokens: int) -> list[Request]:
    ids = engine.encoder.encode_chat([{"role": "user", "content": "Tell me about tea."}])
    return [Request(ids, SamplingParams(max_tokens=tokens))]


@dataclass
class Tally:
    """One drafter's runs of a workload (its requests in order; `rounds` of each: the
    fastest decode time counts, so that load from elsewhere on the machine counts least)."""

    rounds: int
    outputs: list[list[int]] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    generated: int = 0
    forwards: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def decode_s(self) -> float:
        n = self.rounds
        return sum(min(self.times[i : i + n]) for i in range(0, len(self.times), n))

    def add(self, result: Result, timed: bool = True) -> None:
        """A request's result; its later rounds (`timed` False) add their time alone."""
        s = result.stats
        self.times.append(s.decode_s)
        if not timed:
            return
        self.outputs.append(result.tokens)
        self.generated += s.generated_tokens
        # A plain reply's first token comes with the prompt; each other is one forward.
        self.forwards += s.verify_forwards if s.draft else max(s.generated_tokens - 1, 0)
        self.drafted += s.drafted_tokens
        self.accepted += s.accepted_tokens


def _interleaved(
    engines: dict[str, Engine],
    tallies: dict[str, Tally],
    asked: dict[str, list[list[Request]]],
    check: Check,
) -> dict[str, list[list[Result]]]:
    """Each drafter's requests (`asked[drafter][round]`: the same ones, each made anew for
    its round on its engine) run request by request and round by round, every drafter in
    turn, in reverse order every other round: noise from elsewhere on the machine, and what
    the drafter before left in memory, fall on all of them alike. Each round's results, per
    drafter.

    Raises:
        OutputError: a reply fails its workload's `check` (a bench that times broken
            replies fails).
    """
    order = list(engines)
    rounds = len(asked[order[0]])
    got: dict[str, list[list[Result]]] = {d: [[] for _ in range(rounds)] for d in engines}
    for i in range(len(asked[order[0]][0])):
        for r in range(rounds):
            for d in order if r % 2 == 0 else order[::-1]:
                result = engines[d].complete(asked[d][r][i])
                problem = check(result)
                if problem is not None:
                    raise OutputError(
                        f"bench spec: a {d} reply (round {r + 1}) is broken: {problem}"
                    )
                tallies[d].add(result, timed=r == 0)
                got[d][r].append(result)
    return got


def _engine(loaded: LoadedModel, config: CacheConfig, drafting: Drafting | None) -> Engine:
    return Engine(loaded, make_cache(loaded, config), warm_ahead=False, drafting=drafting)


def _mlx_lm(
    loaded: LoadedModel, draft: LoadedModel, req: Request, k: int
) -> tuple[float, list[int]]:
    """mlx-lm's own speculative decoding of `req` (greedy): decode seconds and tokens."""
    from mlx_lm import stream_generate

    out = list(
        stream_generate(
            as_module(loaded.model),
            as_wrapper(loaded.tokenizer),
            [int(t) for t in req.tokens],
            max_tokens=req.sampling.max_tokens,
            draft_model=as_module(draft.model),
            num_draft_tokens=k,
        )
    )
    tokens = [int(r.token) for r in out if int(r.token) not in loaded.tokenizer.eos_token_ids]
    tps = float(out[-1].generation_tps) or 1e-9
    return max(len(out) - 1, 1) / tps, tokens


def run(
    model: str | None = None,
    draft_model: str | None = None,
    lines: int = 60,
    tokens: int = 160,
    k: int = 4,
    suite: Path | None = None,
    directory: Path | None = None,
    rounds: int = 2,
) -> Iterator[dict[str, Any]]:
    """One result per workload, then the summary (`"bench": "spec"`, with the goals)."""
    loaded = load(model)
    small = load(draft_model) if draft_model else loaded
    config = CacheConfig(directory=directory, disk_bytes=0)
    record = directory or config.directory
    drafters: dict[str, Drafting | None] = {
        "plain": None,
        "lookup": Drafting(loaded, DraftConfig(mode="lookup", tokens=k), config.block_size, record),
        "model": Drafting(
            loaded,
            DraftConfig(mode="model", model=small.name, tokens=k),
            config.block_size,
            record,
            DraftModel(small, make_cache(small, config)),
        ),
        "auto": Drafting(loaded, DraftConfig(mode="auto", tokens=k), config.block_size, record),
    }
    engines = {name: _engine(loaded, config, d) for name, d in drafters.items()}
    found = cast(Drafting, drafters["lookup"]).verify()
    rows = []
    for name, work in _workloads(lines, tokens, suite).items():
        tallies = {d: Tally(rounds) for d in engines}
        if isinstance(work, Path):
            for case in load_suite(work).cases:
                _regress_case(engines, tallies, case, rounds)
        else:
            make, check = work
            for engine in engines.values():  # the prompts are kept: timed rounds resume them
                for req in make(engine):
                    engine.complete(req)
            asked = {d: [make(e) for _ in range(rounds)] for d, e in engines.items()}
            _interleaved(engines, tallies, asked, check)
        row = _row(name, tallies)
        if name == "code":
            req = _code(engines["plain"], lines, tokens)[0]
            seconds, theirs = _mlx_lm(loaded, small, req, k)
            row["mlx_lm_model_vs_plain"] = round(seconds / max(tallies["plain"].decode_s, 1e-9), 3)
            row["mlx_lm_model_same_bytes"] = theirs == tallies["plain"].outputs[0]
        rows.append(row)
        yield row
    yield _summary(rows, found.width, found.costs, draft_model is None)


def _regress_case(
    engines: dict[str, Engine], tallies: dict[str, Tally], case: Case, rounds: int
) -> None:
    """A regress case's steps in lockstep: every drafter and round its own run of the case
    (its own requests, each step's made from its own earlier replies)."""
    schema = case.data.get("schema") if case.kind == "json" else None
    check = _unchecked if schema is None else _schema_check(schema)
    gens = {d: [steps(e, case) for _ in range(rounds)] for d, e in engines.items()}
    asked = {d: [next(g) for g in gs] for d, gs in gens.items()}
    with contextlib.suppress(StopIteration):  # the case's last step
        while True:
            got = _interleaved(engines, tallies, asked, check)
            asked = {d: [g.send(got[d][r]) for r, g in enumerate(gs)] for d, gs in gens.items()}


def _total(rows: list[dict[str, Any]], drafter: str) -> float:
    """A drafter's decode seconds over every workload."""
    return float(sum(r[drafter]["decode_s"] for r in rows))


Workload = tuple[Callable[[Engine], list[Request]], Check] | Path
"""A workload's requests (made anew on the engine that runs them, for each submission) and
what its replies must be, or a regress suite's file."""


def _workloads(lines: int, tokens: int, suite: Path | None) -> dict[str, Workload]:
    workloads: dict[str, Workload] = {
        "code": (lambda e: _code(e, lines, tokens), _unchecked),
        "json": (lambda e: _json(e, tokens), _schema_check(PRODUCTS)),
        "chat": (lambda e: _chat(e, tokens), _unchecked),
    }
    suite_path = suite_or_smoke(suite)
    if suite_path is not None:
        workloads["regress"] = suite_path
    return workloads


def _row(name: str, tallies: dict[str, Tally]) -> dict[str, Any]:
    plain = tallies["plain"]
    row: dict[str, Any] = {"bench": "spec", "workload": name, "tokens": plain.generated}
    for drafter, t in tallies.items():
        row[drafter] = {
            "forwards_per_token": round(t.forwards / max(t.generated, 1), 3),
            "acceptance": round(t.accepted / t.drafted, 3) if t.drafted else None,
            "decode_s": round(t.decode_s, 3),
            "decode_vs_plain": round(t.decode_s / max(plain.decode_s, 1e-9), 3),
            "same_bytes": t.outputs == plain.outputs,
        }
    return row


def _summary(
    rows: list[dict[str, Any]], width: int, costs: dict[int, float], self_draft: bool
) -> dict[str, Any]:
    lookup = {r["workload"]: r["lookup"]["forwards_per_token"] for r in rows}
    goals = {
        "lookup_forwards_code": lookup.get("code", 0.0) <= GOAL_FORWARDS,
        "lookup_forwards_json": lookup.get("json", 0.0) <= GOAL_FORWARDS,
        "same_bytes": all(r[d]["same_bytes"] for r in rows for d in ("lookup", "model", "auto")),
        "auto_not_slower": _total(rows, "auto") <= GOAL_AUTO * _total(rows, "plain"),
    }
    return {
        "bench": "spec",
        "summary": True,
        "probe_width": width,
        "probe_costs": costs,
        "auto_vs_plain": round(_total(rows, "auto") / max(_total(rows, "plain"), 1e-9), 3),
        "draft_model_is_target": self_draft,
        "goals": goals,
        "pass": all(goals.values()),
    }


SWEEP_NGRAMS = (1, 2, 3, 4)
SWEEP_K = (1, 2, 4, MAX_DRAFT)
"""k: the verify probe's widths less one (its costs are measured there)."""


@dataclass(frozen=True, slots=True)
class Reply:
    """A plain reply, as `draft.replay` takes it."""

    prompt: list[int]
    tokens: list[int]
    ended: bool
    budget: int


class _Replies:
    """An engine whose `complete` also keeps each reply (the regress runner's calls)."""

    def __init__(self, engine: Engine, kept: list[Reply]) -> None:
        self._engine, self._kept = engine, kept

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def complete(self, req: Request, on_event: Any = None) -> Result:
        result = self._engine.complete(req, on_event)
        ended = result.stop_token is not None
        prompt = [int(t) for t in req.tokens]
        self._kept.append(Reply(prompt, result.tokens, ended, req.sampling.max_tokens))
        return result


def sweep(
    model: str | None = None,
    lines: int = 60,
    tokens: int = 160,
    suite: Path | None = None,
    directory: Path | None = None,
) -> Iterator[dict[str, Any]]:
    """One line per workload, n and k, then the summary (`"bench": "spec-sweep"`): target
    forwards per generated token, tokens per verify forward and the share of forwards that
    carry drafts (device-independent), and the decode time against plain decoding this
    device's verify costs predict (None where a width is not exact here)."""
    loaded = load(model)
    config = CacheConfig(directory=directory, disk_bytes=0)
    found = Drafting(
        loaded, DraftConfig(mode="lookup"), config.block_size, directory or config.directory
    ).verify()
    engine = _engine(loaded, config, None)
    replies: dict[str, list[Reply]] = {}
    for name, work in _workloads(lines, tokens, suite).items():
        kept = replies.setdefault(name, [])
        recorder = cast(Engine, _Replies(engine, kept))
        if isinstance(work, Path):
            run_sequential(lambda _c, r=recorder: r, load_suite(work).cases)  # type: ignore[misc]
        else:
            for req in work[0](engine):
                recorder.complete(req)
    table: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for name, kept in replies.items():
        generated = sum(len(r.tokens) for r in kept)
        picks = sum(len(r.tokens) + int(r.ended) - 1 for r in kept)  # plain: a forward each
        for n in SWEEP_NGRAMS:
            for k in SWEEP_K:
                rounds = [
                    d
                    for r in kept
                    for d in replay(Lookup(n), r.prompt, r.tokens, r.ended, k, r.budget)
                ]
                cost = [cost_of(found.costs, d + 1) for d, _ in rounds]
                row = {
                    "bench": "spec-sweep",
                    "workload": name,
                    "ngram": n,
                    "k": k,
                    "forwards_per_token": round(len(rounds) / max(generated, 1), 3),
                    "tokens_per_forward": round(picks / max(len(rounds), 1), 3),
                    "drafted_share": round(sum(d > 0 for d, _ in rounds) / max(len(rounds), 1), 3),
                    "expected_vs_plain": (
                        None
                        if k + 1 > found.width or None in cost
                        else round(sum(cast(list[float], cost)) / max(picks, 1), 3)
                    ),
                }
                table.setdefault((n, k), []).append(row)
                yield row
    yield _sweep_summary(table, found.width, found.costs)


def _sweep_summary(
    table: dict[tuple[int, int], list[dict[str, Any]]], width: int, costs: dict[int, float]
) -> dict[str, Any]:
    """Means over the workloads: each (n, k)'s forwards per token and its yield as
    `drafting.PROFILE` holds it, and the (n, k) this device's costs favour by that
    profile (`drafting.choose`: what drafting picks here, unasked)."""

    def mean(key: str, nk: tuple[int, int]) -> float:
        return round(sum(r[key] for r in table[nk]) / len(table[nk]), 3)

    profile = {nk: (mean("tokens_per_forward", nk), mean("drafted_share", nk)) for nk in table}
    fewest = min(table, key=lambda nk: (mean("forwards_per_token", nk), nk))
    best = choose(costs, width, profile=profile) if width > 1 else None
    return {
        "bench": "spec-sweep",
        "summary": True,
        "probe_width": width,
        "probe_costs": costs,
        "forwards_per_token": {f"{n},{k}": mean("forwards_per_token", (n, k)) for n, k in table},
        "fewest_forwards": {"ngram": fewest[0], "k": fewest[1]},
        "profile": {f"{n},{k}": list(v) for (n, k), v in profile.items()},
        "device_best": None if best is None else {"ngram": best[0], "k": best[1]},
        "device_best_vs_plain": None if best is None else best[2],
        "drafting_pays_here": best is not None and best[2] < 1,
    }

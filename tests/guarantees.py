"""The exactness guarantees as plain check functions, for the tests and the mutation suite.

Each check runs one scenario on a `Rig` (a model variant and a fresh cache directory) and
raises AssertionError when a guarantee breaks:
- every reply's tokens and last-prompt-token logits equal a cold run's (NoCache), bit
  for bit, and a resumed run makes exactly the cold run's forward calls from its resume
  point on, each of batch size 1;
- the resume point and the kept entries are what the cache geometry says (`Geometry`),
  never read back from the run itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.sample_utils import make_logits_processors
from shapemodel import Shaped, checkpointed, shaped
from spy import Spy, spied
from tinymodel import write_sliding

from mlxcache.cache.base import NoCache, is_trimmable
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig, DraftConfig
from mlxcache.decode import Share
from mlxcache.decode_batch import batchable
from mlxcache.draft import Drafter
from mlxcache.drafting import Drafting, DraftModel, Plan
from mlxcache.engine import Engine, Request
from mlxcache.events import Done, Event, Result, Token
from mlxcache.invariance import batch_verify_probe, probe, verify_probe
from mlxcache.model import LoadedModel, load
from mlxcache.model.kvquant import quantize_kv
from mlxcache.prefill import prefill, schedule
from mlxcache.runtime import measured
from mlxcache.sampling import SamplingParams
from mlxcache.types import new_layers
from mlxcache.worker import EngineWorker

B = 4
KV_GROUP = 32  # the quantized variant's group; its heads are 64 wide: 64 fits too
KV_GROUPS = (32, 64)
GREEDY = SamplingParams(max_tokens=6)
CHILD = Path(__file__).with_name("exact_child.py")


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


@dataclass(frozen=True)
class Variant:
    """A model under test: `source` is what `load` takes (a child process loads it too);
    `is_checkpointed`: its first layer's cache has no block layout (whole-state
    checkpoints); `kv_bits`: its KV quantized (`--kv-bits`, groups of `kv_group`); its
    adapter's folder, if it has one (`load(source, adapter=)`)."""

    name: str
    source: str
    is_shaped: bool
    is_checkpointed: bool
    loaded: LoadedModel
    kv_bits: int | None = None
    adapter: str | None = None
    kv_group: int = KV_GROUP

    @classmethod
    def of(
        cls,
        name: str,
        plain: LoadedModel,
        is_shaped: bool,
        is_checkpointed: bool = False,
        kv_bits: int | None = None,
        kv_group: int = KV_GROUP,
    ) -> Variant:
        loaded = plain if kv_bits is None else quantize_kv(plain, kv_bits, kv_group)
        loaded = checkpointed(loaded) if is_checkpointed else loaded
        loaded = shaped(loaded) if is_shaped else loaded
        adapter = None if plain.adapter is None else str(plain.adapter.path)
        source = str(plain.path)
        return cls(
            name,
            source,
            is_shaped,
            is_checkpointed,
            loaded,
            kv_bits,
            adapter=adapter,
            kv_group=kv_group,
        )

    @classmethod
    def all(
        cls,
        plain: LoadedModel,
        sliding: LoadedModel,
        recurrent: LoadedModel,
        quantizable: LoadedModel,
        adapted: LoadedModel,
    ) -> dict[str, Variant]:
        """Each model kind plain and shape-sensitive: full attention, a sliding window
        (ring buffers), recurrent state (LFM2's convolutions), the recurrent model with
        a first-layer cache kind kept only as whole-state checkpoints, full attention
        with 8-bit quantized KV (`quantizable`: heads a quantization group fits), and full
        attention with a LoRA adapter (`adapted`)."""
        kinds = [
            ("plain", plain, False, None),
            ("sliding", sliding, False, None),
            ("recurrent", recurrent, False, None),
            ("checkpointed", recurrent, True, None),
            ("quantized", quantizable, False, 8),
            ("adapter", adapted, False, None),
        ]
        out = {}
        for name, base, is_checkpointed, bits in kinds:
            out[name] = cls.of(name, base, False, is_checkpointed, bits)
            shaped_name = "shaped" if name == "plain" else f"shaped-{name}"
            out[shaped_name] = cls.of(shaped_name, base, True, is_checkpointed, bits)
        return out

    @property
    def trimmable(self) -> bool:
        return is_trimmable(make_prompt_cache(self.loaded.model), B)


class Geometry:
    """What the cache keeps and where a prompt resumes, from B and the model kind alone.

    A trimmable model keeps the prompt's full blocks and resumes at the longest common
    prefix with an entry, cut to leave one token to prefill and floored to a block; a
    non-trimmable one keeps a checkpoint at the last block boundary before the end and
    resumes only from an entry that is a whole prefix of the prompt, shorter than it.
    A trimmable model's cache also remembers, in memory, the tail of each prompt of at
    least one block that it prefilled: the same prompt on the same cache resumes whole.
    Where decode KV is canonical (`decode_matches_prefill`: a shape-invariant device), it also keeps
    each reply's own tail, and a prompt resumes as far as anything held in memory follows
    it, inside a block too, one token short of its end; with recurrent layers (`state`)
    only to the end of a whole tail that continues the blocks it resumed.
    """

    def __init__(self, trimmable: bool) -> None:
        self.trimmable = trimmable
        self.kept: set[tuple[int, ...]] = set()
        self.tails: dict[int, set[tuple[int, ...]]] = {}  # by id() of the cache
        self.replies: dict[int, set[tuple[int, ...]]] = {}  # reply tails, by id() of the cache

    def resume(
        self,
        tokens: Sequence[int],
        cache: object = None,
        decode_matches_prefill: bool = False,
        state: bool = False,
    ) -> int:
        """Where `tokens` resume on `cache` (None: a cache with nothing in memory);
        `decode_matches_prefill`: every kept entry is in `cache`'s memory (one cache ran
        them all)."""
        if tuple(tokens) in self.tails.get(id(cache), set()):
            return len(tokens)
        n, best = len(tokens), 0
        for entry in self.kept:
            common = _common_prefix(entry, tokens)
            if self.trimmable:
                best = max(best, min(common, n - 1) // B * B)
            elif common == len(entry) < n:
                best = max(best, len(entry))
        if decode_matches_prefill:
            held = self.kept | self.tails.get(id(cache), set()) | self.replies.get(id(cache), set())
            if state:
                whole = [
                    len(h)
                    for h in held
                    if len(h) < n
                    and len(h) // B * B == best
                    and _common_prefix(h, tokens) == len(h)
                ]
                return max([best, *whole])
            best = max([best, *(min(_common_prefix(h, tokens), n - 1) for h in held)])
        return best

    def keep_at(self, tokens: Sequence[int]) -> int:
        """Where a request keeps its prompt (its prefill keeps when it gets there)."""
        n = len(tokens)
        return (n // B if self.trimmable else (n - 1) // B) * B

    def ran(self, tokens: Sequence[int], start: int, cache: object = None) -> None:
        """Record a run of `tokens` on `cache` that resumed at `start`."""
        keep_at = self.keep_at(tokens)
        if keep_at > start:
            self.kept.add(tuple(tokens[:keep_at]))
        if self.trimmable and len(tokens) >= B and start < len(tokens) and cache is not None:
            self.tails.setdefault(id(cache), set()).add(tuple(tokens))

    def prefilled(self, tokens: Sequence[int], chunks: int) -> None:
        """Record a prefill from 0 stopped after `chunks` chunks (it keeps what it computed)."""
        self.kept.add(tuple(tokens[: chunks * B]))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass
class Run:
    """One request as the spy saw it."""

    tokens: list[int]
    stop_token: int | None
    prompt_len: int
    cached: int
    calls: list[tuple[int, int]]
    batch_sizes: list[int]
    logits: mx.array
    """The last prompt token's logits."""
    merge_to: int = 0
    """Where its prefill's chunks stop being merged (`prefill.schedule(merge_to=)`): the
    engine keeps replies (the probe passed) and its layers keep every position so far
    (`live.whole_until`); 0: not merged."""


def _run_of(
    result: Result,
    n_prompt: int,
    calls: list[int],
    spy: Spy,
    remembered: mx.array | None = None,
    merge_to: int = 0,
) -> Run:
    final = [i for i in calls if sum(spy.calls[i]) == n_prompt]
    if len(final) == 1:
        logits = spy.last_logits[final[0]]
    else:  # no call ended the prompt: a wrong schedule, or a whole prompt resumed
        logits = remembered if remembered is not None else mx.zeros((0,))
    return Run(
        result.tokens,
        result.stop_token,
        n_prompt,
        result.stats.cached_tokens,
        [spy.calls[i] for i in calls],
        [spy.batch_sizes[i] for i in calls],
        logits,
        merge_to,
    )


def merges(engine: Engine) -> int:
    """Up to where `engine`'s prefills merge their chunks (see `Run.merge_to`), from the
    model's layer kinds alone: plain and quantized KV without bound, a sliding window up
    to its size less one, recurrent state never."""
    layers = new_layers(engine.loaded.model)
    if not engine.decode_matches_prefill or any(isinstance(c, ArraysCache) for c in layers):
        return 0
    windows = [c.max_size for c in layers if isinstance(c, RotatingKVCache)]
    return min(windows) - 1 if windows else 1 << 40


def remembered_logits(engine: Engine, tokens: list[int]) -> mx.array | None:
    """The last-prompt logits a whole-prompt resume of `tokens` starts from (if any)."""
    with engine.cache.restore(np.asarray(tokens, dtype=np.int32)) as lease:
        return lease.logits


def run(
    engine: Engine,
    spy: Spy,
    tokens: list[int],
    params: SamplingParams = GREEDY,
    follow: bool = False,
    stop: frozenset[int] | None = None,
) -> Run:
    """`stop`: the reply's end tokens (None: the tokenizer's)."""
    spy.reset()
    result = engine.complete(Request(tokens, params, stop_tokens=stop, follow=follow))
    whole = result.stats.cached_tokens == len(tokens)
    memo = remembered_logits(engine, tokens) if whole else None
    calls = list(range(len(spy.calls)))
    return _run_of(result, len(tokens), calls, spy, memo, merges(engine))


def fed_to_end(cold: Run) -> Run:
    """The cold run as an engine that keeps replies runs it: the reply's last token (an end
    token too) is fed as well, by one more decode call if the loop had not queued it."""
    fed = cold.prompt_len + len(cold.tokens) + (cold.stop_token is not None)
    last = sum(cold.calls[-1])
    if last == fed:
        return cold
    assert last == fed - 1, f"the cold run fed {last} of {fed} tokens"
    return dataclasses.replace(
        cold, calls=[*cold.calls, (last, 1)], batch_sizes=[*cold.batch_sizes, 1]
    )


def same_as_cold(got: Run, cold: Run) -> None:
    """Same tokens and last-prompt logits (bitwise); the cold run's calls from the resume on
    (a resume inside a block, which the geometry allows only where it is exact, first runs
    to the next boundary)."""
    assert got.tokens == cold.tokens, f"tokens {got.tokens} != cold {cold.tokens}"
    start, n = got.cached, got.prompt_len
    if got.merge_to and start < n:  # fewer, wider chunks: only where the probe passed
        chunks = schedule(start, n, B, decode_matches_prefill=True, merge_to=got.merge_to)
        prompt = [(s, e - s) for s, e in chunks]
    else:
        first = (
            [] if start % B == 0 or start == n else [(start, min(start // B * B + B, n) - start)]
        )
        prompt = first + [c for c in cold.calls if start <= c[0] < n]
    expected = prompt + [c for c in cold.calls if c[0] >= n]
    assert got.calls == expected, f"calls {got.calls} != cold {cold.calls} from {start}"
    assert set(got.batch_sizes) <= {1}, f"batch sizes {got.batch_sizes}"
    assert mx.array_equal(got.logits, cold.logits), "last-prompt logits differ from cold"


class Rig:
    """One variant on one cache directory: cached engines, cold runs and the geometry.

    Every cached engine of a rig uses the same disk directory, so a new engine sees what
    the earlier ones kept (through its disk tier) and one `Geometry` tracks them all.
    `mutant` names a mutant (tests/mutants.py) that child processes apply as well.
    """

    def __init__(self, variant: Variant, directory: Path, mutant: str | None = None) -> None:
        self.variant = variant
        self.dir = directory
        self.mutant = mutant
        self.geo = Geometry(variant.trimmable)
        loaded, self._cold_spy = spied(variant.loaded)
        self._cold = Engine(loaded, NoCache(loaded.model, B))

    def engine(self) -> tuple[Engine, Spy]:
        """A cached engine with a new PromptCache (empty memory) on the rig's directory."""
        loaded, spy = spied(self.variant.loaded)
        # A recurrent state after every block: the geometry's resume points (the measured
        # stride is checked in tests/test_families.py).
        config = CacheConfig(block_size=B, directory=self.dir, state_stride=1)
        cache = PromptCache(loaded.model, loaded.key, config, root=self.dir / "kv")
        return Engine(loaded, cache), spy

    def cold(
        self, tokens: list[int], params: SamplingParams = GREEDY, stop: frozenset[int] | None = None
    ) -> Run:
        return run(self._cold, self._cold_spy, tokens, params, stop=stop)

    def warm(
        self,
        engine: Engine,
        spy: Spy,
        tokens: list[int],
        params: SamplingParams = GREEDY,
        follow: bool = False,
    ) -> Run:
        """Run on a cached engine; check resume point, entries and bits against cold."""
        expect = self.geo.resume(tokens, engine.cache)
        got = run(engine, spy, tokens, params, follow)
        if not engine.warming:  # every lease taken by a lane that ended was released
            assert engine.cache.report()["open_leases"] == 0, "a lease was not released"
        self.check(got, tokens, expect, self.cold(tokens, params), engine.cache)
        self.entries(engine.cache)
        return got

    def check(
        self, got: Run, tokens: list[int], expect: int, cold: Run, cache: object = None
    ) -> None:
        assert got.cached == expect, f"resumed at {got.cached}, the geometry says {expect}"
        self.geo.ran(tokens, expect, cache)
        same_as_cold(got, cold)

    def entries(self, cache: object) -> None:
        """The directory holds exactly the entries the geometry says (all runs keep there)."""
        assert isinstance(cache, PromptCache) and cache.disk is not None
        on_disk = {tuple(int(t) for t in e.tokens) for e in cache.disk.entries(cache.ns)}
        assert on_disk == self.geo.kept, (
            f"kept {sorted(map(len, on_disk))}, the geometry says {sorted(map(len, self.geo.kept))}"
        )

    def child(self, prompts: list[list[int]]) -> list[Run]:
        """Run `prompts` in order in a new process on the same directory (checked here)."""
        out = self.dir / "child-out"
        spec = {
            "source": self.variant.source,
            "shaped": self.variant.is_shaped,
            "checkpointed": self.variant.is_checkpointed,
            "kv_bits": self.variant.kv_bits,
            "adapter": self.variant.adapter,
            "kv_group": self.variant.kv_group,
            "dir": str(self.dir),
            "prompts": prompts,
            "mutant": self.mutant,
            "out": str(out),
        }
        env = {**os.environ, "PYTHONPATH": str(CHILD.parent)}
        done = subprocess.run(
            [sys.executable, str(CHILD), json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        if done.returncode:
            raise RuntimeError(f"child process failed:\n{done.stderr}")
        runs = json.loads(out.with_suffix(".json").read_text())
        logits = mx.load(str(out.with_suffix(".safetensors")))
        assert isinstance(logits, dict)
        return [
            Run(
                r["tokens"],
                r["stop_token"],
                r["prompt_len"],
                r["cached"],
                [tuple(c) for c in r["calls"]],
                r["batch_sizes"],
                logits[str(i)],
                r["merge_to"],
            )
            for i, r in enumerate(runs)
        ]


def save_runs(runs: list[Run], out: Path) -> None:
    """What `Rig.child` reads back (written by the child process)."""
    docs = [
        {
            "tokens": r.tokens,
            "stop_token": r.stop_token,
            "prompt_len": r.prompt_len,
            "cached": r.cached,
            "calls": r.calls,
            "batch_sizes": r.batch_sizes,
            "merge_to": r.merge_to,
        }
        for r in runs
    ]
    out.with_suffix(".json").write_text(json.dumps(docs))
    mx.save_safetensors(
        str(out.with_suffix(".safetensors")), {str(i): r.logits for i, r in enumerate(runs)}
    )


# -- the checks -----------------------------------------------------------------------------


def check_warm(rig: Rig) -> None:
    """A prompt run twice: the second resumes whole from memory (a non-trimmable model: at
    the last block boundary before its end); then prompts around it."""
    engine, spy = rig.engine()
    p = prompt(23)
    rig.warm(engine, spy, p)
    rig.warm(engine, spy, p)
    rig.warm(engine, spy, p + prompt(6, seed=1))  # extends p: resumes at its last full block
    rig.warm(engine, spy, p[:3])  # shorter than a block: nothing to resume or keep
    rig.warm(engine, spy, p[:20])  # all full blocks: resumes a block short of the end
    rig.warm(engine, spy, p[:20])  # ... and whole the second time (no tail, only logits)


def check_fork(rig: Rig) -> None:
    """A prompt that leaves an earlier one in the middle of a block."""
    engine, spy = rig.engine()
    base = prompt(30)
    rig.warm(engine, spy, base)
    rig.warm(engine, spy, base[:17] + prompt(9, seed=5))
    rig.warm(engine, spy, base[:8] + prompt(3, seed=6))


# Every sampling step on: the repetition penalty looks back into the cached prompt.
CHAT = SamplingParams(
    temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.5, max_tokens=6
)


def check_chat(rig: Rig) -> None:
    """Three turns, each prompt = the history so far; every turn checked, then turn 3 again."""
    engine, spy = rig.engine()
    history: list[int] = []
    for turn in range(3):
        history = history + prompt(7, seed=10 + turn)
        asked = history
        history = history + rig.warm(engine, spy, asked, CHAT).tokens
    rig.warm(engine, spy, asked, CHAT)


# Strong enough that no token of the last 64 (the whole prompt) is the greedy pick.
PENALIZED = SamplingParams(repetition_penalty=50.0, repetition_context=64, max_tokens=3)


def _pick_in_its_head(rig: Rig, n: int, head: int) -> list[int]:
    """A prompt of `n` tokens whose unpenalized greedy pick is one of its first `head`
    tokens and none of the rest: barred only by a penalty that looks back that far."""
    for seed in range(20, 30):
        tokens = prompt(n, seed=seed)
        for i in range(head):
            first = rig.cold(tokens).tokens[0]
            if first in tokens[head:]:
                break  # this prompt's tail holds it: try another
            if first in tokens[:head]:
                return tokens
            tokens[i] = first
    raise AssertionError(f"no prompt of {rig.variant.name} picks a token of its own head")


def check_penalty(rig: Rig) -> None:
    """The repetition penalty looks back into the resumed part of the prompt: a prompt
    whose greedy pick sits only in its cached blocks, under a penalty that bars it."""
    engine, spy = rig.engine()
    tokens = _pick_in_its_head(rig, 2 * B + 3, 2 * B)
    assert rig.cold(tokens, PENALIZED).tokens[0] != rig.cold(tokens).tokens[0]  # it bars it
    rig.warm(engine, spy, tokens[: 2 * B + 1])  # keeps the two blocks
    rig.warm(engine, spy, tokens, PENALIZED)  # resumes them, penalized as cold


def check_lanes(rig: Rig) -> None:
    """Two sampled lanes at once, twice (the second time resuming), then one prompt in both
    lanes at once (with two seeds): each equals its solo run."""
    engine, spy = rig.engine()
    shared = prompt(12)
    both = shared + prompt(7, seed=5)
    prompts = [shared + prompt(5, seed=1), shared + prompt(9, seed=2), both, both]
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=8) for s in (3, 4, 5, 6)]
    solo = [rig.cold(p, s) for p, s in zip(prompts, params, strict=True)]
    for order in ([0, 1], [1, 0], [2, 3]):
        # The first lane restores and runs one chunk, then the second restores: it sees
        # what the first kept if that chunk reached the first's keep point.
        # A first lane whose first chunk ends its prompt remembers its tail at once.
        first, second = (prompts[i] for i in order)
        # A second lane whose prompt is mostly the first's waits for the first's prefill
        # (`lanes.waits_for`) and resumes all it kept.
        expect = [rig.geo.resume(first, engine.cache)]
        reached = min(expect[0] + B, len(first))
        shared = _common_prefix(first, second) // B * B
        waits = rig.variant.trimmable and shared >= B and 2 * shared >= len(first)
        if waits and reached < len(first):
            rig.geo.ran(first, expect[0], engine.cache)
        else:
            if reached == rig.geo.keep_at(first):
                rig.geo.ran(first, expect[0])
            if reached == len(first):
                rig.geo.ran(first, expect[0], engine.cache)
        expect.append(rig.geo.resume(second, engine.cache))
        spy.reset()
        ids = [engine.submit(Request(prompts[i], params[i])) for i in order]
        done = {e.request_id: e.result for e in engine.run() if isinstance(e, Done)}
        assert set(spy.batch_sizes) == {1}, f"batched forward calls: {set(spy.batch_sizes)}"
        lanes = list(dict.fromkeys(spy.lanes))  # one cache list per lane, in start order
        assert len(lanes) == 2, f"{len(lanes)} cache lists for two lanes"
        for i, rid, lane, start in zip(order, ids, lanes, expect, strict=True):
            calls = [j for j, x in enumerate(spy.lanes) if x == lane]
            whole = done[rid].stats.cached_tokens == len(prompts[i])
            memo = remembered_logits(engine, prompts[i]) if whole else None
            got = _run_of(done[rid], len(prompts[i]), calls, spy, memo)
            rig.check(got, prompts[i], start, solo[i], engine.cache)
        rig.entries(engine.cache)


def check_worker(rig: Rig) -> None:
    """Four sampled requests sent at once to the engine's worker thread (two lanes at a time,
    warm-ahead work queued before them): each reply equals its cold run. When each request
    starts depends on the threads, so the resume points are not fixed: each run must make
    the cold run's calls from wherever it resumed."""
    engine, spy = rig.engine()
    shared = prompt(12)
    prompts = [shared + prompt(5 + 2 * i, seed=i) for i in range(4)]
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=6) for i in range(4)]
    solo = [rig.cold(p, s) for p, s in zip(prompts, params, strict=True)]
    results: list[list[Result]] = [[] for _ in prompts]
    finished: queue.SimpleQueue[int] = queue.SimpleQueue()

    def sink(i: int) -> Callable[[Event], None]:
        def put(event: Event) -> None:
            if isinstance(event, Done):
                # Arrays of the worker's stream are usable on this thread once evaluated.
                mx.eval(spy.last_logits)
                results[i].append(event.result)
                finished.put(i)

        return put

    spy.reset()
    with EngineWorker(engine, max_lanes=2) as worker:
        worker.warm(shared + prompt(8, seed=9))
        for i, (p, s) in enumerate(zip(prompts, params, strict=True)):
            worker.submit(Request(p, s), sink(i))
        for _ in prompts:
            finished.get(timeout=120)
    assert set(spy.batch_sizes) == {1}, f"batched forward calls: {set(spy.batch_sizes)}"
    lanes = {lane: [j for j, x in enumerate(spy.lanes) if x == lane] for lane in spy.lanes}
    for i, (result,) in enumerate(results):
        expected = [c for c in solo[i].calls if c[0] >= result.stats.cached_tokens]
        match = [js for js in lanes.values() if [spy.calls[j] for j in js] == expected]
        assert match, f"no lane made the calls {expected}"
        same_as_cold(_run_of(result, len(prompts[i]), match[0], spy), solo[i])


def check_interrupted(rig: Rig) -> None:
    """A request cancelled after three prefill chunks keeps them; the next run resumes there."""
    engine, spy = rig.engine()
    p = prompt(23)
    rid = engine.submit(Request(p, GREEDY))
    for _ in range(3):
        engine.step()
    engine.cancel(rid)
    rig.geo.prefilled(p, 3)
    rig.entries(engine.cache)
    rig.warm(engine, spy, p)


class Interrupt:
    """Forwards to a model and raises KeyboardInterrupt in call number `at` (Ctrl-C)."""

    def __init__(self, model: Any, at: int) -> None:
        self._model, self._left = model, at

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        self._left -= 1
        if not self._left:
            raise KeyboardInterrupt
        return self._model(x, cache=cache)


def check_interrupted_inside_a_chunk(rig: Rig) -> None:
    """Ctrl-C inside the third prefill chunk: a trimmable model keeps the two chunks before
    it; a whole-state checkpoint (whose layers then hold part of a chunk) keeps nothing."""
    engine, spy = rig.engine()
    p = prompt(23)
    loaded = engine.loaded
    engine.loaded = dataclasses.replace(loaded, model=Interrupt(loaded.model, at=3))
    try:
        engine.complete(Request(p, GREEDY))
        raise AssertionError("the interrupt did not reach the caller")
    except KeyboardInterrupt:
        pass
    engine.loaded = loaded
    if rig.variant.trimmable:
        rig.geo.prefilled(p, 2)
    rig.entries(engine.cache)
    rig.warm(engine, spy, p)


def check_warm_ahead(rig: Rig) -> None:
    """Warm-ahead work run to its end keeps canonical KV; a request resumes from it."""
    engine, spy = rig.engine()
    history = prompt(21)
    engine.warm(history)
    list(engine.run(warm=True))
    rig.geo.prefilled(history, len(history) // B)
    rig.entries(engine.cache)
    rig.warm(engine, spy, history + prompt(6, seed=1))


def check_warm_preempted(rig: Rig) -> None:
    """A request stops warm-ahead work after two chunks; it keeps them, the request resumes."""
    engine, spy = rig.engine()
    history = prompt(19, seed=2)
    engine.warm(history)
    for _ in range(2):
        engine.step()
    rig.geo.prefilled(history, 2)  # the request below stops the warm lane first
    rig.warm(engine, spy, history + prompt(3, seed=3))


def check_follow(rig: Rig) -> None:
    """A followed request run alone (its follow lane waits), then its follow lane catching
    up: the reply's blocks are kept (trimmable models) one canonical chunk each, and the
    next turn resumes after them with the cold run's bits."""
    engine, spy = rig.engine()
    p = prompt(10, seed=3)
    params = SamplingParams(max_tokens=9)
    first = rig.warm(engine, spy, p, params, follow=True)
    assert engine.warming == rig.variant.trimmable
    list(engine.run(warm=True))
    whole = [*p, *first.tokens]
    if rig.variant.trimmable:
        for k in range(rig.geo.keep_at(p) + B, len(whole) // B * B + 1, B):
            rig.geo.kept.add(tuple(whole[:k]))
    rig.entries(engine.cache)
    rig.warm(engine, spy, whole + prompt(5, seed=4))


def check_kept_replies(rig: Rig) -> None:
    """Where the probe finds decode KV canonical (every block layout on MLX's CPU backend:
    plain, quantized and sliding-window KV, recurrent state), a reply's own KV and state
    are kept as decode computed them, without a follow lane; the next turn resumes past
    the reply with the cold run's bits. The shape-sensitive model must fail the probe."""
    engine, spy = rig.engine()
    assert isinstance(engine.cache, PromptCache)
    engine.decode_matches_prefill = measured(engine.loaded, engine.cache.config)["decode"]
    if rig.variant.is_shaped:
        assert not engine.decode_matches_prefill, "the probe trusted a shape-sensitive model"
    elif engine.cache.layout is not None and mx.default_device() == mx.cpu:
        assert engine.decode_matches_prefill, "decode KV is canonical on MLX's CPU backend"
    params = SamplingParams(max_tokens=9)

    def turn(tokens: list[int]) -> list[int]:
        got = kept_turn(rig, engine, spy, tokens, params)
        return [*tokens, *got.tokens]

    whole = turn(prompt(10, seed=3))
    whole = turn(whole + prompt(5, seed=4))
    # Another conversation that shares part of the first prompt's second block.
    turn([*whole[: B + 3], *prompt(6, seed=5)])


def kept_turn(
    rig: Rig,
    engine: Engine,
    spy: Spy,
    tokens: list[int],
    params: SamplingParams,
    stop: frozenset[int] | None = None,
) -> Run:
    """A followed turn on an engine that keeps replies where the probe allowed it: resumed
    as the geometry says, with the cold run's bits (fed to its end where replies are kept);
    the geometry then learns what the reply kept: one entry of every token drawn, an end
    token too (kept replies), or each full block of prompt + reply (a follow lane)."""
    assert isinstance(engine.cache, PromptCache)
    layout = engine.cache.layout
    state = layout is not None and layout.has_state
    expect = rig.geo.resume(
        tokens, engine.cache, decode_matches_prefill=engine.decode_matches_prefill, state=state
    )
    got = run(engine, spy, tokens, params, follow=True, stop=stop)
    cold = rig.cold(tokens, params, stop)
    rig.check(
        got,
        tokens,
        expect,
        fed_to_end(cold) if engine.decode_matches_prefill else cold,
        engine.cache,
    )
    list(engine.run(warm=True))  # a follow lane, where replies are not kept
    whole = [*tokens, *got.tokens]
    if engine.decode_matches_prefill:
        fed = [*whole, *([] if got.stop_token is None else [got.stop_token])]
        if len(fed) // B * B > rig.geo.keep_at(tokens):
            rig.geo.kept.add(tuple(fed[: len(fed) // B * B]))
        if len(fed) >= B:
            rig.geo.replies.setdefault(id(engine.cache), set()).add(tuple(fed))
    elif rig.variant.trimmable:  # its follow lane keeps each block of the reply
        for k in range(rig.geo.keep_at(tokens) + B, len(whole) // B * B + 1, B):
            rig.geo.kept.add(tuple(whole[:k]))
    rig.entries(engine.cache)
    return got


def check_end_token(rig: Rig) -> None:
    """Replies that end on an end token the model draws (each turn's stop token is one its
    cold reply draws): the next turn, prompt + reply + end token + a new message, resumes
    with the cold run's bits, the end token's KV kept with the reply where replies are kept
    (the probe), its blocks kept by a follow lane elsewhere."""
    engine, spy = rig.engine()
    assert isinstance(engine.cache, PromptCache)
    engine.decode_matches_prefill = measured(engine.loaded, engine.cache.config)["decode"]
    params = SamplingParams(max_tokens=9)
    tokens = prompt(10, seed=80)
    for turn in range(3):
        drawn = rig.cold(tokens, params).tokens
        stop = frozenset({drawn[min(2 + turn, len(drawn) - 1)]})
        got = kept_turn(rig, engine, spy, tokens, params, stop)
        assert got.stop_token in stop, f"turn {turn} ended without its end token"
        tokens = [*tokens, *got.tokens, got.stop_token, *prompt(5, seed=81 + turn)]


def check_batched(rig: Rig) -> None:
    """Where the probe finds batched rows exact (MLX's CPU backend: plain KV, sliding
    windows in time order, recurrent state), requests past their first token decode as
    one batch: each reply equals its solo run, token for token and log-probability for
    log-probability, with rows of different lengths joining and leaving on the way, and
    a reply decoded in the batch is kept (its blocks captured from the batch) for its next
    turn. The shape-sensitive model fails the probe and decodes alone."""
    engine, spy = rig.engine()
    assert isinstance(engine.cache, PromptCache)
    allowed = measured(engine.loaded, engine.cache.config)
    engine.batch_decode, engine.decode_matches_prefill = allowed["batch"], allowed["decode"]
    if rig.variant.is_shaped:
        assert not engine.batch_decode, "the probe trusted a shape-sensitive model"
    elif batchable(new_layers(engine.model)) and mx.default_device() == mx.cpu:
        assert engine.batch_decode, "batched rows are exact on MLX's CPU backend"
    requests = [
        Request(
            prompt(6 + 4 * i, seed=20 + i),
            SamplingParams(temperature=0.8, seed=i, max_tokens=12 - i),
            logprobs=2,
        )
        for i in range(4)
    ]
    cold = Engine(rig.variant.loaded, NoCache(rig.variant.loaded.model, B))

    def scored(events: Sequence[Event]) -> list[tuple[int, float | None, Any]]:
        return [(e.token, e.logprob, e.top_logprobs) for e in events if isinstance(e, Token)]

    solo = [scored(list(cold.generate(r))) for r in requests]
    seen: dict[int, list[Event]] = {}
    ids = [engine.submit(r) for r in requests[:3]]
    spy.reset()
    for _ in range(8):  # the three start; then the fourth joins the batch midway
        for e in engine.step():
            seen.setdefault(e.request_id, []).append(e)
    ids.append(engine.submit(requests[3]))
    for e in engine.run():
        seen.setdefault(e.request_id, []).append(e)
    for i, rid in enumerate(ids):
        assert scored(seen[rid]) == solo[i], f"request {i} differs from its solo run"
    if engine.batch_decode:
        assert max(spy.batch_sizes) >= 3, f"batch sizes {sorted(set(spy.batch_sizes))}"
    else:
        assert set(spy.batch_sizes) == {1}, f"batched forward calls: {set(spy.batch_sizes)}"
    # A reply decoded in the batch is kept (its KV came back out of it): the next turn
    # resumes inside that reply, with the cold run's bits.
    first = requests[0]
    reply = [t for t, logprob, _ in solo[0] if logprob is not None]  # not the text flush
    nxt = [*first.tokens, *reply, *prompt(5, seed=40)]
    got = engine.complete(Request(nxt, first.sampling))
    assert got.tokens == cold.complete(Request(nxt, first.sampling)).tokens
    fed = len(first.tokens) + len(reply)  # the reply's last token was fed too
    if engine.decode_matches_prefill:  # as far as the reply's KV goes, inside a block too
        assert got.stats.cached_tokens == fed, f"resumed {got.stats.cached_tokens}, fed {fed}"


def check_disk(rig: Rig) -> None:
    """A new PromptCache on the same directory resumes from the disk tier."""
    engine, spy = rig.engine()
    p = prompt(26)
    rig.warm(engine, spy, p)
    reopened, spy2 = rig.engine()
    rig.warm(reopened, spy2, p)
    assert reopened.cache.report()["disk_hits"] == 1
    rig.warm(reopened, spy2, p + prompt(5, seed=6))


def check_new_process(rig: Rig) -> None:
    """A child process on the same directory resumes from what this one kept."""
    engine, spy = rig.engine()
    p = prompt(26)
    rig.warm(engine, spy, p)
    prompts = [p, p + prompt(5, seed=6)]
    expected = []
    for tokens, got in zip(prompts, rig.child(prompts), strict=True):
        expected.append(rig.geo.resume(tokens))
        rig.check(got, tokens, expected[-1], rig.cold(tokens))
    assert expected[0] > 0


def check_restore_repeatedly(rig: Rig) -> None:
    """One entry restored from memory three times, then from disk in two new caches."""
    engine, spy = rig.engine()
    p = prompt(22)
    rig.warm(engine, spy, p)
    for _ in range(3):
        assert rig.warm(engine, spy, p).cached == (22 if rig.variant.trimmable else 20)
    for _ in range(2):
        reopened, spy2 = rig.engine()
        assert rig.warm(reopened, spy2, p).cached == 20
        assert reopened.cache.report()["disk_hits"] == 1


def flip_bits(path: Path) -> None:
    """Flip one bit in the last value of a safetensors file (its data, not its header)."""
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x04  # a float32's mantissa: the file still loads, the number is wrong
    path.write_bytes(bytes(data))


def check_bit_flip(rig: Rig) -> None:
    """A flipped bit in a block (or checkpoint) file: caught by the checksum, dropped and
    counted; the request prefills instead and equals the cold run."""
    engine, spy = rig.engine()
    p = prompt(18)
    rig.warm(engine, spy, p)
    files = sorted((rig.dir / "kv" / "files").glob("*.safetensors"))
    states = [f for f in files if f.name.endswith(".s.safetensors")]  # recurrent layers'
    assert len(files) == (4 + len(states) if rig.variant.trimmable else 1)
    assert len(states) == (4 if rig.variant.trimmable and "recurrent" in rig.variant.name else 0)
    flip_bits([f for f in files if f not in states][-1])
    reopened, spy2 = rig.engine()
    got = run(reopened, spy2, p)
    same_as_cold(got, rig.cold(p))
    report = reopened.cache.report()
    assert report["dropped_corrupt"] == 1, f"dropped {report['dropped_corrupt']} files"
    assert got.cached == 0
    # The entry was dropped; the re-prefilled prompt was kept again, intact.
    again, spy3 = rig.engine()
    rig.warm(again, spy3, p)


def check_cancelled_decode(rig: Rig) -> None:
    """A reply cancelled mid-decode (Ctrl-C in chat, a client gone) keeps only the prompt's
    canonically prefilled blocks, never the KV its decode steps computed: the next turn
    (prompt + the partial reply + a new message) resumes where the geometry says, with the
    cold run's bits."""
    engine, spy = rig.engine()
    p = prompt(13, seed=4)
    expect = rig.geo.resume(p, engine.cache)
    rid = engine.submit(Request(p, SamplingParams(max_tokens=12)))
    reply: list[int] = []
    for _ in range(64):  # the prompt's chunks, then seven decode steps (a bound: no hang)
        reply += [e.token for e in engine.step() if isinstance(e, Token)]
        if len(reply) == 7:
            break
    assert len(reply) == 7, f"the request stopped after {len(reply)} tokens"
    engine.cancel(rid)
    rig.geo.ran(p, expect, engine.cache)
    rig.entries(engine.cache)
    rig.warm(engine, spy, [*p, *reply, *prompt(6, seed=8)])


def check_two_block_sizes(rig: Rig) -> None:
    """One directory used with block size B and then 2B (two processes, or a changed
    --block-size): the second never resumes, drops or rewrites the first's entries, and
    each resumes from its own."""
    engine, spy = rig.engine()
    p = prompt(26)
    rig.warm(engine, spy, p)
    loaded, spy2 = spied(rig.variant.loaded)
    config = CacheConfig(block_size=2 * B, directory=rig.dir)
    wide = PromptCache(loaded.model, loaded.key, config, root=rig.dir / "kv")
    assert wide.cached_length(p) == 0, "a cache of block size 2B sees entries of B"
    engine2 = Engine(loaded, wide)
    got = run(engine2, spy2, p)
    assert got.cached == 0, f"block size 2B resumed {got.cached} tokens of B's entries"
    cold = Engine(loaded, NoCache(loaded.model, 2 * B))
    assert got.tokens == cold.complete(Request(p, GREEDY)).tokens
    assert wide.report()["dropped_corrupt"] == 0
    # 2B kept its own entry, and finds it again in a new cache (a new process) ...
    again = PromptCache(loaded.model, loaded.key, config, root=rig.dir / "kv")
    assert again.cached_length(p) == len(p) // (2 * B) * 2 * B
    # ... while B's entries are all still there, intact.
    rig.entries(engine.cache)
    reopened, spy3 = rig.engine()
    rig.warm(reopened, spy3, p)


def check_two_models(rig: Rig, other: Variant) -> None:
    """Two models in one directory: the second never sees the first's entries, and a new
    process of the second resumes from its own."""
    engine, spy = rig.engine()
    p = prompt(20)
    rig.warm(engine, spy, p)
    second = Rig(other, rig.dir, rig.mutant)
    engine2, spy2 = second.engine()
    assert second.warm(engine2, spy2, p).cached == 0
    prompts = [p, p + prompt(5, seed=7)]
    for tokens, got in zip(prompts, second.child(prompts), strict=True):
        second.check(got, tokens, second.geo.resume(tokens), second.cold(tokens))
    rig.warm(engine, spy, p)  # the first model's own entries are intact


def load_variant(
    source: str,
    is_shaped: bool,
    is_checkpointed: bool,
    kv_bits: int | None,
    kv_group: int,
    adapter: str | None = None,
) -> Variant:
    """A variant as a child process loads it."""
    plain = load(source, adapter=adapter)
    return Variant.of("child", plain, is_shaped, is_checkpointed, kv_bits, kv_group)


def check_adapter_apart(rig: Rig) -> None:
    """An adapter's model (loaded here, so under the check) replies as mlx-lm's own
    `load(model, adapter_path=)` does, and keeps its own namespace: a base model's entries
    are never resumed under its adapter, and the base's resume intact after it."""
    from adapters import mlx_lm_reply

    assert rig.variant.adapter is not None, "a check of an adapter's variant"
    source, adapter, v = rig.variant.source, rig.variant.adapter, rig.variant
    p = prompt(20)
    alone = load(source, adapter=adapter)
    got = Engine(alone, NoCache(alone.model, B)).complete(Request(p, GREEDY)).tokens
    want = mlx_lm_reply(Path(source), Path(adapter), p, GREEDY)
    assert got == want[: len(got)], "a reply with the adapter is not mlx-lm's"
    assert got != mlx_lm_reply(Path(source), None, p, GREEDY)[: len(got)], "a no-op adapter"

    def fresh(name: str, tuned: str | None) -> Rig:
        loaded = load(source, adapter=tuned)
        return Rig(Variant.of(name, loaded, v.is_shaped, v.is_checkpointed, v.kv_bits), rig.dir)

    base = fresh("base", None)
    engine, spy = base.engine()
    base.warm(engine, spy, p)
    adapted = fresh("adapted", adapter)
    engine2, spy2 = adapted.engine()
    assert adapted.warm(engine2, spy2, p).cached == 0
    base.warm(engine, spy, p)


class Oracle:
    """A drafter that knows the plain reply: it drafts it with every third token wrong, so
    a drafted run accepts and rejects at every row of a round, whatever the sampling."""

    def __init__(self, prompt_len: int, reply: list[int], vocab: int) -> None:
        self.prompt_len, self.reply, self.vocab = prompt_len, reply, vocab
        self.proposed = 0
        self.starts: list[int] = []
        """Where each verify round began: the reply position its first row picks."""

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        at = len(tokens) - self.prompt_len
        self.starts.append(at)
        drafts = [
            (t + 1) % self.vocab if (at + j) % 3 == 2 else t
            for j, t in enumerate(self.reply[at : at + k])
        ]
        self.proposed += len(drafts)
        return drafts

    def close(self) -> None:
        return None


class OracleDrafting(Drafting):
    """Drafting as the engine decides it (the probe), with the oracle's drafts."""

    def __init__(self, loaded: LoadedModel, directory: Path, oracle: Oracle) -> None:
        super().__init__(loaded, DraftConfig(mode="lookup", tokens=4), B, directory)
        self.oracle = oracle

    def drafter(self, plan: Plan, share: Share | None = None) -> Drafter:
        return self.oracle


def run_together(
    engine: Engine, requests: list[Request]
) -> tuple[list[list[tuple[int, float | None, Any]]], list[int]]:
    """The requests submitted together and run: each one's `scored` reply, and the width
    of each forward of the decode batch (its widest row's inputs)."""
    widths: list[int] = []
    forward = engine._batch.forward

    def recorded(model: Any) -> list[mx.array]:
        rows = forward(model)
        widths.append(max(r.shape[0] for r in rows))
        return rows

    engine._batch.forward = recorded  # type: ignore[method-assign]
    ids = [engine.submit(r) for r in requests]
    seen: dict[int, list[Event]] = {}
    for e in engine.run():
        seen.setdefault(e.request_id, []).append(e)
    return [scored(seen[i]) for i in ids], widths


def scored(events: Sequence[Event]) -> list[tuple[int, float | None, Any]]:
    """A reply's tokens with their log-probabilities, as a drafted run must repeat them."""
    return [(e.token, e.logprob, e.top_logprobs) for e in events if isinstance(e, Token)]


def _grammar(loaded: LoadedModel) -> list[Any]:
    from mlxcache.constrain import grammar_from_lark, processor_for

    return [processor_for(loaded, grammar_from_lark(r"start: /[a-z]{2,6}( [a-z]{1,5}){1,9}\./"))]


def _thinking_budget(loaded: LoadedModel) -> list[Any]:
    """A prompt that ends inside a thinking section, held to 3 tokens: the end tag's
    tokens are then forced one per step (a stateful processor: it must see only accepted
    tokens)."""
    from mlxcache.modes.reasoning import Thinking, ThinkingBudget

    thinking = Thinking("<think>", "</think>", enabled=True, opened=True)
    return [ThinkingBudget(thinking, loaded.tokenizer, 3)]


DRAFT_CASES: list[tuple[str, SamplingParams, Callable[[LoadedModel], list[Any]]]] = [
    ("greedy", SamplingParams(max_tokens=12), lambda _l: []),
    ("seeded", SamplingParams(max_tokens=12, temperature=0.8, top_k=40, seed=5), lambda _l: []),
    (
        "penalties",
        SamplingParams(
            max_tokens=12,
            temperature=0.7,
            seed=2,
            repetition_penalty=1.3,
            presence_penalty=0.4,
            frequency_penalty=0.3,
        ),
        lambda _l: [],
    ),
    (
        "bias",
        SamplingParams(max_tokens=12, temperature=0.9, seed=7),
        lambda _l: make_logits_processors(logit_bias={5: 4.0, 83: -3.0}),
    ),
    ("grammar", SamplingParams(max_tokens=12, temperature=0.6, seed=1), _grammar),
    ("thinking", SamplingParams(max_tokens=12, temperature=0.7, seed=4), _thinking_budget),
]
"""Sampling and processors a drafted reply must follow exactly (a grammar and penalties
advance only over accepted tokens; each pick draws with plain decoding's key)."""


def check_drafted(rig: Rig) -> None:
    """A drafted reply is the plain one, bit for bit (tokens and log-probabilities), for
    greedy and seeded sampling, penalties, a logit bias, a grammar and a thinking budget,
    with drafts accepted
    and rejected at every row of a round: where the verify probe passes. The shape-sensitive
    model must fail the probe and decode plainly. A drafted reply's KV is kept as a plain
    one's (the next turn resumes past it with the cold run's bits), and a drafted request
    decodes beside batched plain ones, each equal to its solo run: its verify forwards are
    rows of the batch (the others padded, rejected drafts taken back out)."""
    engine, _spy = rig.engine()
    assert isinstance(engine.cache, PromptCache)
    allowed = measured(engine.loaded, engine.cache.config)
    engine.batch_decode, engine.decode_matches_prefill = allowed["batch"], allowed["decode"]
    cold = Engine(rig.variant.loaded, NoCache(rig.variant.loaded.model, B))
    vocab = len(rig.variant.loaded.tokenizer)
    width = Drafting(engine.loaded, DraftConfig(mode="lookup"), B, rig.dir).verify().width
    if rig.variant.is_shaped:
        assert width == 1, "the verify probe trusted a shape-sensitive model"
    p = prompt(9, seed=31)

    def drafted(
        tokens: list[int], params: SamplingParams, procs: Callable[[LoadedModel], list[Any]]
    ) -> list[Event]:
        """The drafted run against the plain one (each with its own processors: a grammar's
        state is its request's)."""
        loaded = rig.variant.loaded
        plain = list(cold.generate(Request(tokens, params, procs(loaded), logprobs=2)))
        reply = [e.token for e in plain if isinstance(e, Token) and e.logprob is not None]
        oracle = Oracle(len(tokens), reply, vocab)
        engine.drafting = OracleDrafting(engine.loaded, rig.dir, oracle)
        mine = Request(tokens, params, procs(loaded), logprobs=2, draft="lookup")
        got = list(engine.generate(mine))
        assert scored(got) == scored(plain), "a drafted reply differs from the plain one"
        done = next(e for e in got if isinstance(e, Done)).result
        if width > 1:
            assert done.stats.accepted_tokens > 0, "no draft was accepted"
            assert done.stats.drafted_tokens > done.stats.accepted_tokens, "none was rejected"
        return got

    for _name, params, procs in DRAFT_CASES:
        drafted(p, params, procs)
    # The next turn resumes past the drafted reply (its KV kept where replies are).
    first = drafted(p, GREEDY, lambda _l: [])
    reply = [e.token for e in first if isinstance(e, Token) and e.logprob is not None]
    nxt = [*p, *reply, *prompt(5, seed=32)]
    plain = scored(list(cold.generate(Request(nxt, GREEDY, logprobs=2))))
    engine.drafting = Drafting.off(engine.loaded, B)
    assert scored(list(engine.generate(Request(nxt, GREEDY, logprobs=2)))) == plain
    # Beside batched plain requests.
    others = [Request(prompt(6 + 3 * i, seed=40 + i), GREEDY, logprobs=2) for i in range(2)]
    solo = [scored(list(cold.generate(r))) for r in others]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
    mine = Request(prompt(8, seed=44), params, logprobs=2, draft="lookup")
    alone = scored(list(cold.generate(mine)))
    reply = [t for t, logprob, _ in alone if logprob is not None]
    engine.drafting = OracleDrafting(engine.loaded, rig.dir, Oracle(8, reply, vocab))
    replies, widths = run_together(engine, [*others, mine])
    assert replies == [*solo, alone], "a reply depends on its neighbours"
    if allowed["batch"] and width > 1 and batchable(new_layers(engine.loaded.model)):
        assert max(widths, default=1) > 1, (
            "the drafted request's verify forwards were not in the batch"
        )


def check_probes_apart(rig: Rig) -> None:
    """Each model's probe answers are its own: a model whose bits depend on the call shapes
    measured in a cache directory where an exact model's answers are recorded already (the
    same block size, device and versions) is still refused decode KV, batching and
    drafting."""
    plain = load(rig.variant.source)
    assert probe(plain, B, rig.dir)["decode"] and verify_probe(plain, B, rig.dir).width > 1
    found = probe(rig.variant.loaded, B, rig.dir)
    assert not found["decode"] and not found["batch"], "another model's probe answers were read"
    assert verify_probe(rig.variant.loaded, B, rig.dir).width == 1, "another model's verify width"


RING = 24
"""`check_ring_turns`' window: wide enough for a few turns inside it."""


def check_ring_turns(rig: Rig) -> None:
    """A sliding window's ring is rewound like plain KV while it has dropped no position
    (`live.whole_until`): with the rig's model's first layer a window `RING` wide, a
    prompt past the window merges its chunks inside it only; a conversation's turns
    inside it continue from the reply's own layers, its merged chunk's blocks all kept;
    past it, and for an edit after the ring dropped positions, the kept blocks are
    restored. Every turn resumes as the geometry says, with the cold run's calls and
    bits, and keeps the entries it says."""
    folder = write_sliding(Path(rig.variant.loaded.path), rig.dir / "windowed", window=RING)
    model = Variant.of("windowed", load(str(folder)), rig.variant.is_shaped)
    windowed = Rig(model, rig.dir / "rig", rig.mutant)
    engine, spy = windowed.engine()
    assert isinstance(engine.cache, PromptCache)
    engine.decode_matches_prefill = measured(engine.loaded, engine.cache.config)["decode"]
    params = SamplingParams(max_tokens=5)

    def turn(tokens: list[int]) -> list[int]:
        got = kept_turn(windowed, engine, spy, tokens, params, stop=frozenset())
        return [*tokens, *got.tokens]

    turn(prompt(RING + 6, seed=9))  # merged up to the window, canonical past it
    whole = turn(prompt(14, seed=6))  # one merged chunk of three blocks and more
    whole = turn(whole + prompt(2, seed=7))  # from the reply's layers, inside the window
    whole = turn(whole + prompt(2, seed=8))  # past it: the kept blocks
    turn([*whole[:10], *prompt(3, seed=10)])  # an edit, the ring having dropped positions


def check_foreign_tail(rig: Rig) -> None:
    """A prompt that starts with the tokens of another conversation's remembered tail (but
    not with that conversation's own prefix) resumes nothing from it: its tokens, logits and
    log-probabilities are the cold run's. Where a resume inside a block is allowed
    (decode KV measured canonical), tails are continued only after their own prefix."""
    engine, spy = rig.engine()
    assert isinstance(engine.cache, PromptCache)
    engine.decode_matches_prefill = measured(engine.loaded, engine.cache.config)["decode"]
    first = prompt(2 * B + 2, seed=50)
    run(engine, spy, first)  # its tail past two blocks is remembered
    other = [*first[2 * B :], *prompt(B + 3, seed=51)]  # starts with that tail's tokens
    got = run(engine, spy, other)
    cold = rig.cold(other)
    assert got.tokens == cold.tokens, f"tokens {got.tokens} != cold {cold.tokens}"
    assert mx.array_equal(got.logits, cold.logits), "last-prompt logits differ from cold"
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=4)
    warm = scored(list(engine.generate(Request(other, params, logprobs=2))))
    assert warm == scored(list(rig._cold.generate(Request(other, params, logprobs=2))))


def check_sparse_states(rig: Rig) -> None:
    """Recurrent state kept only every third block (`state_stride` 3, as the measured
    default may choose), each request on a new PromptCache over the same directory (only
    the disk tier's states: the ones between strides lived in the previous cache's memory):
    forks that leave earlier prompts between kept states, and a chat's turns, give the cold
    run's tokens and log-probabilities."""
    config = CacheConfig(block_size=B, directory=rig.dir, state_stride=3)

    def fresh() -> Engine:
        return Engine(
            rig.variant.loaded,
            PromptCache(
                rig.variant.loaded.model, rig.variant.loaded.key, config, root=rig.dir / "kv"
            ),
        )

    base = prompt(9 * B + 2, seed=60)
    asks = [base, base[: 5 * B + 1] + prompt(7, seed=61), base[: 7 * B + 3] + prompt(4, seed=62)]
    turn = [*base, *prompt(6, seed=63)]
    for tokens in [*asks, turn, [*turn, *prompt(2 * B, seed=64)]]:
        request = Request(tokens, CHAT, logprobs=2)
        got = scored(list(fresh().generate(request)))
        assert got == scored(list(rig._cold.generate(request))), f"{len(tokens)} tokens: not cold's"


def check_rebuilt_layers(rig: Rig) -> None:
    """Restored at each block boundary, every layer holds what a cold canonical prefill to
    that point leaves there, compared directly (not through the replies): the same
    positions in the same order and at the same size (a sliding window's ring, `_idx`
    included), the same recurrent states. A ring rebuilt one position too wide gives the
    same replies today only because mlx-lm trims the spare position."""
    engine, spy = rig.engine()
    tokens = prompt(6 * B + 1, seed=70)
    run(engine, spy, tokens)
    resumed = set()
    for k in range(1, 7):
        with engine.cache.restore(np.asarray([*tokens[: k * B], 0], np.int32)) as lease:
            if lease.length == 0:
                continue
            resumed.add(lease.length)
            cold = make_prompt_cache(rig.variant.loaded.model)
            ids = np.asarray(tokens[: lease.length], np.int32)
            for _ in prefill(rig.variant.loaded.model, cold, ids, 0, B):
                pass
            for i, (got, want) in enumerate(zip(lease.layers, cold, strict=True)):
                where = f"layer {i} restored at {lease.length}"
                for a, b in zip(_held(got), _held(want), strict=True):
                    same = a.shape == b.shape and mx.array_equal(a, b) if _is(a, b) else a == b
                    assert same, where
    assert resumed, "no block boundary resumed"


def _held(c: Any) -> list[Any]:
    """What a layer holds: a ring's arrays as they lie (size and order matter) with its
    keep, size, offset and index; plain KV's positions up to its offset (past it, an
    allocation step); a recurrent layer's slots."""
    if isinstance(c, RotatingKVCache):
        return [c.keys, c.values, c.offset, c.keep, c.max_size, c._idx]
    if isinstance(c, ArraysCache):
        return list(c.cache)
    if isinstance(c, QuantizedKVCache):  # packed values, scales, biases
        held = [x[..., : c.offset, :] for x in (*c.keys, *c.values)]
        return [*held, c.offset, c.group_size, c.bits]
    return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset]


def _is(a: Any, b: Any) -> bool:
    """Whether both parts are arrays (a number against an array is a difference too)."""
    arrays = isinstance(a, mx.array), isinstance(b, mx.array)
    assert arrays[0] == arrays[1], f"{type(a).__name__} against {type(b).__name__}"
    return arrays[0]


def _other_kv(variant: Variant) -> list[tuple[int | None, int]]:
    """The KV widths (bits, group size) of `variant`'s model other than its own: full
    precision, the other bit width, the other group size, and both."""
    assert variant.kv_bits is not None, "a check of quantized variants"
    bits = 4 if variant.kv_bits == 8 else 8
    group = next(g for g in KV_GROUPS if g != variant.kv_group)
    return [(None, KV_GROUP), (bits, variant.kv_group), (variant.kv_bits, group), (bits, group)]


def check_kv_apart(rig: Rig) -> None:
    """A quantized variant's entries are its own: the same model at full precision, at the
    other bit width, the other group size and both, on the same directory (in this process
    and in new ones), resume nothing of them and keep their own, and the variant's own
    entries stay intact."""
    engine, spy = rig.engine()
    tokens = prompt(5 * B + 2, seed=90)
    rig.warm(engine, spy, tokens)
    base = load(rig.variant.source)
    for bits, group in _other_kv(rig.variant):
        other = Rig(Variant.of("other", base, False, kv_bits=bits, kv_group=group), rig.dir)
        other.mutant = rig.mutant
        other_engine, other_spy = other.engine()
        try:
            other.warm(other_engine, other_spy, tokens)  # resumes nothing, keeps its own
            (again,) = other.child([tokens])  # a new process resumes its own entries
        except Exception as exc:  # blocks of another width read as its own: wrong or failing
            raise AssertionError(f"KV q{bits}g{group} read another's entries: {exc}") from exc
        other.check(again, tokens, other.geo.resume(tokens), other.cold(tokens))
    reopened, spy2 = rig.engine()
    rig.warm(reopened, spy2, tokens)  # the variant's own entries, intact


def check_probes_kv_apart(rig: Rig) -> None:
    """Probe answers are kept per KV width: where the model's answers at another width
    (full precision, the other bits, the other group size) are recorded, the same model
    quantized with kernels whose bits depend on the call's shape (a stand-in for a device's
    quantized kernels; the same model key) is still refused decode KV, batching and
    drafting."""
    base = load(rig.variant.source)
    mine = quantize_kv(base, cast(int, rig.variant.kv_bits), rig.variant.kv_group)
    stand_in = dataclasses.replace(mine, model=Shaped(mine.model))
    for i, (bits, group) in enumerate(_other_kv(rig.variant)):
        directory = rig.dir / f"probes-{i}"
        exact = base if bits is None else quantize_kv(base, bits, group)
        assert probe(exact, B, directory)["decode"] and verify_probe(exact, B, directory).width > 1
        batch_verify_probe(exact, B, directory)  # recorded too (1: quantized KV never batches)
        found = probe(stand_in, B, directory)
        where = f"KV q{bits}g{group}'s probe answers were read"
        assert not found["decode"] and not found["batch"], where
        assert verify_probe(stand_in, B, directory).width == 1, where
        assert batch_verify_probe(stand_in, B, directory) == 1, where


class Uneven:
    """A stand-in device whose forwards of `failing` rows compute other bits (as a kernel
    chosen by the call's shape may): its verify probe passes some widths and not others."""

    def __init__(self, model: Any, failing: set[int]) -> None:
        self._model, self.failing = model, failing

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        out = self._model(x, cache=cache)
        return out * (1 + 1e-3) if int(x.shape[1]) in self.failing else out


def check_uneven_widths(rig: Rig) -> None:
    """On a device whose verify forwards of 3 rows are inexact and of 2, 5 and 9 exact, the
    probe records each width's verdict, drafting uses width 2 only (a plan of k drafts
    runs every width up to k + 1), and a drafted reply is the plain one."""
    stand_in = dataclasses.replace(
        rig.variant.loaded,
        model=Uneven(rig.variant.loaded.model, {3}),
        key=rig.variant.loaded.key + "-uneven",
    )
    drafting = Drafting(stand_in, DraftConfig(mode="lookup", tokens=4, ngram=1), B, rig.dir)
    assert drafting.verify().passed == {2: True, 3: False, 5: True, 9: True}
    plan = drafting.plan()
    assert plan is not None and plan.k == 1, f"drafting planned {plan} past a failing width"
    tokens = prompt(9, seed=95)
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=6)
    cold = Engine(stand_in, NoCache(stand_in.model, B))
    plain = scored(list(cold.generate(Request(tokens, params, logprobs=2))))
    reply = [t for t, logprob, _ in plain if logprob is not None]
    oracle = Oracle(len(tokens), reply, len(stand_in.tokenizer))
    drafting.drafter = lambda _plan, _share=None: oracle  # type: ignore[method-assign]
    engine, _spy = Rig(dataclasses.replace(rig.variant, loaded=stand_in), rig.dir).engine()
    engine.drafting = drafting
    got = list(engine.generate(Request(tokens, params, logprobs=2, draft="lookup")))
    assert scored(got) == plain, "a drafted reply differs from the plain one"
    done = next(e for e in got if isinstance(e, Done)).result
    assert done.stats.drafted_tokens > 0, "nothing was drafted"


def _stop_cases(pieces: list[str]) -> dict[int, str]:
    """A stop string of two characters for each reply position p whose text first shows it
    once token p is added (a stop ending at every token the text allows)."""
    text = "".join(pieces)
    ends = list(itertools.accumulate(len(piece) for piece in pieces))
    cases = {}
    for p, end in enumerate(ends):
        stop = text[end - 2 : end]
        if p and end >= 2 and ends[p - 1] < end and text.find(stop) + 2 == end:
            cases[p] = stop
    return cases


def _where(p: int, stop_start: int, ends: list[int], starts: list[int]) -> set[str]:
    """Where a stop ending at reply position p falls among the verify rounds (`starts`: each
    round's first position): at a round's first row, inside a round, across rounds."""
    first = next(q for q, end in enumerate(ends) if end > stop_start)

    def round_of(q: int) -> int:
        return max((s for s in starts if s <= q), default=-1)

    kinds = {"start"} if p in starts else {"inside"} if round_of(p) >= 0 else set()
    return kinds | ({"across"} if round_of(first) != round_of(p) else set())


def _done(events: list[Event]) -> tuple[list[int], str, str | None]:
    result = next(e for e in events if isinstance(e, Done)).result
    return result.tokens, result.finish_reason, result.stop_string


def check_drafted_stops(rig: Rig) -> None:
    """A drafted reply with a stop string is the plain reply with the same stop (tokens,
    log-probabilities, end), for a stop ending at every token of the reply: at a verify
    round's first row, inside a round (accepted drafts after it), and spanning two rounds;
    with drafts accepted and rejected at every row (the oracle), prompt lookup, and a draft
    model (the target's own weights: every draft accepted) where one applies."""
    engine, _spy = rig.engine()
    assert isinstance(engine.cache, PromptCache)
    allowed = measured(engine.loaded, engine.cache.config)
    engine.batch_decode, engine.decode_matches_prefill = allowed["batch"], allowed["decode"]
    loaded = rig.variant.loaded
    cold = Engine(loaded, NoCache(loaded.model, B))
    width = Drafting(engine.loaded, DraftConfig(mode="lookup"), B, rig.dir).verify().width
    p = prompt(9, seed=33)
    seeded = SamplingParams(max_tokens=14, temperature=0.7, seed=8)
    whole = list(cold.generate(Request(p, seeded, logprobs=2)))
    reply = [e.token for e in whole if isinstance(e, Token) and e.logprob is not None]
    pieces = [e.text for e in whole if isinstance(e, Token) and e.logprob is not None]
    ends = list(itertools.accumulate(len(piece) for piece in pieces))
    kinds: set[str] = set()
    for at, stop in _stop_cases(pieces).items():
        oracle = Oracle(len(p), reply, len(loaded.tokenizer))
        engine.drafting = OracleDrafting(engine.loaded, rig.dir, oracle)
        asked = Request(p, seeded, stop_strings=(stop,), logprobs=2, draft="lookup")
        plain = list(cold.generate(dataclasses.replace(asked, draft=None)))
        got = list(engine.generate(asked))
        where = f"a stop ending at reply token {at}"
        assert _done(plain)[1:] == ("stop", stop), f"{where} did not stop the plain reply"
        assert scored(got) == scored(plain), f"{where}: the drafted reply differs"
        assert _done(got) == _done(plain), f"{where}: the drafted reply ends otherwise"
        kinds |= _where(at, ends[at] - 2, ends, oracle.starts)
    if width > 1:
        assert kinds >= {"start", "inside", "across"}, f"stops fell only {kinds}"
    greedy = SamplingParams(max_tokens=14)
    whole = list(cold.generate(Request(p, greedy, logprobs=2)))
    pieces = [e.text for e in whole if isinstance(e, Token) and e.logprob is not None]
    for mode, drafting in _real_drafters(rig, engine).items():
        engine.drafting = drafting
        for at, stop in _stop_cases(pieces).items():
            asked = Request(p, greedy, stop_strings=(stop,), logprobs=2, draft=mode)
            plain = list(cold.generate(dataclasses.replace(asked, draft=None)))
            got = list(engine.generate(asked))
            where = f"{mode}: a stop ending at reply token {at}"
            assert scored(got) == scored(plain), f"{where}: the drafted reply differs"
            assert _done(got) == _done(plain), f"{where}: the drafted reply ends otherwise"


def _real_drafters(rig: Rig, engine: Engine) -> dict[str, Drafting]:
    """Prompt lookup, and the model drafting for itself where it may draft (plain KV)."""
    config = DraftConfig(mode="lookup", tokens=4, ngram=1)
    out = {"lookup": Drafting(engine.loaded, config, B, rig.dir)}
    if all(type(c) is KVCache for c in new_layers(rig.variant.loaded.model)):
        out["model"] = _self_drafting(rig, engine)
    return out


def _self_drafting(rig: Rig, engine: Engine) -> Drafting:
    """Drafting by a draft model with the target's own weights, on its own prompt cache."""
    loaded = rig.variant.loaded
    config = CacheConfig(block_size=B, directory=rig.dir)
    cache = PromptCache(loaded.model, loaded.key, config, root=rig.dir / "draft-kv")
    asked = DraftConfig(mode="model", model=loaded.name, tokens=4)
    return Drafting(engine.loaded, asked, B, rig.dir, DraftModel(loaded, cache))


def check_self_drafted(rig: Rig) -> None:
    """A draft model with the target's own weights drafts what greedy decoding picks: every
    draft is accepted, on a first prompt and on a next turn that resumes from the draft
    model's prompt cache (a draft model whose KV kept a stale position drafts from other
    positions, and is caught here by its acceptance, not only by a slower run), and the
    reply is the plain one."""
    assert all(type(c) is KVCache for c in new_layers(rig.variant.loaded.model)), "plain KV"
    engine, _spy = rig.engine()
    cold = Engine(rig.variant.loaded, NoCache(rig.variant.loaded.model, B))
    engine.drafting = _self_drafting(rig, engine)
    tokens = prompt(2 * B + 1, seed=34)
    for turn in range(2):
        greedy = SamplingParams(max_tokens=10)
        plain = list(cold.generate(Request(tokens, greedy, logprobs=2)))
        got = list(engine.generate(Request(tokens, greedy, logprobs=2, draft="model")))
        assert scored(got) == scored(plain), f"turn {turn}: the drafted reply differs"
        stats = next(e for e in got if isinstance(e, Done)).result.stats
        if engine.drafting.verify().width > 1:
            assert stats.draft == "model" and stats.drafted_tokens > 0, "nothing was drafted"
            assert stats.accepted_tokens == stats.drafted_tokens, (
                f"turn {turn}: {stats.accepted_tokens} of {stats.drafted_tokens} drafts accepted"
            )
        reply = [t for t, logprob, _ in scored(plain) if logprob is not None]
        tokens = [*tokens, *reply, *prompt(B + 2, seed=35 + turn)]


def check_models_interleaved(rig: Rig, other: Variant) -> None:
    """Two models' requests on one engine worker (a server of several models: one thread
    owns MLX and steps both engines): run together, interleaved call by call, each reply
    is its own model's cold reply, token for token."""
    second = Rig(other, rig.dir / "other", rig.mutant)
    long, short = prompt(21), prompt(5, seed=3)
    # Each engine numbers its lanes from 0: the second's first request ends first.
    engines = [(rig, rig.engine()[0], [long, short]), (second, second.engine()[0], [short, long])]
    worker = EngineWorker(None, max_lanes=4).start()
    try:
        worker.run(lambda: [worker.attach(engine) for _, engine, _ in engines])
        done: queue.SimpleQueue[tuple[int, Result]] = queue.SimpleQueue()
        jobs = [(r, engine, p) for r, engine, prompts in engines for p in prompts]

        def sink(i: int) -> Callable[[Event], None]:
            return lambda event: done.put((i, event.result)) if isinstance(event, Done) else None

        def submit_all() -> None:  # on the worker's thread: all queued before its next step
            for i, (_, engine, tokens) in enumerate(jobs):
                worker.submit(Request(tokens, GREEDY), sink(i), engine)

        worker.run(submit_all)
        results = dict(done.get(timeout=600) for _ in jobs)
    finally:
        worker.close()
    for i, (r, _, tokens) in enumerate(jobs):
        assert results[i].tokens == r.cold(tokens).tokens, f"request {i}: not its model's reply"

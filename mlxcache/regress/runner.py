"""Running a suite under execution variants that must all give the same bytes.

- cold: no prompt cache, one request at a time;
- warm: one prompt cache for the whole suite, so later cases resume from earlier ones;
- disk: a fresh process on the warm variant's cache directory (memory empty: disk tier);
- lanes: two cases at a time, every step's requests submitted together;
- drafted: as warm, every reply drafted by prompt lookup (speculative decoding), where the
  device verifies exactly (`drafting`; elsewhere it decodes plainly, and says so).

Each case is a coroutine that yields the requests of a step and receives their results,
so the same case code serves the sequential and the concurrent schedules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxcache import __version__, units
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig, DraftConfig, default_block_size
from mlxcache.drafting import Drafting
from mlxcache.engine import Engine, Request
from mlxcache.errors import MlxcacheError
from mlxcache.events import Result
from mlxcache.model import LoadedModel, load
from mlxcache.modes import json_mode
from mlxcache.modes.tool_chat import ToolsTask
from mlxcache.modes.tools import ToolChoice, parse_tools
from mlxcache.paths import cache_dir
from mlxcache.regress import VARIANTS
from mlxcache.regress.golden import golden_adapter
from mlxcache.regress.suite import SAMPLING_KEYS, Case, Messages, Output, Suite, turns
from mlxcache.runtime import make_cache, measured

Steps = units.Steps[list[Output]]


def _output(result: Result) -> Output:
    return {"text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason}


def steps(engine: Engine, case: Case) -> Steps:
    """The requests of `case`, step by step (later steps may depend on earlier replies)."""
    make = _requests(engine, case)
    conversation = turns(case)
    try:
        asked = next(conversation)
        while True:
            results = yield [make(m) for m in asked]
            asked = conversation.send([_output(r) for r in results])
    except StopIteration as stop:
        outputs: list[Output] = stop.value
        return outputs


def _requests(engine: Engine, case: Case) -> Callable[[Messages], Request]:
    """How `case` turns the messages of a request (`suite.turns`) into one."""
    p = case.sampling
    if case.kind in ("plain", "chat"):
        return lambda messages: Request(engine.encoder.encode_chat(messages), p)
    if case.kind == "json":
        task = json_mode.JsonTask.create(case.data["schema"], case.data.get("instructions"))
        return lambda messages: json_mode.request(
            engine, json_mode.encode(engine, task.messages(messages[-1]["content"])), task, p
        )
    tools = parse_tools(case.data["tools"], f"case {case.name!r} tools")
    choice = ToolChoice.parse(str(case.data.get("tool_choice", "auto")), tools)
    tools_task = ToolsTask(tools, choice, case.data.get("system"))
    return lambda messages: tools_task.request(engine, tools_task.encode(engine, messages), p)


Progress = Callable[[str, str], None]
"""Called with (case name, "start" | "end") as cases run."""


def _quiet(_name: str, _what: str) -> None:
    return None


def run_sequential(
    engine_for: Callable[[Case], Engine], cases: tuple[Case, ...], progress: Progress = _quiet
) -> dict[str, list[Output]]:
    """Every request alone, in suite order."""
    out: dict[str, list[Output]] = {}
    for case in cases:
        progress(case.name, "start")
        engine = engine_for(case)
        gen = steps(engine, case)
        try:
            reqs = next(gen)
            while True:
                reqs = gen.send([engine.complete(r) for r in reqs])
        except StopIteration as stop:
            out[case.name] = stop.value
        progress(case.name, "end")
    return out


def run_concurrent(
    engine_for: Callable[[Case], Engine],
    cases: tuple[Case, ...],
    progress: Progress = _quiet,
    width: int = 2,
) -> dict[str, list[Output]]:
    """Up to `width` cases at once per model; a step's requests are all in flight together."""
    out: dict[str, list[Output]] = {}
    for model in dict.fromkeys(c.runs_on for c in cases):
        engine = engine_for(next(c for c in cases if c.runs_on == model))
        started = ((c.name, partial(steps, engine, c)) for c in cases if c.runs_on == model)
        for name, value in units.run_units(engine, started, width):
            out[name] = value
            progress(name, "end")
    return {c.name: out[c.name] for c in cases}


class LocalRunner:
    """Loads each model once and runs the suite under the chosen variants."""

    def __init__(
        self,
        suite: Suite,
        work_dir: Path,
        block_size: int | None = None,
        progress: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.suite = suite
        self.work_dir = work_dir
        self.block_size = block_size or default_block_size()
        self.progress = progress
        """Called with (variant, case name or "", "start" | "end") as the run goes."""
        self._models: dict[tuple[str | None, str | None], LoadedModel] = {}
        self.cache_stats: dict[str, dict[str, int]] = {}
        """Per variant: prompt-cache hits, cached tokens and disk hits (proof it resumed)."""

    def model(self, case: Case) -> LoadedModel:
        if case.runs_on not in self._models:
            self._models[case.runs_on] = load(case.model, adapter=case.adapter)
        return self._models[case.runs_on]

    def _engines(
        self, cached: bool, disk: bool, drafted: bool = False
    ) -> tuple[Callable[[Case], Engine], list[PromptCache]]:
        """An engine per model, made on first use, and the caches they were given."""
        engines: dict[tuple[str | None, str | None], Engine] = {}
        caches: list[PromptCache] = []
        config = CacheConfig(
            enabled=cached,
            block_size=self.block_size,
            directory=self.work_dir,
            disk_bytes=(20 << 30) if disk else 0,
        )

        def engine_for(case: Case) -> Engine:
            if case.runs_on not in engines:
                loaded = self.model(case)
                cache = make_cache(loaded, config)
                if isinstance(cache, PromptCache):
                    caches.append(cache)
                drafting = None
                if drafted:
                    lookup = DraftConfig(mode="lookup")
                    # The device's verify record lives with the user's cache (keyed by model
                    # and device), not in this run's scratch directory: measured once.
                    record = cache_dir()
                    drafting = Drafting(loaded, lookup, self.block_size, record)
                # The recorded probe answer (a file read): a reply's decode KV kept
                # where the device computes it exactly, as chat keeps it.
                allowed = measured(loaded, config, measure=False)
                engines[case.runs_on] = Engine(
                    loaded,
                    cache,
                    drafting=drafting,
                    decode_matches_prefill=allowed["decode"],
                    batch_decode=allowed["batch"],
                )
            return engines[case.runs_on]

        return engine_for, caches

    def run(self, variant: str) -> dict[str, list[Output]]:
        """Outputs of every case under `variant`."""
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}")
        report = self.progress or (lambda _v, _c, _w: None)
        report(variant, "", "start")
        outputs = self._run(variant, lambda name, what: report(variant, name, what))
        report(variant, "", "end")
        return outputs

    def _run(self, variant: str, progress: Progress) -> dict[str, list[Output]]:
        if variant == "disk":
            return self._run_child(progress)
        engine_for, caches = self._engines(
            cached=variant != "cold", disk=variant == "warm", drafted=variant == "drafted"
        )
        schedule = run_concurrent if variant == "lanes" else run_sequential
        outputs = schedule(engine_for, self.suite.cases, progress)
        reports = [c.report() for c in caches]
        self.cache_stats[variant] = {
            k: sum(r[k] for r in reports) for k in ("hits", "cached_tokens", "disk_hits")
        }
        return outputs

    def _run_child(self, progress: Progress) -> dict[str, list[Output]]:
        """The warm variant in a new process on the same cache directory (disk tier only);
        its cases' progress, which it writes on stderr, goes on to `progress`."""
        suite_file = self.work_dir / "suite.json"
        suite_file.write_text(json.dumps([_case_doc(c) for c in self.suite.cases]))
        argv = [sys.executable, "-m", "mlxcache.regress.child"]
        argv += [str(suite_file), str(self.work_dir), str(self.block_size)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stderr is not None
            with ThreadPoolExecutor(1) as pool:
                stdout = pool.submit(proc.stdout.read)  # no pipe fills while stderr is read
                others = [line for line in proc.stderr if not _relay(line, progress)]
                stdout.result()
        finally:
            if proc.poll() is None:  # interrupted: the child goes too
                proc.kill()
            proc.wait()
        if proc.returncode != 0:
            last = ("".join(others).strip().splitlines() or ["no message"])[-1]
            raise MlxcacheError(f"the disk variant's process failed: {last}")
        doc = json.loads(stdout.result())
        self.cache_stats["disk"] = doc["cache"]
        result: dict[str, list[Output]] = doc["outputs"]
        return result

    def models(self) -> dict[str, str]:
        """Model key of every case's model."""
        return {c.name: self.model(c).key for c in self.suite.cases}

    def adapters(self) -> dict[str, dict[str, str] | None]:
        """The adapter every case's model runs with (`golden.golden_adapter`), None for none."""
        return {c.name: golden_adapter(self.model(c).adapter) for c in self.suite.cases}

    def versions(self) -> dict[str, str]:
        """The versions the outputs depend on: this process's."""
        import mlx_lm

        return {
            "mlxcache": __version__,
            "mlx": getattr(mx, "__version__", "?"),
            "mlx_lm": mlx_lm.__version__,
        }


PROGRESS = "mlxcache-regress-progress\t"
"""How the disk variant's process marks its progress lines on stderr."""


def _relay(line: str, progress: Progress) -> bool:
    """Pass a progress line of the disk variant's process on to `progress` (False: not one)."""
    if not line.startswith(PROGRESS):
        return False
    case, what = json.loads(line[len(PROGRESS) :])
    progress(case, what)
    return True


def _case_doc(case: Case) -> dict[str, Any]:
    sampling = {k: getattr(case.sampling, k) for k in SAMPLING_KEYS}
    named = {"name": case.name, "kind": case.kind, "model": case.model, "adapter": case.adapter}
    return {**named, **sampling, **case.data}

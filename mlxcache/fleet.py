"""Several models behind one server, under one memory budget (`serve -m A -m B`, `--models`).

Each served model is a `ModelEntry` (`model_entries`): its name, its spec, the other names requests may use,
and how it is loaded. A request names one (or none: the first, the default); a name that
is not served is refused, so a request never loads a path it names. A model loads when a
request first asks for it (or at start), on the engine worker's thread, which owns MLX
and steps every loaded model's engine (`worker`); it is unloaded when the one memory
budget (`--mem-limit`) needs room for another, least recently used first, or when it has
been idle for the keep-alive time (Ollama's `keep_alive`). A model in use (a request
preparing, queued or running on it) is never unloaded. Room is made for the most a
model's load holds (its tokenizer's parse passes what the model then keeps), measured at
each load (`membudget.peak_during`), estimated from its files before the first. A model
that cannot load (a damaged or unsupported file) answers every request for it with that
one error; one whose load failed otherwise (out of memory, a full disk) answers so for
`RETRY_S`, then a request tries its load again. The others go on serving.

Each model keeps its own engine, hence its own prompt cache namespace and replies equal to
its solo replies; the memory tier's budget (`--cache-mem`) is split evenly among the
served models, and their requests' memory is reserved in one shared account
(`membudget.MemoryBudget.reserved`).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcache.config import CacheConfig, DraftConfig, human_bytes
from mlxcache.engine import Engine
from mlxcache.errors import (
    MemoryBusyError,
    MemoryLimitError,
    ModelLoadError,
    ModelNotServedError,
    UserInputError,
)
from mlxcache.membudget import (
    TIER_SHARE,
    Footprint,
    MemoryBudget,
    peak_during,
    resident_bytes,
    widest_chunk,
)
from mlxcache.model_entries import ModelEntry, check_names
from mlxcache.sysmem import release_unused
from mlxcache.worker import EngineWorker

if TYPE_CHECKING:  # the probes' code (MLX) is imported when a model is opened
    from mlxcache.invariance import Note


@dataclass(slots=True)
class Resident:
    """A loaded model: its engine, what it was measured to hold, when it was last used."""

    entry: ModelEntry
    engine: Engine
    size: int
    used: float
    info: dict[str, Any]
    """What the opener published about it (the server's identity card)."""
    pins: int = 0


Opener = Callable[[ModelEntry, int, Mapping[str, Any] | None], tuple[Engine, dict[str, Any]]]
"""Open an entry's engine with a memory tier of the given bytes and the weights it may
share (`model.load`'s `shared`); its published identity."""

RETRY_S = 10.0
"""A load that failed but for bad input (`UserInputError`) is tried again this long after."""

COUNTERS = ("hits", "misses", "cached_tokens", "disk_hits", "evictions_mem", "evictions_disk")
"""A model's cache counters (`/metrics`' totals), kept over its unloads (`Fleet.retired`)."""


@dataclass(slots=True)
class Fleet:
    """The served models and which of them are loaded (see the module's doc).

    Loading, unloading and their bookkeeping run on the worker's thread (`worker.run`);
    request handlers call `acquire` and `release`, from any thread.

    Args:
        entries: the served models, the default first; names checked (`check_names`).
        worker: the engine worker that owns MLX (no default engine of its own).
        opener: opens an entry's engine (the CLI's, from serve's options).
        limit: the memory budget in bytes (`--mem-limit`); None: no limit.
        keep_alive: unload a model idle this many seconds; None: never.
        tier_bytes: the memory tier's whole budget, split evenly among the models.
        clock: seconds, monotonic (tests give their own).
        meter: the process's memory now (tests give their own account).
        size_of: the bytes a model will hold once loaded, known before (its weights' files).
        peak_of: the most its first load will hold, known before (`load_peak_estimate`).
        load_peak: runs a load; its result and the most the process grew while it ran.
        on_note: told each load and unload, in one line.
    """

    entries: list[ModelEntry]
    worker: EngineWorker
    opener: Opener
    limit: int | None = None
    keep_alive: float | None = None
    tier_bytes: int = 0
    clock: Callable[[], float] = time.monotonic
    meter: Callable[[], int] = resident_bytes
    size_of: Callable[[ModelEntry], int] = field(default=lambda e: 0)
    peak_of: Callable[[ModelEntry], int] = field(default=lambda e: 0)
    load_peak: Callable[[Callable[[], Any]], tuple[Any, int]] = peak_during
    on_note: Callable[[str], None] = field(default=lambda _m: None)
    resident: dict[str, Resident] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    retry_at: dict[str, float] = field(default_factory=dict)
    """When a model whose load failed for a passing reason may be tried again."""
    loads: dict[str, int] = field(default_factory=dict)
    """Loads per model since start (a reload counts)."""
    measured: dict[str, int] = field(default_factory=dict)
    """What each model was measured to add to the process when it last loaded."""
    peaks: dict[str, int] = field(default_factory=dict)
    """The most each model's last load added to the process while it ran."""
    retired: dict[str, int] = field(default_factory=dict)
    """The cache counters (`COUNTERS`) of the engines unloaded so far, added up."""
    base: int = 0
    _reserved: dict[tuple[int, int], int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        check_names(self.entries)
        self.base = self.meter()

    @property
    def default(self) -> ModelEntry:
        return self.entries[0]

    def entry(self, requested: str | None) -> ModelEntry:
        """The entry a request's `model` names (None or empty: the default).

        Raises:
            ModelNotServedError: no served model goes by that name.
        """
        if not requested:
            return self.default
        for entry in self.entries:
            if requested in entry.names:
                return entry
        raise ModelNotServedError(f"model {requested!r} is not served here ({self.served()})")

    def served(self) -> str:
        """What is served, for a 404: each model and its aliases."""
        parts = []
        for entry in self.entries:
            also = (
                f" (aliases {', '.join(repr(a) for a in entry.aliases)})" if entry.aliases else ""
            )
            parts.append(f"{entry.name!r}{also}")
        return "it serves " + ", ".join(parts) + "; a request never loads a model it names"

    def acquire(self, requested: str | None) -> Resident:
        """The loaded model a request names (loaded now if it is not), held loaded until
        `release` (a request submitted meanwhile is then held by its job until it ends).

        Raises:
            ModelNotServedError: not a served name.
            ModelLoadError: the model failed to load (now or before).
            MemoryBusyError: no room can be made now (models in use hold it): retry.
            MemoryLimitError: the model does not fit the budget even alone.
        """
        entry = self.entry(requested)
        self._check_failed(entry)
        return self.worker.run(lambda: self._acquire(entry))

    def _check_failed(self, entry: ModelEntry) -> None:
        """Raise the error of `entry`'s failed load, unless its retry time has come."""
        message = self.failed.get(entry.name)
        if message is None:
            return
        retry = self.retry_at.get(entry.name)
        if retry is None or self.clock() < retry:
            raise ModelLoadError(message)

    def release(self, resident: Resident) -> None:
        """`acquire`'s hold ends (any thread), on the worker thread after what the holder
        sent it before: a request submitted under the hold is then a job of the worker's,
        which keeps the model loaded (`_idle`), never a message still in its inbox that a
        model switch queued earlier could overtake by unloading it."""
        self.worker.later(lambda: self._unpin(resident))

    def _unpin(self, resident: Resident) -> None:
        with self._lock:
            resident.pins -= 1
            resident.used = self.clock()

    @contextlib.contextmanager
    def lease(self, requested: str | None) -> Iterator[Resident]:
        """`acquire` and `release` around a block."""
        resident = self.acquire(requested)
        try:
            yield resident
        finally:
            self.release(resident)

    def load_all(self) -> None:
        """Load every model now, in order (`serve --load-all`), as far as the budget lets
        earlier ones stay; a model that fails raises (the server does not start)."""
        for entry in self.entries:
            with self.lease(entry.name):
                pass

    def expire(self) -> list[str]:
        """Unload the models idle for the keep-alive time; their names (worker thread)."""
        if self.keep_alive is None:
            return []
        now = self.clock()
        gone = [r.entry.name for r in self._idle() if now - r.used >= self.keep_alive]
        for name in gone:
            self._unload(name, f"idle for {self.keep_alive:g} s")
        return gone

    def report(self) -> list[dict[str, Any]]:
        """Every served model: its names, whether loaded, its memory and idle seconds."""
        now = self.clock()
        out = []
        for entry in self.entries:
            r = self.resident.get(entry.name)
            row: dict[str, Any] = {
                "name": entry.name,
                "model": entry.model,
                "aliases": list(entry.aliases),
                "loaded": r is not None,
                "default": entry is self.default,
                "loads": self.loads.get(entry.name, 0),
            }
            if r is not None:
                busy = r.pins or self.worker.jobs_on(r.engine)
                row.update(size_bytes=r.size, idle_s=0.0 if busy else round(now - r.used, 1))
            if entry.name in self.peaks:
                row["load_peak_bytes"] = self.peaks[entry.name]
            if entry.name in self.failed:
                row["error"] = self.failed[entry.name]
            out.append(row)
        return out

    # -- the worker thread ------------------------------------------------------------------

    def _acquire(self, entry: ModelEntry) -> Resident:
        resident = self.resident.get(entry.name)
        if resident is None:
            resident = self._load(entry)
        with self._lock:
            resident.pins += 1
            resident.used = self.clock()
        return resident

    def _load(self, entry: ModelEntry) -> Resident:
        self._check_failed(entry)  # failed while this request waited its turn
        try:  # its weights' files, or what it was measured to take when loaded before
            size = max(self.size_of(entry), self.measured.get(entry.name, 0))
            peak = self.peaks.get(entry.name)
            need = max(size, self.peak_of(entry) if peak is None else peak)
        except Exception as exc:  # the spec names nothing loadable: its load's own error
            raise self._failure(entry, exc) from exc
        tier = self.tier_bytes // len(self.entries)
        if self.limit is not None:
            self._make_room(entry, need)
            tier = max(min(tier, (self.limit - self.base - size) // TIER_SHARE), 0)
        start, before = self.clock(), self.meter()
        shared = self._shared(entry)
        try:
            (engine, info), peak = self.load_peak(lambda: self.opener(entry, tier, shared))
        except Exception as exc:
            raise self._failure(entry, exc) from exc
        if shared is None:  # a load beside its base's holder peaks lower than one alone
            self.peaks[entry.name] = peak
        self.failed.pop(entry.name, None)
        self.retry_at.pop(entry.name, None)
        # What loading took beyond the weights (the tokenizer, the probes' buffers) counts
        # from now on: the next time room is made for it, it is made for all of it. Room
        # was made for its own weights; sharing another's, it holds what it added.
        grown = self.meter() - before
        self.measured[entry.name] = grown if shared is not None else max(grown, size)
        if self.limit is not None:
            engine.budget = MemoryBudget(
                self.limit,
                self.base + self.measured[entry.name],
                Footprint.of(engine.model, engine.loaded.config),
                widest_chunk(engine.cache.block_size),
                self._reserved,
            )
        self.worker.attach(engine)
        resident = Resident(entry, engine, self.measured[entry.name], self.clock(), info)
        self.resident[entry.name] = resident
        self.loads[entry.name] = self.loads.get(entry.name, 0) + 1
        self.on_note(f"loaded {entry.name} ({human_bytes(size)}, {self.clock() - start:.1f} s)")
        self._settle(entry)
        return resident

    def _settle(self, entry: ModelEntry) -> None:
        """After a load that took more than room was made for (a first load, estimated):
        unload the others no request holds, least recently used first, until the process
        is back under the limit (else their requests would be refused by it)."""
        if self.limit is not None and self.meter() > self.limit:
            release_unused()  # what the load left in MLX's pool first: no unload for it
        while self.limit is not None and self.meter() > self.limit:
            others = [r for r in self._idle() if r.entry.name != entry.name]
            if not others:
                return
            victim = min(others, key=lambda r: r.used).entry.name
            del others  # no reference may outlive the unload: its memory is measured next
            self._unload(victim, f"least recently used, for {entry.name}")

    def _shared(self, entry: ModelEntry) -> Mapping[str, Any] | None:
        """The base weights a loaded model of `entry`'s spec holds (adapters of one base
        share them: each its own layers over the same arrays), or None."""
        for r in self.resident.values():
            if r.entry.model == entry.model and r.engine.loaded.base_weights is not None:
                return r.engine.loaded.base_weights
        return None

    def _failure(self, entry: ModelEntry, exc: Exception) -> ModelLoadError:
        """Remember why `entry` cannot load: its requests get this (until `RETRY_S` have
        passed, when the cause was not its files), the others go on."""
        why = " ".join(str(exc).split()) or type(exc).__name__
        message = f"model {entry.name!r} cannot be loaded: {why}"
        self.failed[entry.name] = message
        if isinstance(exc, UserInputError):
            self.retry_at.pop(entry.name, None)
        else:
            self.retry_at[entry.name] = self.clock() + RETRY_S
        self.on_note(message)
        return ModelLoadError(message)

    def _make_room(self, entry: ModelEntry, size: int) -> None:
        """Unload idle models, least recently used first, until `entry`'s load fits the
        budget (`size`: the most it holds while it loads).

        Raises:
            MemoryLimitError: it does not fit even with no other model loaded.
            MemoryBusyError: it would fit, but the models holding the room are in use.
        """
        assert self.limit is not None
        if self.base + size > self.limit:
            raise MemoryLimitError(
                f"model {entry.name!r} needs about {human_bytes(size)}, and the memory limit "
                f"{human_bytes(self.limit)} leaves {human_bytes(max(self.limit - self.base, 0))} "
                "for models: raise --mem-limit"
            )
        while self.meter() + size > self.limit:
            idle = sorted(self._idle(), key=lambda r: r.used)
            if not self.resident:  # what the process holds beside any model has grown
                raise MemoryLimitError(
                    f"model {entry.name!r} needs about {human_bytes(size)}, and the process "
                    f"holds {human_bytes(self.meter())} with no model loaded: the memory "
                    f"limit {human_bytes(self.limit)} leaves too little; raise --mem-limit"
                )
            if not idle:
                busy = ", ".join(sorted(self.resident))
                raise MemoryBusyError(
                    f"model {entry.name!r} needs about {human_bytes(size)} of memory, held now "
                    f"by models in use ({busy}): retry when their requests end"
                )
            victim = idle[0].entry.name
            del idle  # no reference may outlive the unload: its memory is measured next
            self._unload(victim, f"least recently used, for {entry.name}")

    def _idle(self) -> list[Resident]:
        """The loaded models no request holds (one that is held counts as used now)."""
        now = self.clock()
        idle = []
        with self._lock:
            for r in self.resident.values():
                if r.pins or self.worker.jobs_on(r.engine):
                    r.used = now
                else:
                    idle.append(r)
        return idle

    def _unload(self, name: str, why: str) -> None:
        """Drop a model no request holds: its engine's arrays are freed now (its cache's
        counters kept in `retired`)."""
        engine = self.resident.pop(name).engine
        counts = engine.cache.report()
        for key in COUNTERS:
            self.retired[key] = self.retired.get(key, 0) + int(counts.get(key, 0))
        self.worker.detach(engine)
        del engine, counts
        gc.collect()  # its last references may be in cycles
        release_unused()
        self.on_note(f"unloaded {name} ({why})")


def opener(
    config: CacheConfig,
    draft: DraftConfig | None = None,
    on_warning: Callable[[str], None] | None = None,
    on_note: Note | None = None,
    batch_inexact: bool = False,
) -> Opener:
    """How a server opens each of its models: as `serve` opens its one (`open_engine`,
    what the device computes exactly measured), with the entry's KV width, its share of
    the memory tier, its load options, and its published identity (`wire.identity`)."""

    def open_entry(
        entry: ModelEntry, tier: int, shared: Mapping[str, Any] | None = None
    ) -> tuple[Engine, dict[str, Any]]:
        from mlxcache.runtime import batch_anyway, open_engine
        from mlxcache.wire import identity

        own = entry_config(config, entry, tier)
        engine = open_engine(
            entry.model,
            own,
            on_warning=on_warning,
            invariant=True,
            draft=draft,
            on_note=on_note,
            shared=shared,
            **entry.load_options(),
        )
        inexact = batch_inexact and not engine.batch_decode and batch_anyway(engine)
        return engine, identity(entry.model, engine, own, not inexact)

    return open_entry


def entry_config(config: CacheConfig, entry: ModelEntry, tier: int = 0) -> CacheConfig:
    """A served model's cache settings: the server's, with the entry's KV width and a
    memory tier of `tier` bytes; the budget is the fleet's (none of its own).

    Raises:
        SettingError: the entry's KV width is not one the cache takes.
    """
    bits = config.kv_bits if entry.kv_bits is None else entry.kv_bits
    return replace(config, kv_bits=bits, mem_bytes=tier, mem_limit=0)


def folder_size(
    root: Path | None, on_warning: Callable[[str], None] | None = None
) -> Callable[[ModelEntry], int]:
    """`Fleet.size_of` from the models' folders (a GGUF converted first, once)."""
    from mlxcache.model.loader import model_folder

    return lambda entry: weights_bytes(model_folder(entry.model, root, on_warning))


TOKENIZER_PEAK = 16
"""A tokenizer's load holds about this many times its tokenizer.json's bytes at its peak
(measured: Gemma 3 270M's 33 MB file, 517-560 MB; SmolLM2's 3.5 MB, ~60 MB)."""


def load_peak_estimate(
    root: Path | None, on_warning: Callable[[str], None] | None = None
) -> Callable[[ModelEntry], int]:
    """`Fleet.peak_of` from the models' folders: their tokenizer's parse (`TOKENIZER_PEAK`)."""
    from mlxcache.model.loader import model_folder

    def estimate(entry: ModelEntry) -> int:
        tokenizer = model_folder(entry.model, root, on_warning) / "tokenizer.json"
        return TOKENIZER_PEAK * tokenizer.stat().st_size if tokenizer.is_file() else 0

    return estimate


def weights_bytes(folder: Path) -> int:
    """The bytes a model folder's weights take once loaded (their files' sizes)."""
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


class Ticker:
    """Calls `fn` every `every` seconds on its own thread until `stop` (keep-alive)."""

    def __init__(self, fn: Callable[[], object], every: float) -> None:
        self._stop = threading.Event()
        self._fn = fn
        self._every = every
        self._thread = threading.Thread(target=self._run, name="mlxcache-keepalive", daemon=True)

    def start(self) -> Ticker:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            with contextlib.suppress(Exception):  # the worker stopped: so will we
                self._fn()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

"""Several models behind one server, under one memory budget (`serve -m A -m B`, `--models`).

Each served model is a `ModelEntry` (`model_entries`): its name, its spec, the other names requests may use,
and how it is loaded. A request names one (or none: the first, the default); a name that
is not served is refused, so a request never loads a path it names. A model loads when a
request first asks for it (or at start), on the engine worker's thread, which owns MLX
and steps every loaded model's engine (`worker`); it is unloaded when the one memory
budget (`--mem-limit`) needs room for another, least recently used first, or when it has
been idle for the keep-alive time (Ollama's `keep_alive`). A model in use (a request
preparing, queued or running on it) is never unloaded. A model that fails to load
answers every request for it with that one error; the others go on serving.

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
from collections.abc import Callable, Iterator
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
)
from mlxcache.membudget import TIER_SHARE, Footprint, MemoryBudget, resident_bytes
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


Opener = Callable[[ModelEntry, int], tuple[Engine, dict[str, Any]]]
"""Open an entry's engine with a memory tier of the given bytes; its published identity."""


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
    on_note: Callable[[str], None] = field(default=lambda _m: None)
    resident: dict[str, Resident] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    loads: dict[str, int] = field(default_factory=dict)
    """Loads per model since start (a reload counts)."""
    measured: dict[str, int] = field(default_factory=dict)
    """What each model was measured to add to the process when it last loaded."""
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
        if entry.name in self.failed:
            raise ModelLoadError(self.failed[entry.name])
        return self.worker.run(lambda: self._acquire(entry))

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
        if entry.name in self.failed:  # failed while this request waited its turn
            raise ModelLoadError(self.failed[entry.name])
        try:  # its weights' files, or what it was measured to take when loaded before
            size = max(self.size_of(entry), self.measured.get(entry.name, 0))
        except Exception as exc:  # the spec names nothing loadable: its load's own error
            raise self._failure(entry, exc) from exc
        tier = self.tier_bytes // len(self.entries)
        if self.limit is not None:
            self._make_room(entry, size)
            tier = max(min(tier, (self.limit - self.base - size) // TIER_SHARE), 0)
        start, before = self.clock(), self.meter()
        try:
            engine, info = self.opener(entry, tier)
        except Exception as exc:
            raise self._failure(entry, exc) from exc
        # What loading took beyond the weights (the tokenizer, the probes' buffers) counts
        # from now on: the next time room is made for it, it is made for all of it.
        self.measured[entry.name] = max(self.meter() - before, size)
        if self.limit is not None:
            engine.budget = MemoryBudget(
                self.limit,
                self.base + self.measured[entry.name],
                Footprint.of(engine.model, engine.loaded.config),
                engine.cache.block_size,
                self._reserved,
            )
        self.worker.attach(engine)
        resident = Resident(entry, engine, self.measured[entry.name], self.clock(), info)
        self.resident[entry.name] = resident
        self.loads[entry.name] = self.loads.get(entry.name, 0) + 1
        self.on_note(f"loaded {entry.name} ({human_bytes(size)}, {self.clock() - start:.1f} s)")
        return resident

    def _failure(self, entry: ModelEntry, exc: Exception) -> ModelLoadError:
        """Remember why `entry` cannot load: its requests get this, the others go on."""
        why = " ".join(str(exc).split()) or type(exc).__name__
        message = f"model {entry.name!r} cannot be loaded: {why}"
        self.failed[entry.name] = message
        self.on_note(message)
        return ModelLoadError(message)

    def _make_room(self, entry: ModelEntry, size: int) -> None:
        """Unload idle models, least recently used first, until `entry` fits the budget.

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
        """Drop a model no request holds: its engine's arrays are freed now."""
        self.worker.detach(self.resident.pop(name).engine)
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

    def open_entry(entry: ModelEntry, tier: int) -> tuple[Engine, dict[str, Any]]:
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

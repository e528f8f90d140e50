"""Which model a request runs on: the one model of `serve -m MODEL`, or one of a fleet's
(`mlxcache.fleet`: `serve -m A -m B`, `--models FILE`). A request's `model` names it by
name or alias (none: the default, the first); replies echo the name the request used."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx

from mlxcache.engine import Engine, Request
from mlxcache.events import Event
from mlxcache.fleet import Fleet, weights_bytes
from mlxcache.membudget import resident_bytes
from mlxcache.server.errors import APIError
from mlxcache.server.stream import Handle, Tapped, Worker
from mlxcache.worker import EngineWorker


@dataclass(frozen=True, slots=True)
class Target:
    """The model a request runs on, held loaded until `release` (called once it is
    submitted, or refused)."""

    name: str
    """The name the request gave (an alias included), else the default model's."""
    engine: Engine
    worker: Worker
    """The engine worker, for this model's engine."""
    release: Callable[[], None]


class Bound:
    """An engine worker seen as the worker of one of its engines (`Worker`)."""

    def __init__(self, worker: EngineWorker, engine: Engine) -> None:
        self._worker = worker
        self._engine = engine

    def submit(self, request: Request, sink: Callable[[Event], None]) -> Handle:
        return self._worker.submit(request, sink, self._engine)

    def warm(self, tokens: list[int]) -> None:
        self._worker.warm(tokens, self._engine)

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        return self._worker.call(fn, self._engine)

    @property
    def waiting(self) -> int:
        return self._worker.waiting


class Served(Protocol):
    """What the routes need of the served models."""

    @property
    def default(self) -> str: ...

    def acquire(self, requested: str | None) -> Target:
        """The model `requested` names (loading it if it must: blocks). Raises a 404 for a
        name not served, and the fleet's errors (`Fleet.acquire`)."""
        ...

    def cards(self) -> list[dict[str, Any]]:
        """`/v1/models`: a card per name and alias."""
        ...

    def rows(self) -> list[dict[str, Any]]:
        """`/v1/ps`: each model, whether it is loaded, its memory and idle seconds."""
        ...

    def reports(self) -> dict[str, dict[str, Any]]:
        """Each loaded model's cache report (`cache_report`), by name (blocks)."""
        ...

    def counted(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        """`reports`, and the cache counters of models unloaded since the server started,
        added up (`/metrics`' totals stay monotonic): read in one job, so a model
        unloaded meanwhile counts once."""
        ...


def cache_report(engine: Engine) -> dict[str, Any]:
    """The cache's counters (`pinned_entries`: pinned by running lanes), whether lanes run,
    and what the device was measured to allow: a reply's decode KV kept ("decode_kv":
    "kept", else "re-prefilled"), requests decoding as one batch ("batched_decode"); how
    a conversation's next turn finds its reply ("next_turn": `lanes.NextTurn`); MLX's
    own memory beside the cache's: arrays in use and freed buffers it keeps for reuse
    (given back once no lane runs); the process's resident memory and its budget
    (`--mem-limit`, null: none)."""
    return {
        **engine.cache.report(),
        "busy": engine.busy,
        "warming": engine.warming,
        "decode_kv": "kept" if engine.decode_matches_prefill else "re-prefilled",
        "batched_decode": engine.batch_decode,
        "next_turn": engine.next_turn.value,
        "mlx_active_bytes": mx.get_active_memory(),
        "mlx_buffer_cache_bytes": mx.get_cache_memory(),
        "resident_bytes": resident_bytes(),
        "mem_limit_bytes": None if engine.budget is None else engine.budget.limit,
    }


def _card(name: str, identity: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    card: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "mlxcache"}
    card.update(more)
    if identity:
        card["mlxcache"] = identity
    return card


class One:
    """The one model of `serve -m MODEL` (`names`: its id, then its `--alias` names)."""

    def __init__(
        self, engine: Engine, worker: Worker, names: tuple[str, ...], identity: dict[str, Any]
    ) -> None:
        self._engine = engine
        self._worker = Tapped(worker, lambda _done: self._touch())
        self._names = names
        self._identity = identity
        self._used = time.monotonic()
        """When its last request ended (or, before any, when the server started)."""

    def _touch(self) -> None:
        self._used = time.monotonic()

    @property
    def default(self) -> str:
        return self._names[0]

    def acquire(self, requested: str | None) -> Target:
        if requested and requested not in self._names:
            served = ", ".join(repr(n) for n in self._names)
            raise APIError(
                404,
                f"model {requested!r} is not served here (it answers to {served}; "
                "serve --alias NAME adds a name)",
                param="model",
                code="model_not_found",
            )
        return Target(requested or self.default, self._engine, self._worker, lambda: None)

    def cards(self) -> list[dict[str, Any]]:
        first = _card(self.default, self._identity)
        return [first, *(_card(a, self._identity, alias_of=self.default) for a in self._names[1:])]

    def rows(self) -> list[dict[str, Any]]:
        idle = 0.0 if self._engine.busy else round(time.monotonic() - self._used, 1)
        return [
            {
                "name": self.default,
                "aliases": list(self._names[1:]),
                "loaded": True,
                "default": True,
                "loads": 1,
                "size_bytes": weights_bytes(self._engine.loaded.path),
                "idle_s": idle,
            }
        ]

    def reports(self) -> dict[str, dict[str, Any]]:
        return {self.default: self._worker.call(cache_report)}

    def counted(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        return self.reports(), {}


class Many:
    """The models of a fleet, behind one engine worker."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    @property
    def default(self) -> str:
        return self.fleet.default.name

    def acquire(self, requested: str | None) -> Target:
        resident = self.fleet.acquire(requested)
        worker = Bound(self.fleet.worker, resident.engine)
        name = requested or self.default
        return Target(name, resident.engine, worker, lambda: self.fleet.release(resident))

    def cards(self) -> list[dict[str, Any]]:
        cards = []
        for entry in self.fleet.entries:
            resident = self.fleet.resident.get(entry.name)
            loaded = resident is not None
            identity = None if resident is None else resident.info
            cards.append(_card(entry.name, identity, loaded=loaded, aliases=list(entry.aliases)))
            cards.extend(
                _card(a, identity, loaded=loaded, alias_of=entry.name) for a in entry.aliases
            )
        return cards

    def rows(self) -> list[dict[str, Any]]:
        return self.fleet.worker.run(self.fleet.report)

    def reports(self) -> dict[str, dict[str, Any]]:
        return self.fleet.worker.run(self._reports)

    def _reports(self) -> dict[str, dict[str, Any]]:
        return {n: cache_report(r.engine) for n, r in self.fleet.resident.items()}

    def counted(self) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
        return self.fleet.worker.run(lambda: (self._reports(), dict(self.fleet.retired)))

"""The app: each API's router over one `Service` (chat and text completions, Messages,
Responses), and the routes that report (models, health, loaded models, cache, metrics);
CORS when origins are given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import PlainTextResponse
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from mlxcache.config import ServerConfig
from mlxcache.engine import Engine
from mlxcache.errors import ModelNotServedError
from mlxcache.membudget import resident_bytes
from mlxcache.sampling import SamplingParams
from mlxcache.server import anthropic_api, chat_api, errors, responses_api
from mlxcache.server.guard import Guard
from mlxcache.server.log import RequestLog
from mlxcache.server.metrics import CONTENT_TYPE, Metrics
from mlxcache.server.prepare import IGNORED_HEADER
from mlxcache.server.served import One, Served
from mlxcache.server.service import Service
from mlxcache.server.stream import Worker

DEFAULT_MAX_BODY = ServerConfig.max_body


@dataclass(frozen=True, slots=True)
class Settings:
    """What the server answers with: its model id, default sampling, key, limits, and the
    origins whose browser pages may call it (CORS; none by default)."""

    model_id: str
    defaults: SamplingParams = field(default_factory=SamplingParams)
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY
    cors_origins: tuple[str, ...] = ()
    identity: dict[str, Any] = field(default_factory=dict)
    """What a client needs to tell whether this server replies as it would in-process
    (`mlxcache.wire.identity`: model name, digest and key, block size, version); shown on the
    model card as "mlxcache"."""
    aliases: tuple[str, ...] = ()
    """Other names requests may give the model (`serve --alias`)."""

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the served model answers to, its id first."""
        return (self.model_id, *self.aliases)


def create_app(
    engine: Engine | None,
    worker: Worker,
    settings: Settings,
    log: RequestLog,
    served: Served | None = None,
) -> Any:
    """The ASGI app serving `engine` through `worker` (which must be started), or the
    models `served` names (a fleet's: `engine` None)."""
    app = FastAPI(title="mlxcache", docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    if served is None:
        assert engine is not None, "one model, or the served ones"
        served = One(engine, worker, settings.names, settings.identity)
    service = Service(served, settings.defaults, Metrics())
    app.include_router(_info(service, worker))
    app.include_router(chat_api.router(service))
    app.include_router(anthropic_api.router(service))
    app.include_router(responses_api.router(service))
    guarded = Guard(app, log, settings.api_key, settings.max_body, service.metrics)
    if not settings.cors_origins:
        return guarded
    # Outside the guard: a browser's preflight carries no key, and a refusal (401, 413)
    # needs the CORS headers too, or the page cannot read why.
    return CORSMiddleware(
        guarded,
        allow_origins=list(settings.cors_origins),
        allow_methods=["GET", "POST"],
        allow_headers=["*"],
        expose_headers=["Retry-After", IGNORED_HEADER],
    )


def _info(service: Service, worker: Worker) -> APIRouter:
    """The routes that report: health, models, loaded models, cache, metrics."""
    routes = APIRouter()
    served = service.served

    @routes.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served.default, "waiting": worker.waiting}

    @routes.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": served.cards()}

    @routes.get("/v1/models/{model:path}")  # a model id may hold slashes (org/name)
    async def model_card(model: str) -> dict[str, Any]:
        card = next((c for c in served.cards() if c["id"] == model), None)
        if card is None and not model:  # a request without a model gets the default; no card
            raise ModelNotServedError("no model named: GET /v1/models lists what is served")
        if card is None:
            served.acquire(model)  # raises its 404 naming what is served, loads nothing
            raise AssertionError(model)  # unreachable: every served name has a card
        return card

    @routes.get("/v1/ps")
    async def ps() -> dict[str, Any]:
        rows = await run_in_threadpool(served.rows)
        return {"models": rows, **memory_of(await run_in_threadpool(served.reports))}

    @routes.get("/v1/cache")
    async def cache() -> dict[str, Any]:
        reports = await run_in_threadpool(served.reports)
        if isinstance(served, One):
            return {**reports[served.default], "waiting": worker.waiting}
        return {"models": reports, **memory_of(reports), "waiting": worker.waiting}

    @routes.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        reports, retired = await run_in_threadpool(served.counted)
        report = total_of(reports, retired)
        rows = None if isinstance(served, One) else await run_in_threadpool(served.rows)
        text = service.metrics.render(report, worker.waiting, report["busy"], rows)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    return routes


def memory_of(reports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The process's memory and its budget, from the models' reports (the same for each)."""
    first = next(iter(reports.values()), None)
    if first is None:  # no model loaded: nothing holds a budget yet
        return {"resident_bytes": resident_bytes(), "mem_limit_bytes": None}
    return {k: first[k] for k in ("resident_bytes", "mem_limit_bytes")}


def total_of(
    reports: dict[str, dict[str, Any]], retired: dict[str, int] | None = None
) -> dict[str, Any]:
    """One cache report for several models: their counters and sizes added up, with the
    counters of models unloaded before (`retired`)."""
    if len(reports) == 1 and not retired:
        return next(iter(reports.values()))
    busy = any(r["busy"] for r in reports.values())
    total: dict[str, Any] = {"busy": busy, **memory_of(reports)}
    for report in reports.values():
        for key, value in report.items():
            if isinstance(value, int) and not isinstance(value, bool) and key not in _PROCESS:
                total[key] = total.get(key, 0) + value
    for key, value in (retired or {}).items():
        total[key] = total.get(key, 0) + value
    return total


_PROCESS = {"resident_bytes", "mem_limit_bytes", "mlx_active_bytes", "mlx_buffer_cache_bytes"}
"""A cache report's numbers of the whole process (the same in each model's report)."""

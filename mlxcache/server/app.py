"""The routes: chat and text completions (streamed or not), models, health, cache report,
metrics; CORS when origins are given."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from mlxcache.config import ServerConfig
from mlxcache.engine import Engine
from mlxcache.engine import Request as EngineRequest
from mlxcache.errors import ModelNotServedError
from mlxcache.events import Done, Event
from mlxcache.membudget import resident_bytes
from mlxcache.modes.call_stream import CallDelta
from mlxcache.sampling import SamplingParams
from mlxcache.server import anthropic_api, errors, prepare, responses_api
from mlxcache.server.errors import APIError
from mlxcache.server.front import Routes, UsageOf, ignored, parsed
from mlxcache.server.guard import Guard
from mlxcache.server.log import RequestLog, log_fields
from mlxcache.server.logprobs import Formatter, Scored
from mlxcache.server.metrics import CONTENT_TYPE, Metrics
from mlxcache.server.openai_format import SSE_DONE, Envelope, Usage, error_event, sse
from mlxcache.server.prepare import IGNORED_HEADER, Answer, Plan
from mlxcache.server.schemas import ChatRequest, CompletionRequest, SamplingFields
from mlxcache.server.served import One, Served, Target
from mlxcache.server.stream import Handle, Outcome, Stream, Worker
from mlxcache.wire import USAGE_FIELD, worded_doc

DEFAULT_MAX_BODY = ServerConfig.max_body
B = TypeVar("B", bound=BaseModel)
R = TypeVar("R", bound=SamplingFields)


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
    metrics = Metrics()
    if served is None:
        assert engine is not None, "one model, or the served ones"
        served = One(engine, worker, settings.names, settings.identity)
    models_served = served

    async def prepared(target: Target, fn: Callable[..., Plan], body: Any) -> Plan:
        # Tokenizer calls run one request at a time per model (the encoder's lock: see
        # `encoder`); grammar work runs outside it (see prepare).
        engine = target.engine
        return await run_in_threadpool(fn, engine, body, settings.defaults, engine.encoder.lock)

    async def acquired(model: str | None) -> Target:
        """The model a request names, held loaded until its `release` (loaded if need be)."""
        return await run_in_threadpool(models_served.acquire, model)

    def note(request: Request, rid: str, outcome: Outcome | None = None) -> None:
        fields = log_fields(request.scope)
        fields["id"] = rid
        if outcome is not None:
            metrics.completed(outcome.usage, fields.get("model"))
            fields.update(
                prompt_tokens=outcome.usage.prompt_tokens,
                cached_tokens=outcome.usage.cached_tokens,
                generated_tokens=outcome.usage.completion_tokens,
                ttft_s=None if outcome.ttft_s is None else round(outcome.ttft_s, 4),
                finish_reason=outcome.finish_reason,
            )
            if outcome.error:
                fields["error"] = outcome.error

    async def warm(plan: Plan, answer: Answer) -> None:
        """Queue warm-ahead of the conversation's next turn (low priority, on the worker)."""
        if plan.next_turn is None or plan.warm_on is None:
            return
        turn = plan.next_turn
        plan.warm_on(await run_in_threadpool(turn, answer))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": models_served.default, "waiting": worker.waiting}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": models_served.cards()}

    @app.get("/v1/models/{model:path}")  # a model id may hold slashes (org/name)
    async def model_card(model: str) -> dict[str, Any]:
        card = next((c for c in models_served.cards() if c["id"] == model), None)
        if card is None and not model:  # a request without a model gets the default; no card
            raise ModelNotServedError("no model named: GET /v1/models lists what is served")
        if card is None:
            models_served.acquire(model)  # raises its 404 naming what is served, loads nothing
            raise AssertionError(model)  # unreachable: every served name has a card
        return card

    @app.get("/v1/ps")
    async def ps() -> dict[str, Any]:
        rows = await run_in_threadpool(models_served.rows)
        return {"models": rows, **memory_of(await run_in_threadpool(models_served.reports))}

    @app.get("/v1/cache")
    async def cache() -> dict[str, Any]:
        reports = await run_in_threadpool(models_served.reports)
        if isinstance(models_served, One):
            return {**reports[models_served.default], "waiting": worker.waiting}
        return {"models": reports, **memory_of(reports), "waiting": worker.waiting}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        reports = await run_in_threadpool(models_served.reports)
        report = total_of(reports, await run_in_threadpool(models_served.retired))
        rows = None
        if not isinstance(models_served, One):
            rows = await run_in_threadpool(models_served.rows)
        text = metrics.render(report, worker.waiting, report["busy"], rows)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    async def begin(
        request: Request, schema: type[R], make: Callable[..., Plan], prefix: str
    ) -> tuple[R, Plan, Envelope, Stream, UsageOf]:
        """Parse, check and prepare a completion request, and submit it; how to report its
        usage (with the request's own stats and token ids when it asks: `_Tap`)."""
        body: R = await parsed(request, schema)
        return (body, *await submit(request, body, make, prefix))

    async def submit(
        request: Request, body: R, make: Callable[..., Plan], prefix: str
    ) -> tuple[Plan, Envelope, Stream, UsageOf]:
        """`begin` for a body parsed already (the other APIs' routes make a ChatRequest)."""
        target = await acquired(body.model)
        try:
            plan = await prepared(target, make, body)
            plan.warm_on = target.worker.warm
            env = Envelope(f"{prefix}-{uuid.uuid4().hex[:24]}", target.name)
            log_fields(request.scope)["model"] = target.name
            note(request, env.id)
            if (body.model_extra or {}).get(USAGE_FIELD) is not True:
                stream = Stream(target.worker, plan.request, plan.reply_text())
                return plan, env, stream, _usage
            tap = _Tap(target.worker, plan)
            return plan, env, Stream(tap, plan.request, plan.reply_text()), tap.usage
        finally:
            target.release()  # submitted (its job holds the model now) or refused

    async def end(request: Request, stream: Stream, env: Envelope) -> Outcome:
        """The outcome of a non-streamed request (its failure raised as an HTTP error)."""
        outcome = await _finish(stream, request)
        note(request, env.id, outcome)
        if outcome.error is not None:
            raise APIError(500, errors.one_line(outcome.error), type="server_error")
        return outcome

    async def answered(
        request: Request, plan: Plan, stream: Stream, env: Envelope
    ) -> tuple[Outcome, Answer]:
        """A non-streamed chat request's outcome and answer, its next turn warmed."""
        outcome = await end(request, stream, env)
        answer = plan.answer(outcome.text, outcome.finish_reason)
        await warm(plan, answer)
        return outcome, answer

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body, plan, env, stream, usage = await begin(request, ChatRequest, prepare.chat, "chatcmpl")
        chat_logprobs = None if plan.vocab is None else Formatter(plan.vocab).chat
        headers = ignored(plan)  # fields that changed nothing, said where a client reads it
        if body.stream:
            usage_chunk = usage if body.include_usage else None
            events = _chat_events(stream, plan, env, usage_chunk, warm, chat_logprobs)
            return _stream(events, stream, request, env.id, note, headers)
        outcome, answer = await answered(request, plan, stream, env)
        reply = env.chat(
            answer.content,
            answer.calls,
            answer.finish_reason,
            usage(outcome),
            answer.reasoning,
            None if chat_logprobs is None else chat_logprobs(stream.scored),
        )
        return JSONResponse(reply, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body, plan, env, stream, usage = await begin(
            request, CompletionRequest, prepare.completion, "cmpl"
        )
        text_logprobs = None if plan.vocab is None else Formatter(plan.vocab).completion
        if body.stream:
            usage_chunk = usage if body.include_usage else None
            events = _completion_events(stream, env, usage_chunk, text_logprobs)
            return _stream(events, stream, request, env.id, note)
        outcome = await end(request, stream, env)
        logprobs = None if text_logprobs is None else text_logprobs(stream.scored)
        return JSONResponse(
            env.completion(outcome.text, outcome.finish_reason, usage(outcome), logprobs)
        )

    async def count(request: Request, body: ChatRequest) -> int:
        """The prompt tokens of a chat request (nothing is submitted)."""
        target = await acquired(body.model)
        try:
            return len((await prepared(target, prepare.chat, body)).ids)
        finally:
            target.release()

    async def submit_chat(
        request: Request, body: ChatRequest, prefix: str
    ) -> tuple[Plan, Envelope, Stream, UsageOf]:
        return await submit(request, body, prepare.chat, prefix)

    def stream_of(
        events: AsyncIterator[str | Outcome],
        stream: Stream,
        request: Request,
        rid: str,
        headers: dict[str, str],
    ) -> Any:
        return _stream(events, stream, request, rid, note, headers)

    routes = Routes(submit_chat, answered, warm, count, stream_of)
    anthropic_api.install(app, routes)
    responses_api.install(app, routes)

    guarded = Guard(app, log, settings.api_key, settings.max_body, metrics)
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


def _usage(outcome: Outcome) -> Usage:
    return outcome.usage


class _Tap:
    """The worker, seen through the one request submitted by it: keeps its `Done`, whose
    result the usage then reports (`USAGE_FIELD`)."""

    def __init__(self, worker: Worker, plan: Plan) -> None:
        self._worker = worker
        self._plan = plan
        self._done: Done | None = None

    def submit(self, request: EngineRequest, sink: Callable[[Event], None]) -> Handle:
        def tap(event: Event) -> None:
            if isinstance(event, Done):  # set before the stream can see it (same thread)
                self._done = event
            sink(event)

        return self._worker.submit(request, tap)

    def warm(self, tokens: list[int]) -> None:
        self._worker.warm(tokens)

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        return self._worker.call(fn)

    @property
    def waiting(self) -> int:
        return self._worker.waiting

    def usage(self, outcome: Outcome) -> Usage:
        if self._done is None:
            return outcome.usage
        result = self._done.result
        extra: dict[str, Any] = {
            "stats": result.stats.as_dict(),
            "tokens": result.tokens,
            "text": result.text,
            "finish_reason": result.finish_reason,  # before tool calls are read from it
        }
        if self._plan.tools is not None:
            # A call the reply left unreadable or cut off: the answer leaves it out (a
            # stream may have begun it: "tool_calls" says how many are the answer's), and a
            # command fails on it as in-process (`wire.worded_doc`).
            read = self._plan.tools.read(result)
            extra["tool_calls"] = len(read.calls)
            if read.error is not None:
                extra["tool_error"] = worded_doc(read.error)
        return replace(outcome.usage, mlxcache=extra)


async def _finish(stream: Stream, request: Request) -> Outcome:
    """Run the stream to its end; a client that leaves first cancels it (pin released)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    finish = asyncio.ensure_future(stream.finish())
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({finish, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not finish.done():
            finish.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await finish  # its generator's cleanup cancels the stream
    if finish.cancelled():
        log_fields(request.scope)["finish_reason"] = "disconnected"
        raise errors.ClientGone
    return finish.result()


Noter = Callable[[Request, str, Outcome | None], None]
LogprobsOf = Callable[[list[Scored]], dict[str, Any]]
"""A reply's `Formatter.chat` or `.completion`."""


def _new_logprobs(stream: Stream, logprobs_of: LogprobsOf | None) -> dict[str, Any] | None:
    """The logprobs of the tokens that came since the last chunk (a chunk whose tokens'
    text is held back carries none: a later chunk carries them)."""
    scores = stream.new_scores()
    return logprobs_of(scores) if logprobs_of is not None and scores else None


KEEPALIVE_S = 10.0
"""A stream with nothing new for this long (queued behind other requests, a long prefill)
gets an SSE comment line, so clients and proxies do not drop it as idle."""
KEEPALIVE = ": keepalive\n\n"


async def _kept_alive(events: AsyncIterator[str | Outcome]) -> AsyncIterator[str | Outcome]:
    """`events`, with `KEEPALIVE` whenever none came for `KEEPALIVE_S` seconds."""
    items = aiter(events)
    pending: asyncio.Future[str | Outcome] = asyncio.ensure_future(anext(items))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_S)
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(items))
    finally:
        if not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        elif not pending.cancelled():
            # Cancelled (the client left) just as `pending` ended: its outcome is read, or
            # asyncio logs "Task exception was never retrieved" for a StopAsyncIteration.
            pending.exception()


def _stream(
    events: AsyncIterator[str | Outcome],
    stream: Stream,
    request: Request,
    rid: str,
    note: Noter,
    headers: dict[str, str] | None = None,
) -> StreamingResponse:
    """SSE from an event generator whose items are text to send or the final outcome
    (`headers`: more response headers), for the request `stream` runs."""
    finished = False

    async def body() -> AsyncIterator[str]:
        nonlocal finished
        async for item in _kept_alive(events):
            if isinstance(item, Outcome):
                finished = True
                note(request, rid, item)
            else:
                yield item

    def ended() -> None:
        # However the reply ended unfinished (the client gone mid-stream, or before its
        # first byte, when `events` may never have started), its request is cancelled.
        if not finished:
            stream.close()
            log_fields(request.scope)["finish_reason"] = "disconnected"

    sse_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
    return _Streamed(body(), ended, media_type="text/event-stream", headers=sse_headers)


class _Streamed(StreamingResponse):
    """A StreamingResponse that calls `ended` once it is over, however it ends."""

    def __init__(self, body: AsyncIterator[str], ended: Callable[[], None], **kw: Any) -> None:
        super().__init__(body, **kw)
        self._ended = ended

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._ended()


def _outcome_events(outcome: Outcome) -> list[str | Outcome]:
    """The outcome (for the request log), then, if the request failed, its error event and
    the end of the stream."""
    if outcome.error is None:
        return [outcome]
    return [outcome, error_event(errors.one_line(outcome.error)), SSE_DONE]


async def _chat_events(
    stream: Stream,
    plan: Plan,
    env: Envelope,
    usage: UsageOf | None,
    warm: Callable[[Plan, Answer], Awaitable[None]],
    logprobs_of: LogprobsOf | None,
) -> AsyncIterator[str | Outcome]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return sse(env.chat_chunk(delta, finish, _new_logprobs(stream, logprobs_of)))

    yield chunk({"role": "assistant", "content": ""})
    async for piece in stream.deltas():
        if isinstance(piece, CallDelta):
            yield chunk({"tool_calls": [env.call_delta(piece)]})
        else:
            yield chunk({piece[0]: piece[1]})
    end = stream.ending(plan.answer)
    for item in _outcome_events(end.outcome):
        yield item
    if end.answer is None:
        return
    for key, rest in (("reasoning", end.reasoning), ("content", end.content)):
        if rest:
            yield chunk({key: rest})
    for call in end.calls:
        yield chunk({"tool_calls": [env.call_delta(call)]})
    yield chunk({}, end.answer.finish_reason)
    if usage is not None:
        yield sse(env.usage_chunk(usage(end.outcome)))
    yield SSE_DONE
    await warm(plan, end.answer)


async def _completion_events(
    stream: Stream, env: Envelope, usage: UsageOf | None, logprobs_of: LogprobsOf | None
) -> AsyncIterator[str | Outcome]:
    def chunk(text: str, finish: str | None = None) -> str:
        return sse(env.completion_chunk(text, finish, _new_logprobs(stream, logprobs_of)))

    async for piece in stream.deltas():  # no chat template: all of it is content
        if not isinstance(piece, CallDelta):
            yield chunk(piece[1])
    outcome = stream.outcome()
    for item in _outcome_events(outcome):
        yield item
    if outcome.error is not None:
        return
    yield chunk("", outcome.finish_reason)
    if usage is not None:
        yield sse(env.usage_chunk(usage(outcome), "text_completion"))
    yield SSE_DONE

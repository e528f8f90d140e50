"""What every API's routes share: a request prepared on its model and submitted, its reply
waited for (a client gone cancels it) or streamed as server-sent events, its outcome in the
request log and in `/metrics`, its next turn warmed."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from mlxcache.events import Done
from mlxcache.sampling import SamplingParams
from mlxcache.server import errors, prepare
from mlxcache.server.errors import APIError
from mlxcache.server.log import log_fields
from mlxcache.server.metrics import Metrics
from mlxcache.server.openai_format import Envelope, Usage
from mlxcache.server.prepare import Answer, Plan
from mlxcache.server.schemas import ChatRequest, SamplingFields
from mlxcache.server.served import Served, Target
from mlxcache.server.stream import Outcome, Stream, Tapped, Worker
from mlxcache.wire import USAGE_FIELD, worded_doc

R = TypeVar("R", bound=SamplingFields)
UsageOf = Callable[[Outcome], Usage]
Submitted = tuple[Plan, Envelope, Stream, UsageOf]


class Service:
    """The request path of the models `served` names, with the server's default sampling;
    counts finished completions in `metrics`."""

    def __init__(self, served: Served, defaults: SamplingParams, metrics: Metrics) -> None:
        self.served = served
        self.defaults = defaults
        self.metrics = metrics

    async def prepared(self, target: Target, fn: Callable[..., Plan], body: Any) -> Plan:
        # Tokenizer calls run one request at a time per model (the encoder's lock: see
        # `encoder`); grammar work runs outside it (see prepare).
        engine = target.engine
        return await run_in_threadpool(fn, engine, body, self.defaults, engine.encoder.lock)

    async def acquired(self, model: str | None) -> Target:
        """The model a request names, held loaded until its `release` (loaded if need be)."""
        return await run_in_threadpool(self.served.acquire, model)

    def note(self, request: Request, rid: str, outcome: Outcome | None = None) -> None:
        """The request's id in its log line, and its outcome's numbers once it has one."""
        fields = log_fields(request.scope)
        fields["id"] = rid
        if outcome is None:
            return
        self.metrics.completed(outcome.usage, fields.get("model"))
        self.metrics.ended(outcome.finish_reason)
        fields.update(
            prompt_tokens=outcome.usage.prompt_tokens,
            cached_tokens=outcome.usage.cached_tokens,
            generated_tokens=outcome.usage.completion_tokens,
            ttft_s=None if outcome.ttft_s is None else round(outcome.ttft_s, 4),
            finish_reason=outcome.finish_reason,
        )
        if outcome.error:
            fields["error"] = outcome.error

    async def warm(self, plan: Plan, answer: Answer) -> None:
        """Queue warm-ahead of the conversation's next turn (low priority, on the worker)."""
        if plan.next_turn is None or plan.warm_on is None:
            return
        turn = plan.next_turn
        plan.warm_on(await run_in_threadpool(turn, answer.content, answer.calls))

    async def submit(
        self, request: Request, body: R, make: Callable[..., Plan], prefix: str
    ) -> Submitted:
        """Prepare a parsed request and submit it: its plan, envelope, stream, and how to
        report its usage (with the request's own stats and token ids when it asks: `_Tap`)."""
        target = await self.acquired(body.model)
        try:
            plan = await self.prepared(target, make, body)
            plan.warm_on = target.worker.warm
            env = Envelope(f"{prefix}-{uuid.uuid4().hex[:24]}", target.name)
            log_fields(request.scope)["model"] = target.name
            self.note(request, env.id)
            if (body.model_extra or {}).get(USAGE_FIELD) is not True:
                stream = Stream(target.worker, plan.request, plan.reply_text())
                return plan, env, stream, _usage
            tap = _Tap(target.worker, plan)
            return plan, env, Stream(tap, plan.request, plan.reply_text()), tap.usage
        finally:
            target.release()  # submitted (its job holds the model now) or refused

    async def submit_chat(self, request: Request, body: ChatRequest, prefix: str) -> Submitted:
        return await self.submit(request, body, prepare.chat, prefix)

    async def count(self, body: ChatRequest) -> int:
        """The prompt tokens of a chat request (nothing is submitted)."""
        target = await self.acquired(body.model)
        try:
            return len((await self.prepared(target, prepare.chat, body)).ids)
        finally:
            target.release()

    async def end(self, request: Request, stream: Stream, env: Envelope) -> Outcome:
        """The outcome of a non-streamed request (its failure raised as an HTTP error)."""
        try:
            outcome = await _finish(stream, request)
        except errors.ClientGone:
            self.metrics.ended("disconnected")
            raise
        self.note(request, env.id, outcome)
        if outcome.error is not None:
            raise APIError(500, errors.one_line(outcome.error), type="server_error")
        return outcome

    async def answered(
        self, request: Request, plan: Plan, stream: Stream, env: Envelope
    ) -> tuple[Outcome, Answer]:
        """A non-streamed chat request's outcome and answer, its next turn warmed."""
        outcome = await self.end(request, stream, env)
        answer = plan.answer(outcome.text, outcome.finish_reason)
        await self.warm(plan, answer)
        return outcome, answer

    def stream(
        self,
        events: AsyncIterator[str | Outcome],
        stream: Stream,
        request: Request,
        rid: str,
        headers: dict[str, str] | None = None,
    ) -> StreamingResponse:
        """SSE from an event generator whose items are text to send or the final outcome
        (`headers`: more response headers), for the request `stream` runs."""
        sse_headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        sent = _Sent(events, stream, lambda outcome: self.note(request, rid, outcome), self.metrics)
        return _Streamed(sent, media_type="text/event-stream", headers=sse_headers)


def _usage(outcome: Outcome) -> Usage:
    return outcome.usage


class _Tap(Tapped):
    """The worker, seen through the one request submitted by it: keeps its `Done`, whose
    result the usage then reports (`USAGE_FIELD`)."""

    def __init__(self, worker: Worker, plan: Plan) -> None:
        super().__init__(worker, self._keep)
        self._plan = plan
        self._done: Done | None = None

    def _keep(self, done: Done) -> None:
        self._done = done  # set before the stream can see it (same thread)

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


KEEPALIVE_S = 10.0
"""A stream with nothing new for this long (queued behind other requests, a long prefill)
gets an SSE comment line, so clients and proxies do not drop it as idle."""
KEEPALIVE = ": keepalive\n\n"


async def kept_alive(events: AsyncIterator[str | Outcome]) -> AsyncIterator[str | Outcome]:
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


class _Sent:
    """A stream's text as it is sent; the outcome, when it comes, goes to `noted` (its
    text follows it: a client that has the stream's last event was noted whole)."""

    def __init__(
        self,
        events: AsyncIterator[str | Outcome],
        stream: Stream,
        noted: Callable[[Outcome], None],
        metrics: Metrics,
    ) -> None:
        self.events, self.stream, self.noted, self.metrics = events, stream, noted, metrics
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for item in kept_alive(self.events):
                if isinstance(item, Outcome):
                    self.finished = True
                    self.noted(item)
                else:
                    yield item
        except Exception as exc:
            if not self.finished:  # a fault of the server's own, not a client gone
                self.finished = True
                self.noted(self.stream.failed(errors.internal(exc)).outcome)
            raise

    def ended(self, scope: Any) -> None:
        # However the reply ended unfinished (the client gone mid-stream, or before its
        # first byte, when `events` may never have started), its request is cancelled.
        if not self.finished:
            self.stream.close()
            log_fields(scope)["finish_reason"] = "disconnected"
            self.metrics.ended("disconnected")


class _Streamed(StreamingResponse):
    """A StreamingResponse that tells its `_Sent` once it is over, however it ends."""

    def __init__(self, sent: _Sent, **kw: Any) -> None:
        super().__init__(aiter(sent), **kw)
        self._sent = sent

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._sent.ended(scope)

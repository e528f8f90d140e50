"""One request on the engine worker, seen from the event loop as a stream of its events.

The worker calls the sink on its own thread; events cross to the loop through
`call_soon_threadsafe` into an asyncio queue. A consumer that stops listening early (a
client gone mid-stream) cancels the request, which releases its cache pin at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from mlxcache.engine import Engine, Request
from mlxcache.events import Done, Event, Prefill, Token
from mlxcache.modes.call_stream import CallDelta, CallsSent
from mlxcache.server.logprobs import Scored
from mlxcache.server.openai_format import Usage
from mlxcache.server.prepare import Answer
from mlxcache.server.text import ReplyText


class Handle(Protocol):
    def cancel(self) -> None: ...


class Worker(Protocol):
    """What the server needs of `mlxcache.worker.EngineWorker`."""

    def submit(self, request: Request, sink: Callable[[Event], None]) -> Handle: ...

    def warm(self, tokens: list[int]) -> None: ...

    def call(self, fn: Callable[[Engine], Any]) -> Any: ...

    @property
    def waiting(self) -> int: ...


class Tapped:
    """A worker seen through the requests submitted by it: each one's `Done` is told to
    `on_done` (on the worker's thread) before its sink sees it."""

    def __init__(self, worker: Worker, on_done: Callable[[Done], None]) -> None:
        self._worker = worker
        self._on_done = on_done

    def submit(self, request: Request, sink: Callable[[Event], None]) -> Handle:
        def tap(event: Event) -> None:
            if isinstance(event, Done):
                self._on_done(event)
            sink(event)

        return self._worker.submit(request, tap)

    def warm(self, tokens: list[int]) -> None:
        self._worker.warm(tokens)

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        return self._worker.call(fn)

    @property
    def waiting(self) -> int:
        return self._worker.waiting


@dataclass(frozen=True, slots=True)
class Outcome:
    """A finished request: its text, why it ended, and its numbers."""

    text: str
    finish_reason: str
    usage: Usage
    ttft_s: float | None
    error: str | None = None
    stop_sequence: str | None = None
    """The stop string that ended the reply, if one did."""


@dataclass(frozen=True, slots=True)
class Ending:
    """A finished stream's last parts, the same for every API: its outcome, the answer
    (None: the request failed) and what of the answer the deltas have not sent: the rest
    of its reasoning and content (what was sent is a prefix of each: see `ReplyText`) and
    of its calls (`CallsSent.rest`)."""

    outcome: Outcome
    answer: Answer | None
    reasoning: str = ""
    content: str = ""
    calls: tuple[CallDelta, ...] = ()


class Stream:
    """Submits `request` at once (raising what `Worker.submit` raises) and relays its events."""

    def __init__(self, worker: Worker, request: Request, reply: ReplyText) -> None:
        self.reply = reply
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event: Event) -> None:
            # A closed loop (the server stopped) has nobody listening.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._queue.put_nowait, event)

        self._start = time.perf_counter()
        self._ttft: float | None = None
        self._done: Done | None = None
        self._prompt_tokens = len(request.tokens)
        self.scored: list[Scored] = []
        """Each generated token's log-probabilities (with `Request.logprobs`), as they come."""
        self._taken = 0
        self.calls = CallsSent()
        """What was streamed of each call (`deltas`)."""
        self._sent = {"reasoning": 0, "content": 0}  # the characters `deltas` gave of each
        self._early: list[Event] = []  # read by `looked_up`, not yet by `deltas`
        self._cached: int | None = None
        self.handle = worker.submit(request, sink)

    async def looked_up(self) -> int:
        """The prompt tokens resumed from the cache, once the engine has looked the prompt
        up (its first event: the first prefill chunk, or the first token when the whole
        prompt was resumed). Leaving early cancels the request."""
        try:
            while self._cached is None:
                event = await self._queue.get()
                self._early.append(event)
                if isinstance(event, Prefill):
                    self._cached = event.start
                elif isinstance(event, Token):
                    self._cached = self._prompt_tokens
                elif isinstance(event, Done):
                    self._cached = event.result.stats.cached_tokens
        except BaseException:
            self.close()
            raise
        return self._cached

    def close(self) -> None:
        """Cancel the request unless it has finished (a consumer gone: its pin released)."""
        if self._done is None:
            self.handle.cancel()

    def new_scores(self) -> list[Scored]:
        """The entries of `scored` added since the last call."""
        new = self.scored[self._taken :]
        self._taken = len(self.scored)
        return new

    async def deltas(self) -> AsyncIterator[tuple[str, str] | CallDelta]:
        """(field, new text) as the reply's reasoning and content become final, reasoning
        first, then the calls' deltas (with `Plan.reply_text`'s call stream); ends when the
        request is done.

        Leaving early (the consumer is cancelled or closes) cancels the request.
        """
        try:
            while True:
                event = self._early.pop(0) if self._early else await self._queue.get()
                if isinstance(event, Done):
                    self._done = event
                    return
                if not isinstance(event, Token):
                    continue
                if self._ttft is None:
                    self._ttft = time.perf_counter() - self._start
                if event.logprob is not None:  # None: a flush of held-back text, no token
                    self.scored.append(Scored(event.token, event.logprob, event.top_logprobs))
                reasoning, content = self.reply.add(event.text)
                for kind, text in (("reasoning", reasoning), ("content", content)):
                    if text:
                        self._sent[kind] += len(text)
                        yield kind, text
                for call in self.reply.new_calls():
                    self.calls.add(call)
                    yield call
        finally:
            self.close()

    async def finish(self) -> Outcome:
        """Run to the end without streaming."""
        async for _ in self.deltas():
            pass
        return self.outcome()

    def outcome(self) -> Outcome:
        """The finished request's outcome (after `deltas()` ended)."""
        if self._done is None:
            raise RuntimeError("the request has not finished")
        result = self._done.result
        stats = result.stats
        usage = Usage(self._prompt_tokens, stats.generated_tokens, stats.cached_tokens)
        error = result.error if result.finish_reason == "error" else None
        return Outcome(
            self.reply.text, result.finish_reason, usage, self._ttft, error, result.stop_string
        )

    def failed(self, error: str) -> Ending:
        """The ending of a reply the server failed to send (`error`: why), its request
        cancelled if it still runs."""
        self.close()
        if self._done is not None:
            usage = self.outcome().usage
        else:
            usage = Usage(self._prompt_tokens, 0, self._cached or 0)
        return Ending(Outcome(self.reply.text, "error", usage, self._ttft, error), None)

    def ending(self, answer_of: Callable[[str, str], Answer]) -> Ending:
        """The finished request's last parts (after `deltas()` ended); `answer_of` reads
        the answer from the reply's text and finish reason (`Plan.answer`)."""
        outcome = self.outcome()
        if outcome.error is not None:
            return Ending(outcome, None)
        answer = answer_of(outcome.text, outcome.finish_reason)
        reasoning = (answer.reasoning or "")[self._sent["reasoning"] :]
        content = answer.content[self._sent["content"] :]
        return Ending(outcome, answer, reasoning, content, tuple(self.calls.rest(answer.calls)))

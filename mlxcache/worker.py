"""A thread that owns the engine: every MLX call runs on it; other threads send it work.

MLX streams belong to the thread that made them, so one thread drives the model, and
other threads (a chat prompt waiting for the user, HTTP handlers) talk to it through a
queue. While no request runs, the worker advances warm-ahead lanes; a request that
arrives waits at most for the model call in flight.

A server of several models (`mlxcache.fleet`) drives them all from this one thread: each
request names its engine, engines are attached as they load and detached as they unload
(on this thread), and each loop steps every engine with work, one model call each, so
requests of different models run interleaved, each making the calls it makes alone.
"""

from __future__ import annotations

import gc
import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mlx.core as mx

from mlxcache.config import ServerConfig
from mlxcache.encoder import Encoder
from mlxcache.engine import Engine, Request, final_result
from mlxcache.errors import (
    EngineStoppedError,
    GenerationError,
    QueueFullError,
    RankError,
)
from mlxcache.events import CANCELLED, Done, Event, Result, Stats

T = TypeVar("T")
IDLE_RELEASE_S = 1.0
"""How long the worker waits with nothing to run before handing freed memory back."""
Sink = Callable[[Event], None]
"""Receives a request's events, on the worker thread; the last one is always a `Done`."""


@dataclass(eq=False, slots=True)
class Handle:
    """A submitted request. `cancel()` is thread-safe."""

    id: int
    _worker: EngineWorker = field(repr=False)

    def cancel(self) -> None:
        """Stop the request before its next model call; its cache pin is released."""
        self._worker._send(("cancel", self))


@dataclass(eq=False, slots=True)
class _Job:
    handle: Handle
    request: Request
    sink: Sink
    engine: Engine
    rid: int | None = None  # the engine's lane id, once admitted

    def end(self, result: Result) -> Done:
        """The `Done` that ends this job with `result` (id -1 before it was admitted)."""
        return Done(-1 if self.rid is None else self.rid, result)


def _cancelled() -> Result:
    return Result("", [], CANCELLED, Stats())


def _failed(error: str) -> Result:
    return Result("", [], "error", Stats(), error=error)


class EngineWorker:
    """Runs `engine` on its own thread.

    Args:
        engine: the engine requests run on unless they name another; once started, only
            the worker thread may use it (but its `encoder`, which any thread may use:
            docs/architecture.md, "Threads"). None: engines are `attach`ed as they load.
        max_lanes: requests run together (interleaved); more wait in a queue.
        max_queue: requests that may wait; one more raises QueueFullError (0: no limit, as
            chat's one user needs; the server passes its own, `ServerConfig.max_queue`).
        on_stop: told, on the worker thread, when a sharded run lost a rank: every request
            failed, and the worker takes no more (`error`).
    """

    def __init__(
        self,
        engine: Engine | None,
        *,
        max_lanes: int = ServerConfig.lanes,
        max_queue: int = 0,
        on_stop: Callable[[RankError], None] | None = None,
    ) -> None:
        if max_lanes < 1 or max_queue < 0:
            raise ValueError("max_lanes must be >= 1 and max_queue >= 0")
        self._default = engine
        self._engines: list[Engine] = [] if engine is None else [engine]  # the worker's own
        self.max_lanes = max_lanes
        self.max_queue = max_queue
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting = 0  # submitted, not yet admitted to the engine
        self._pending: deque[_Job] = deque()
        self._active: dict[tuple[int, int], _Job] = {}  # (id(engine), lane id) -> job
        self._stopping = False
        self.finished = 0
        """Requests that ended (a `Done` delivered), however they ended."""
        self._closed = False  # the loop has ended: nothing will read the inbox again
        self.error: RankError | None = None
        """Why the worker stopped on its own: a sharded run lost a rank (`on_stop` is told
        then, on the worker thread; the owner stops)."""
        self._on_stop = on_stop or (lambda _exc: None)
        self._thread = threading.Thread(target=self._loop, name="mlxcache-engine", daemon=True)

    # -- any thread -------------------------------------------------------------------------

    @property
    def engine(self) -> Engine:
        """The engine requests run on unless they name another."""
        if self._default is None:
            raise EngineStoppedError("this worker has no default engine")
        return self._default

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def __enter__(self) -> EngineWorker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, cancel: bool = False) -> None:
        """Stop taking requests, finish (or, with `cancel`, cancel) the ones in flight, join."""
        self._send(("stop", cancel))
        if self._thread.is_alive():
            self._thread.join()
        # Arrays the worker's stream made and that only cycles still hold must go now: freed
        # at interpreter exit, after MLX's own teardown, they abort the process.
        gc.collect()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet started."""
        return self._waiting

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended: waiting or running (read from any thread:
        len() of a dict is atomic)."""
        return self._waiting + len(self._active)

    def submit(self, request: Request, sink: Sink, engine: Engine | None = None) -> Handle:
        """Queue a request on `engine` (default: the worker's); `sink` receives its events
        on the worker thread.

        Raises:
            UserInputError: empty prompt.
            EngineStoppedError: the worker is shutting down or has stopped.
            ContextLengthError: the prompt leaves no room in the model's context.
            QueueFullError: `max_queue` requests are already waiting.
            MemoryLimitError, MemoryBusyError: the memory budget cannot take it, or not
                beside the running requests (`MemoryBudget.check`).
        """
        engine = engine or self.engine
        engine.encoder.prompt(request.tokens)
        if engine.budget is not None:
            engine.budget.check(request, engine.cache)
        with self._lock:
            if self._stopping:
                raise EngineStoppedError("the engine is shutting down")
            # Waiting means queued beyond the lanes that are free, not merely not yet picked
            # up by the worker thread (len() of a dict is atomic: read without its owner).
            queued = self._waiting + len(self._active) - self.max_lanes
            if self.max_queue and queued >= self.max_queue:
                raise QueueFullError(f"{queued} requests are already waiting")
            self._waiting += 1
            handle = Handle(next(self._ids), self)
            # Sent under the lock: the loop's last drain (which sets `_closed` under it)
            # sees every message sent before `_stopping` was set.
            self._send(("submit", _Job(handle, request, sink, engine)))
        return handle

    def generate(self, request: Request) -> Iterator[Event]:
        """Run a request and yield its events here (as `Engine.generate` does).

        Closing the iterator early cancels the request.

        Raises:
            GenerationError: the request failed.
        """
        events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        handle = self.submit(request, events.put)
        done = False
        try:
            while not done:
                event = events.get()
                if isinstance(event, Done):
                    done = True
                    if event.result.error is not None:
                        raise GenerationError(event.result.error)
                yield event
        finally:
            if not done:
                handle.cancel()

    def complete(self, request: Request, on_event: Callable[[Event], None] | None = None) -> Result:
        """Run a request to the end and return its result (as `Engine.complete` does)."""
        return final_result(self.generate(request), on_event)

    @property
    def encoder(self) -> Encoder:
        """The engine's encoder: any thread may use it (tokenizing needs no MLX)."""
        return self.engine.encoder

    def warm(self, tokens: Any, engine: Engine | None = None) -> None:
        """Queue warm-ahead of a token prefix on `engine` (see `Engine.warm`); nothing if
        that engine has been detached (unloaded) meanwhile."""
        target = engine or self.engine

        def warm() -> None:
            if any(e is target for e in self._engines):
                target.warm(tokens)

        self._send(("call", warm, None))

    @property
    def warm_ahead(self) -> bool:
        """The engine's setting (set once, at construction: safe to read from here)."""
        return self.engine.warm_ahead

    def call(self, fn: Callable[[Engine], T], engine: Engine | None = None) -> T:
        """Run `fn(engine)` (default: the worker's) on the worker thread, between two model
        calls; return its result."""
        target = engine or self.engine
        return self.run(lambda: fn(target))

    def run(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the worker thread, between two model calls; return its result."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise EngineStoppedError("the engine has stopped")
            self._send(("call", fn, future))
        return future.result()

    def later(self, fn: Callable[[], object]) -> None:
        """Queue `fn()` for the worker thread without waiting: it runs after every message
        sent before it (a request submitted first is the worker's job by then); at once
        when the worker has stopped."""
        with self._lock:
            if not self._closed:
                self._send(("call", fn, None))
                return
        fn()

    def _send(self, message: tuple[Any, ...]) -> None:
        self._inbox.put(message)

    # -- the worker thread ------------------------------------------------------------------

    def attach(self, engine: Engine) -> None:
        """Step `engine` too from now on (worker thread: from a `run` function)."""
        self._engines.append(engine)

    def detach(self, engine: Engine) -> None:
        """Stop stepping `engine` (worker thread); it must have no request (`jobs_on`): its
        warm-ahead lanes are dropped."""
        engine.cancel_warm()
        self._engines = [e for e in self._engines if e is not engine]

    def jobs_on(self, engine: Engine) -> int:
        """Requests queued or running on `engine` (worker thread)."""
        jobs = [*self._pending, *self._active.values()]
        return sum(1 for job in jobs if job.engine is engine)

    def _warming(self) -> bool:
        return any(e.warming for e in self._engines)

    # The loop's own frame lives as long as the worker: an engine it named in a local would
    # outlive its `detach` (an unloaded model's memory kept). These helpers' locals do not.

    def _step(self) -> None:
        """One model call of each engine with work (requests waiting for a lane: its
        warm-ahead and follow lanes wait too)."""
        for engine in list(self._engines):
            for event in engine.step(background=not self._pending):
                self._deliver(engine, event)

    def _release_memory(self) -> None:
        for engine in self._engines:
            engine.release_memory()

    def _loop(self) -> None:
        # MLX streams are per thread: this one gets its own on the engine's device.
        stream = mx.new_stream(mx.default_device())
        mx.set_default_stream(stream)
        released = True  # nothing has run yet
        try:
            while True:
                idle = not (self._active or self._pending or self._warming())
                if self._stopping and not (self._active or self._pending):
                    break
                released = released and idle
                if idle and not released:
                    # Left idle a moment, it hands freed memory back; back-to-back requests
                    # keep MLX's buffers (a release makes the next prefill fault them in).
                    if not self._read_inbox(block=True, timeout=IDLE_RELEASE_S):
                        self._release_memory()
                        released = True
                        continue
                else:
                    self._read_inbox(block=idle)
                self._admit()
                self._step()
            for engine in self._engines:
                engine.cancel_warm()
            self._drain(_cancelled())
        except BaseException as exc:
            # A bug here must not leave callers waiting forever: fail what is in flight.
            with self._lock:
                self._stopping = True
            failed = _failed(f"the engine stopped: {exc!r}")
            for job in [*self._pending, *self._active.values()]:
                self._send_to(job, job.end(failed))
            self._pending.clear()
            self._active.clear()
            self._drain(failed)
            if not isinstance(exc, RankError):
                raise
            self.error = exc  # expected, not a bug: the owner reports it, in one line
            self._on_stop(exc)
        finally:
            # Work queued on this thread's stream must not outlive it; but a collective of
            # a run that lost a rank never completes (the process is ending anyway).
            if self.error is None:
                mx.synchronize(stream)

    def _drain(self, failed: Result) -> None:
        """End for good: refuse what comes next, answer what was sent and not read."""
        with self._lock:
            self._stopping = self._closed = True
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if message[0] == "submit":
                self._send_to(message[1], message[1].end(failed))
            elif message[0] == "call" and message[2] is not None:
                message[2].set_exception(EngineStoppedError("the engine has stopped"))

    def _read_inbox(self, block: bool, timeout: float | None = None) -> bool:
        """Handle what the inbox holds (waiting for a first message if `block`, at most
        `timeout` seconds); whether there was any."""
        try:
            message = self._inbox.get(block=block, timeout=timeout)
        except queue.Empty:
            return False
        while True:
            self._handle(message)
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "submit":
            self._pending.append(message[1])
        elif kind == "cancel":
            self._cancel(message[1])
        elif kind == "call":
            _, fn, future = message
            try:
                value = fn()
            except BaseException as exc:
                if future is not None:
                    future.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise
            else:
                if future is not None:
                    future.set_result(value)
        elif kind == "stop":
            with self._lock:
                self._stopping = True
            if message[1]:
                for job in [*self._pending, *self._active.values()]:
                    self._cancel(job.handle)

    def _admit(self) -> None:
        while self._pending and len(self._active) < self.max_lanes:
            job = self._pending.popleft()
            with self._lock:
                self._waiting -= 1
            try:
                if not any(e is job.engine for e in self._engines):
                    raise EngineStoppedError("its model was unloaded")  # held by a fleet: a bug
                job.rid = job.engine.submit(job.request)
            except Exception as exc:  # checked at submit already; the state may have changed
                self._send_to(job, job.end(_failed(str(exc))))
                continue
            self._active[(id(job.engine), job.rid)] = job

    def _cancel(self, handle: Handle) -> None:
        job = next((j for j in self._pending if j.handle is handle), None)
        if job is not None:
            self._pending.remove(job)
            with self._lock:
                self._waiting -= 1
        else:
            key = next((k for k, j in self._active.items() if j.handle is handle), None)
            if key is None:
                return  # already finished
            job = self._active.pop(key)
            job.engine.cancel(key[1])
        self._send_to(job, job.end(_cancelled()))

    def _deliver(self, engine: Engine, event: Event) -> None:
        key = (id(engine), event.request_id)
        job = self._active.get(key)
        if job is None:
            return
        if isinstance(event, Done):
            del self._active[key]
        self._send_to(job, event)

    def _send_to(self, job: _Job, event: Event) -> None:
        if isinstance(event, Done):  # every way a request ends comes through here
            self.finished += 1
        try:
            job.sink(event)
        except Exception:  # a broken consumer must not stop the engine: drop its request
            key = (id(job.engine), job.rid if job.rid is not None else -1)
            if key in self._active:
                job.engine.cancel(key[1])
                del self._active[key]

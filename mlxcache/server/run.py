"""Run the server: one engine worker, uvicorn on the main thread, a drain on exit.

Ctrl-C or SIGTERM stops accepting connections, lets running requests finish (uvicorn
waits for open responses), then stops the worker and returns normally. Another SIGTERM
from then on (a supervisor repeating itself) changes nothing.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from mlxcache.config import ServerConfig
from mlxcache.engine import Engine
from mlxcache.errors import RankError, UserInputError
from mlxcache.fleet import Fleet, Ticker
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.server.served import Many
from mlxcache.worker import EngineWorker


@dataclass(frozen=True, slots=True)
class ServeSummary:
    """What a server did, told when it stopped: `requests` that ended while it ran, of
    which `drained` were in flight (running or waiting) when it began to stop."""

    requests: int
    drained: int


class _Server(uvicorn.Server):
    """uvicorn, announcing its address once bound, telling `on_stopping` how many requests
    are in flight as it begins to stop, and exiting normally after a signal."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_listen: Callable[[str], None],
        on_stopping: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self._on_listen = on_listen
        self._on_stopping = on_stopping

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._on_stopping()  # before the open responses are waited for
        await super().shutdown(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_listen(f"http://{host}:{port}")

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's own, except on the way out: it puts back SIGTERM's default (which
        kills) and re-raises the signal, where the drain (the worker's close) is the exit
        we want. SIGTERM goes straight from our handler to ignored, with no window in
        which a supervisor repeating itself would kill the drain."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, signal.SIG_IGN if sig == signal.SIGTERM else handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on (host, port) (port 0: a free one).

    Raises:
        UserInputError: the address cannot be used (in use, not ours, not an address).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise UserInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise UserInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


def serve(
    engine: Engine | None,
    settings: Settings,
    log: RequestLog,
    on_listen: Callable[[str], None],
    host: str = ServerConfig.host,
    port: int = ServerConfig.port,
    max_queue: int = ServerConfig.max_queue,
    max_lanes: int = ServerConfig.lanes,
    on_stopping: Callable[[int], None] | None = None,
    fleet_of: Callable[[EngineWorker], Fleet] | None = None,
    load_all: bool = False,
) -> ServeSummary:
    """Serve until Ctrl-C / SIGTERM, then drain; SIGTERM is ignored once the drain has
    begun (the process is ending). `port` 0 picks a free port; `on_listen` is told the
    URL once the socket listens, `on_stopping` the requests in flight as the server begins
    to stop (the CLI says both: the library never prints). Returns what it served.
    Several models: `engine` None, and `fleet_of` makes their fleet on the worker (every
    model loaded before the socket listens when `load_all`).

    Raises:
        RankError: a sharded run lost a rank (`distributed`): the server stopped.
        ModelLoadError, MemoryLimitError: `load_all`, and a model cannot be loaded.
    """
    sock = bind(host, port)  # before the worker starts: a refusal leaves nothing running
    server: _Server | None = None

    def stop(_exc: RankError) -> None:  # the run lost a rank: nothing more can be served
        if server is not None:
            server.should_exit = True

    worker = EngineWorker(engine, max_lanes=max_lanes, max_queue=max_queue, on_stop=stop)
    drained: list[int] = []

    def stopping() -> None:
        if not drained:  # uvicorn may shut down once per signal
            drained.append(worker.in_flight)
            if on_stopping is not None:
                on_stopping(drained[0])

    with sock, worker, _fleet(worker, fleet_of, load_all) as served:
        app = create_app(engine, worker, settings, log, served)
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,  # our own line per request (RequestLog)
            lifespan="off",
            timeout_graceful_shutdown=None,
        )
        server = _Server(config, on_listen, stopping)
        server.run(sockets=[sock])
    if worker.error is not None:
        raise worker.error
    return ServeSummary(worker.finished, drained[0] if drained else 0)


KEEP_ALIVE_CHECKS = 4
"""Idle models are looked for this many times per keep-alive time (at most every 5 s)."""


@contextlib.contextmanager
def _fleet(
    worker: EngineWorker, fleet_of: Callable[[EngineWorker], Fleet] | None, load_all: bool
) -> Iterator[Many | None]:
    """The served models of a fleet (None: one model), their keep-alive checked while the
    block runs."""
    if fleet_of is None:
        yield None
        return
    fleet = fleet_of(worker)
    if load_all:
        fleet.load_all()
    ticker = None
    if fleet.keep_alive is not None:
        every = min(max(fleet.keep_alive / KEEP_ALIVE_CHECKS, 0.25), 5.0)
        ticker = Ticker(lambda: worker.run(fleet.expire), every).start()
    try:
        yield Many(fleet)
    finally:
        if ticker is not None:
            ticker.stop()

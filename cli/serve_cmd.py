"""`mlxcache serve`: the OpenAI-compatible HTTP API over one engine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from mlxcache.config import ServerConfig, format_size, parse_size
from mlxcache.errors import UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import ui

LOOPBACK = ("127.0.0.1", "::1", "localhost")
SERVER = ServerConfig  # its class attributes are the defaults


@o.with_run_options()
def serve_cmd(
    host: Annotated[
        str,
        typer.Option("--host", metavar="HOST", help="Address to bind (loopback by default)."),
    ] = SERVER.host,
    port: Annotated[
        int, typer.Option("--port", "-p", metavar="PORT", help="Port; 0 picks a free one.")
    ] = SERVER.port,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="MLXCACHE_API_KEY",
            metavar="KEY",
            help="Require 'Authorization: Bearer KEY' on every endpoint but /health.",
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(
            "--max-queue",
            metavar="N",
            help="Waiting requests beyond this get 429; 0 = no limit.",
        ),
    ] = SERVER.max_queue,
    batch_inexact: Annotated[
        bool,
        typer.Option(
            "--batch-inexact",
            help="Decode requests as one batch even where that is not exact on this device "
            "(replies then depend on the requests running beside them, as mlx_lm.server's "
            "do). Where it is exact (measured), they are batched anyway.",
        ),
    ] = False,
    max_lanes: Annotated[
        int | None,
        typer.Option(
            "--max-lanes",
            help=f"Requests run at once (more wait in the queue); default {SERVER.batched_lanes} "
            "where requests decode as one batch exactly (measured on the device), else "
            f"{SERVER.lanes}.",
            metavar="N",
        ),
    ] = None,
    max_body: Annotated[
        str,
        typer.Option(
            "--max-body", metavar="SIZE", help="Largest request body, e.g. 8M (else 413)."
        ),
    ] = format_size(SERVER.max_body),
    log_file: Annotated[
        Path | None,
        typer.Option("--log-file", metavar="FILE", help="Append one JSON line per request."),
    ] = None,
    cors_origin: Annotated[
        list[str] | None,
        typer.Option(
            "--cors-origin",
            metavar="ORIGIN",
            help="Let browser pages from ORIGIN (e.g. http://localhost:3000; * for any) call "
            "the API (repeatable; off by default).",
        ),
    ] = None,
    alias: Annotated[
        list[str] | None,
        typer.Option(
            "--alias",
            metavar="NAME",
            help="Answer requests naming NAME too (repeatable): for agents whose model name "
            "is fixed (e.g. claude-sonnet-4-5, gpt-5).",
        ),
    ] = None,
    *,
    run: o.RunOptions,
) -> None:
    """Serve the model over OpenAI's and Anthropic's HTTP APIs (Ctrl-C drains and stops)."""
    from mlxcache.model.loader import default_spec
    from mlxcache.server.app import Settings
    from mlxcache.server.log import RequestLog
    from mlxcache.server.run import serve
    from mlxcache.wire import identity

    if not 0 <= port <= 65535:
        raise UserInputError(f"--port must be in 0..65535, got {port}")
    if max_queue < 0:
        raise UserInputError(f"--max-queue must be >= 0, got {max_queue}")
    if max_lanes is not None:
        o.positive(max_lanes=max_lanes)
    try:
        body_limit = parse_size(max_body)
    except ValueError as exc:
        raise UserInputError(f"--max-body: {exc}") from exc
    o.positive(max_body=body_limit)
    origins = tuple(_origin(origin) for origin in cors_origin or ())
    aliases = tuple(o.utf8(name, "--alias") for name in alias or ())
    if any(not name.strip() for name in aliases):
        raise UserInputError("--alias needs a non-empty name")
    if api_key:  # compared as UTF-8 bytes: undecodable argv bytes could never match
        api_key = o.utf8(api_key, "--api-key")
        if any(c in api_key for c in "\r\n\0"):  # no client can send it in a header
            raise UserInputError("--api-key must be one line (it holds a line break)")
    defaults = run.sampling()
    engine = run.engine(invariant=True)
    exact = True
    if batch_inexact and not engine.batch_decode:
        from mlxcache.runtime import batch_anyway

        if batch_anyway(engine):
            exact = False
            ui.warn(
                "--batch-inexact: requests decode as one batch, which is not exact on this "
                "device: a reply may depend on the requests running beside it"
            )
        else:
            ui.warn("--batch-inexact: this model's caches cannot decode as one batch; ignored")
    if host not in LOOPBACK and not api_key:
        ui.warn(f"serving on {host} without --api-key: anyone who can reach it can use it")
    log = RequestLog(log_file)
    try:
        settings = Settings(
            engine.loaded.name,
            defaults,
            api_key or None,
            body_limit,
            origins,
            identity(run.model or default_spec(), engine, run.cache(), exact),
            aliases,
        )
        lanes = max_lanes or (SERVER.batched_lanes if engine.batch_decode else SERVER.lanes)

        def announce(url: str) -> None:
            ui.info(f"mlxcache: serving {settings.model_id} on {url}")

        def stopping(in_flight: int) -> None:
            waits = f"finishing {ui.plural(in_flight, 'request')} in flight" if in_flight else ""
            ui.info(f"mlxcache: stopping{', ' + waits if waits else ''}")

        served = serve(engine, settings, log, announce, host, port, max_queue, lanes, stopping)
        drained = f" ({served.drained} finished after the stop began)" if served.drained else ""
        ui.info(f"mlxcache: stopped, {ui.plural(served.requests, 'request')} served{drained}")
    finally:
        log.close()


def _origin(value: str) -> str:
    """A --cors-origin value: `*` or an origin as browsers send it (scheme://host[:port]);
    anything else (a trailing slash, a path) would never match one."""
    text = o.utf8(value, "--cors-origin")
    parts = urlsplit(text)
    whole = parts.scheme and parts.netloc and not (parts.path or parts.query or parts.fragment)
    if text != "*" and not whole:
        raise UserInputError(f"--cors-origin must be * or scheme://host[:port], got {text!r}")
    return text

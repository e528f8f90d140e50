"""`mlxcache serve`: the OpenAI-compatible HTTP API over one engine."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any
from urllib.parse import urlsplit

import typer

from mlxcache.config import SamplingParams, ServerConfig, format_size, parse_duration, parse_size
from mlxcache.errors import SettingError, UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import ui

if TYPE_CHECKING:
    from mlxcache.engine import Engine
    from mlxcache.fleet import Opener
    from mlxcache.model_entries import ModelEntry
    from mlxcache.server.run import ServeSummary

LOOPBACK = ("127.0.0.1", "::1", "localhost")
SERVER = ServerConfig  # its class attributes are the defaults


@o.with_run_options(models=True)
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
            "is fixed (e.g. claude-sonnet-4-5, gpt-5). With several models: a name of the "
            "default one.",
        ),
    ] = None,
    models_file: Annotated[
        Path | None,
        typer.Option(
            "--models",
            metavar="FILE",
            help="Serve the models a YAML file lists (name, model, aliases, kv_bits each; "
            "after any -m; the first is the default). See docs/serving-models.md.",
        ),
    ] = None,
    keep_alive: Annotated[
        str | None,
        typer.Option(
            "--keep-alive",
            metavar="DURATION",
            help="With several models: unload one idle this long (e.g. 5m, 30s; Ollama's "
            "keep_alive). Default: kept until --mem-limit needs its room.",
        ),
    ] = None,
    load_all: Annotated[
        bool,
        typer.Option(
            "--load-all",
            help="With several models: load them all before listening (default: each when "
            "first asked for).",
        ),
    ] = False,
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
    entries = served_entries(run.models, models_file, aliases)
    if entries is not None:
        limits = (max_queue, max_lanes or SERVER.lanes, body_limit, origins, api_key or None)
        _serve_models(
            entries,
            run,
            defaults,
            keep_alive,
            load_all,
            batch_inexact,
            limits,
            host,
            port,
            log_file,
        )
        return
    if keep_alive is not None or load_all:
        raise UserInputError(
            "--keep-alive and --load-all are for several models (-m A -m B, --models)"
        )
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

        _stopped(serve(engine, settings, log, announce, host, port, max_queue, lanes, _stopping))
    finally:
        log.close()


def served_entries(
    specs: tuple[str, ...], models_file: Path | None, aliases: tuple[str, ...]
) -> list[ModelEntry] | None:
    """The models of a server of several (each -m, then the file's; `aliases` name the
    first, the default); None for one model (served as before: `serve -m MODEL`)."""
    from mlxcache.model_entries import ModelEntry, check_names, read_models_file, spec_name

    if models_file is None and len(specs) < 2:
        return None
    entries = [ModelEntry(spec_name(spec), spec) for spec in specs]
    if models_file is not None:
        entries += read_models_file(models_file)
    if aliases:
        first = entries[0]
        entries[0] = dataclasses.replace(first, aliases=(*first.aliases, *aliases))
    check_names(entries)
    return entries


def _serve_models(
    entries: list[ModelEntry],
    run: o.RunOptions,
    defaults: SamplingParams,
    keep_alive: str | None,
    load_all: bool,
    batch_inexact: bool,
    limits: tuple[int, int, int, tuple[str, ...], str | None],
    host: str,
    port: int,
    log_file: Path | None,
) -> None:
    """`serve` of several models (`mlxcache.fleet`)."""
    from mlxcache.fleet import Fleet, entry_config, folder_size, load_peak_estimate, opener
    from mlxcache.server.app import Settings
    from mlxcache.server.log import RequestLog
    from mlxcache.server.run import serve
    from mlxcache.worker import EngineWorker

    max_queue, lanes, body_limit, origins, api_key = limits
    try:
        idle = None if keep_alive is None else parse_duration(keep_alive)
    except ValueError as exc:
        raise UserInputError(f"--keep-alive: {exc}") from exc
    config = run.cache()
    if any(run.tailoring().values()):
        raise UserInputError(
            "--adapter and --chat-template tailor one model: with several, give each its "
            "own in the models file (adapter:, chat_template:)"
        )
    for entry in entries:
        try:
            entry_config(config, entry)  # a bad KV width: refused now, naming its model
        except SettingError as exc:
            raise UserInputError(f"model {entry.name!r}: kv_bits: {exc}") from exc
        if entry.adapter is not None:  # a bad adapter: refused now, not at its first request
            from mlxcache.errors import AdapterError
            from mlxcache.model.adapter import check_adapter

            try:
                check_adapter(entry.adapter)
            except AdapterError as exc:
                raise UserInputError(f"model {entry.name!r}: {exc}") from exc
    if run.split is not None:
        raise UserInputError("--split runs one model: serve several models without it")
    notes = None if run.quiet else ui.ProbeNotes()
    open_entry = closing_notes(opener(config, run.drafting(), ui.warn, notes, batch_inexact), notes)

    def fleet_of(worker: EngineWorker) -> Fleet:
        return Fleet(
            entries,
            worker,
            open_entry,
            limit=config.mem_limit or None,
            keep_alive=idle,
            tier_bytes=config.mem_bytes if config.enabled else 0,
            size_of=folder_size(config.directory, ui.warn),
            peak_of=load_peak_estimate(config.directory, ui.warn),
            on_note=lambda line: ui.info(f"mlxcache: {line}"),
        )

    settings = Settings(entries[0].name, defaults, api_key, body_limit, origins)
    names = ", ".join(e.name for e in entries)
    log = RequestLog(log_file)
    try:

        def announce(url: str) -> None:
            ui.info(f"mlxcache: serving {settings.model_id} on {url} (models: {names})")

        served = serve(
            None,
            settings,
            log,
            announce,
            host,
            port,
            max_queue,
            lanes,
            _stopping,
            fleet_of=fleet_of,
            load_all=load_all,
        )
        _stopped(served)
    finally:
        log.close()


def closing_notes(open_entry: Opener, notes: ui.ProbeNotes | None) -> Opener:
    """`open_entry`, with `notes`' bar stopped however each load ends (a probe that raised
    sends no last event: its bar would stay drawn over the server's log)."""
    if notes is None:
        return open_entry

    def opened(
        entry: ModelEntry, tier: int, shared: Mapping[str, Any] | None
    ) -> tuple[Engine, dict[str, Any]]:
        with contextlib.closing(notes):
            return open_entry(entry, tier, shared)

    return opened


def _stopping(in_flight: int) -> None:
    waits = f"finishing {ui.plural(in_flight, 'request')} in flight" if in_flight else ""
    ui.info(f"mlxcache: stopping{', ' + waits if waits else ''}")


def _stopped(served: ServeSummary) -> None:
    drained = f" ({served.drained} finished after the stop began)" if served.drained else ""
    ui.info(f"mlxcache: stopped, {ui.plural(served.requests, 'request')} served{drained}")


def _origin(value: str) -> str:
    """A --cors-origin value: `*` or an origin as browsers send it (scheme://host[:port]);
    anything else (a trailing slash, a path) would never match one."""
    text = o.utf8(value, "--cors-origin")
    parts = urlsplit(text)
    whole = parts.scheme and parts.netloc and not (parts.path or parts.query or parts.fragment)
    if text != "*" and not whole:
        raise UserInputError(f"--cors-origin must be * or scheme://host[:port], got {text!r}")
    return text

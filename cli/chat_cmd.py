"""`mlxcache chat`: a terminal chat REPL; with stdin not a TTY, one turn per input line."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol

import typer

from mlxcache import request_settings
from mlxcache.errors import MlxcacheError, UserInputError
from mlxcache.paths import cache_dir as resolve_cache_dir
from mlxcache.paths import session_dirs
from mlxcache_cli import options as o
from mlxcache_cli import remote, ui

if TYPE_CHECKING:  # imported where used: the worker imports mlx_lm (seconds), modes.chat
    # MLX and yaml, and `--help` needs neither
    from mlxcache.events import Event
    from mlxcache.modes import chat
    from mlxcache.worker import EngineWorker

HELP = """commands:
  /retry [-t T]     regenerate the last reply (-t: at temperature T from now on)
  /edit N TEXT      rewrite turn N and continue from there
  /undo             remove the last turn
  /system TEXT      set the system message (/system alone clears it)
  /history          the conversation so far, numbered
  /save NAME        save the session (later turns are saved too)
  /load NAME        open a saved session
  /sessions         the saved sessions
  /stats            session, settings and cache (/stats --json: every counter)
  /clear            forget every turn
  /help             this list
  /exit             leave (Ctrl-D too)
A line ending in \\ continues on the next line. Ctrl-C stops a reply and keeps the session."""


class Model(Protocol):
    """A model's name and key (`LoadedModel`'s, or a server's from its identity)."""

    @property
    def name(self) -> str: ...

    @property
    def key(self) -> str: ...


class Backend(Protocol):
    """Where the chat's model runs: in this process (`Local`) or on a running server
    (`remote.ChatServer`)."""

    @property
    def runner(self) -> chat.Runner: ...

    @property
    def model(self) -> Model: ...

    def cache_report(self) -> dict[str, Any]:
        """The cache's counters (`PromptCache.report`)."""
        ...

    def prompt_kept(self) -> str:
        """After a reply stopped before its first token: what the cache kept of its
        prompt, as the end of a sentence ("" when nothing is to say)."""
        ...


class Local:
    """The model in this process, on a worker thread: warm-ahead fills idle time."""

    def __init__(self, worker: EngineWorker) -> None:
        from mlxcache.modes import chat

        self.worker = worker
        self.runner = chat.InProcess(worker)
        self.model: Model = worker.engine.loaded

    def cache_report(self) -> dict[str, Any]:
        return self.worker.call(lambda e: e.cache.report())

    def prompt_kept(self) -> str:
        """The full blocks computed: the same message sent again resumes there."""
        import numpy as np

        ids = np.asarray(self.runner.prompt, dtype=np.int32)
        if not ids.size:
            return ""
        kept = self.worker.call(lambda e: e.cache.cached_length(ids))
        return f"; {kept} of its {ids.size} prompt tokens are kept in the cache for next time"


class Repl:
    """Holds the session and what the commands act on."""

    def __init__(
        self,
        backend: Backend,
        session: chat.ChatSession,
        sessions: list[Path],
        markdown: bool,
        quiet: bool = False,
        force: bool = False,
    ) -> None:
        self.backend = backend
        self.quiet = quiet
        self.force = force
        self.session = session
        self.sessions = sessions
        """Where sessions are saved (the first), then where older versions saved them."""
        self.markdown = markdown
        self.name: str | None = None
        self.failed = False
        self.rate = ui.PrefillRate()
        """The session's prefill speed, measured on its turns: what the cache saved."""

    def reply(self, events: Iterator[Event]) -> None:
        """Stream a reply to stdout; Ctrl-C stops it (the partial reply stays in the session)."""
        from rich.live import Live
        from rich.markdown import Markdown

        from mlxcache.events import Done, Token

        text = ""
        stats = None
        finish: tuple[str, int, str] = ("", 0, "")
        live = Live(Markdown(""), console=ui.out, auto_refresh=False) if self.markdown else None
        bar = ui.PrefillBar(self.quiet)
        try:
            if live:
                live.start()
            with ui.no_echo() if live else contextlib.nullcontext():
                for event in events:
                    bar(event)
                    if isinstance(event, Token):
                        text += event.text
                        if live:
                            live.update(Markdown(text), refresh=True)
                        else:
                            ui.out_text(event.text)
                    elif isinstance(event, Done):
                        stats = event.result.stats.as_dict()
                        result = event.result
                        finish = (result.finish_reason, len(result.tokens), result.text)
        except KeyboardInterrupt:
            close = getattr(events, "close", None)
            if close:
                close()
        finally:
            bar.close()
            if live:
                live.stop()  # before anything else is printed: Live owns the cursor until then
        if not live:
            ui.out_text("\n")
        if stats is None:
            kept = bool(self.session.turns) and self.session.turns[-1].interrupted
            ui.warn(
                "reply stopped; it stays in the session (/retry to regenerate)"
                if kept
                else "reply stopped before its first token; the message was not kept"
                + self.backend.prompt_kept()
            )
        else:
            ui.stats_line(stats, self.rate, self.quiet)
            if not self.quiet:
                ui.finish_note(*finish)
        self.autosave()

    def autosave(self) -> None:
        if self.name:
            from mlxcache.modes import chat

            chat.save(self.session, self.sessions[0], self.name)

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line[1:].partition(" ")
        handlers: dict[str, Callable[[str], bool | None]] = {
            "retry": self._retry,
            "edit": self._edit,
            "undo": lambda _: self._undo(),
            "system": self._system,
            "history": lambda _: self._history(),
            "save": self._save,
            "load": self._load,
            "sessions": lambda _: ui.info(saved_sessions(self.sessions)),
            "stats": self._stats,
            "clear": lambda _: self._clear(),
            "help": lambda _: ui.info(HELP),
            "exit": lambda _: False,
            "quit": lambda _: False,
        }
        handler = handlers.get(name)
        if handler is None:
            raise UserInputError(f"unknown command /{name} (try /help)")
        return handler(arg.strip()) is not False

    def _clear(self) -> None:
        n = len(self.session.turns)
        self.session.clear()
        ui.info(f"cleared {ui.plural(n, 'turn')}: the next message starts a new conversation")

    def _retry(self, arg: str) -> None:
        events = self.session.retry(self.backend.runner)  # checked first: is there a reply to redo?
        if arg:
            flag, _, value = arg.partition(" ")
            try:
                temperature = float(value) if flag in ("-t", "--temp") else None
            except ValueError:
                temperature = None
            if temperature is None:
                raise UserInputError("usage: /retry or /retry -t TEMPERATURE")
            self._set_temperature(temperature)
        elif self.session.sampling.temperature == 0:
            # Greedy decoding is exact here: the same prompt gives the same reply, always.
            ui.info(
                "temperature 0 picks the most likely reply, the same each time: "
                "/retry -t 0.7 samples another"
            )
        self.reply(events)  # the generator reads the session's settings as it starts

    def _set_temperature(self, temperature: float) -> None:
        old = self.session.sampling
        new = o.sampling(**{**dataclasses.asdict(old), "temperature": temperature})
        self.session.sampling = new
        if new.temperature != old.temperature:
            ui.info(f"temperature {old.temperature} -> {new.temperature} for this session")

    def _undo(self) -> None:
        turn = self.session.undo()
        ui.info(f"removed turn {len(self.session.turns) + 1}: {turn.user!r}")
        self.autosave()

    def _edit(self, arg: str) -> None:
        number, _, text = arg.partition(" ")
        if not number.isdigit() or not text.strip():
            raise UserInputError("usage: /edit N TEXT")
        self.reply(self.session.edit(self.backend.runner, int(number), text))

    def _system(self, arg: str) -> None:
        self.session.system = arg or None
        self.autosave()
        ui.info(
            f"system message set ({len(arg)} characters), used from the next reply"
            if arg
            else "system message cleared"
        )

    def _history(self) -> None:
        if not self.session.turns:
            ui.info("no turns yet")
        for number, turn in enumerate(self.session.turns, start=1):
            mark = " (stopped)" if turn.interrupted else ""
            ui.info(
                f"{number} you> {ui.preview(turn.user, 70)}\n  {ui.preview(turn.reply, 72)}{mark}"
            )

    def _save(self, arg: str) -> None:
        from mlxcache.modes import chat

        if arg != self.name and chat.find(self.sessions, arg) is not None:
            raise UserInputError(
                f"a session {arg!r} exists already: pick another name, or /load it"
            )
        path = chat.save(self.session, self.sessions[0], arg)
        self.name = arg
        ui.info(f"saved {path}")

    def _load(self, arg: str) -> None:
        from mlxcache.modes import chat

        session = chat.load(self.sessions, arg)
        note = on_model(session, arg, self.backend.model, self.force)
        self.session, self.name = session, arg
        ui.info(describe_session(arg, self.session))
        if note:
            ui.warn(note)

    def _stats(self, arg: str) -> None:
        cache = self.backend.cache_report()
        if arg == "--json":
            ui.out_json(
                {
                    "session": self.name,
                    "turns": len(self.session.turns),
                    "model": self.backend.model.name,
                    "sampling": dataclasses.asdict(self.session.sampling),
                    "stop": list(self.session.stop),
                    "cache": cache,
                }
            )
            return
        if arg:
            raise UserInputError("usage: /stats or /stats --json")
        p = self.session.sampling
        ui.info(
            f"session {self.name or '(not saved)'} · {len(self.session.turns)} turns · "
            f"model {self.backend.model.name}\n"
            f"sampling: temp {p.temperature} · top-p {p.top_p} · top-k {p.top_k} · "
            f"min-p {p.min_p} · repetition penalty {p.repetition_penalty} · "
            f"max {p.max_tokens} tokens · seed {p.seed}\n"
            f"cache: {cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses · "
            f"{cache.get('cached_tokens', 0)} prompt tokens reused · "
            f"memory {ui.plural(cache.get('mem_entries', 0), 'entry')}, "
            f"{ui.human_bytes(cache.get('mem_bytes', 0))} · "
            f"disk {ui.plural(cache.get('disk_entries', 0), 'entry')}, "
            f"{ui.human_bytes(cache.get('disk_bytes', 0))} · "
            f"blocks of {cache.get('block_size', '?')} tokens"
        )

    def handle(self, line: str) -> bool:
        """One input line: a command or a message. False means leave."""
        if not line.strip():
            return True
        try:
            if line.startswith("/"):
                return self.command(line.strip())
            self.reply(self.session.ask(self.backend.runner, line))
        except MlxcacheError as exc:
            self.failed = True
            ui.error(exc)
        return True


def on_model(session: chat.ChatSession, name: str, loaded: Model, force: bool) -> str | None:
    """Record `loaded` as the session's model; a session made with another model goes on
    with this one only with `force` (its replies would come from two models).

    Returns:
        A note when it goes on with another model.

    Raises:
        UserInputError: the session was made with another model and not `force`.
    """
    note = None
    if session.other_model(loaded.key):
        change = f"session {name!r} was made with model {session.model}, not {loaded.name}"
        if not force:
            raise UserInputError(
                f"{change}: pass --model for it, or --force to go on with {loaded.name}"
            )
        note = f"{change}: going on with {loaded.name} (--force)"
    session.model, session.model_key = loaded.name, loaded.key
    return note


def describe_session(name: str, session: chat.ChatSession) -> str:
    """What a reopened session holds: its size and the last exchange."""
    text = f"session {name}: {len(session.turns)} turns"
    if session.system is not None:
        text += f", system: {ui.preview(session.system, 50)}"
    if session.turns:
        last = session.turns[-1]
        text += f"\n  last: you> {ui.preview(last.user, 66)}\n        {ui.preview(last.reply, 70)}"
    return text


def saved_sessions(directories: list[Path]) -> str:
    """One line per saved session, most recently used first (a name saved in an earlier
    directory hides the same name in a later one, as /load reads it)."""
    from mlxcache.modes import chat

    found: dict[str, Path] = {}
    for directory in directories:
        for path in directory.glob("*.json"):
            found.setdefault(path.stem, path)
    files = sorted(found.values(), key=lambda p: p.stat().st_mtime, reverse=True)
    lines = []
    now = time.time()
    for path in files:
        try:
            session = chat.load(path.parent, path.stem)
        except MlxcacheError:
            continue  # not a session (or a bad name): nothing to resume there
        first = ui.preview(session.turns[0].user, 40) if session.turns else ""
        when = ui.age(now - path.stat().st_mtime)
        lines.append(f"{path.stem:<20} {len(session.turns):>3} turns  {when:>4} ago  {first}")
    where = " or ".join(str(d) for d in directories)
    return "\n".join(lines) if lines else f"no saved sessions in {where}"


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was set on the command line or by its environment variable."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT")


def apply_options(
    ctx: typer.Context, session: chat.ChatSession, run: o.RunOptions, system: str | None
) -> list[str]:
    """Apply the options given with --resume to the session; returns what changed."""
    params = run.sampling()
    updates = {
        field: getattr(params, field)
        for field in (row.name for row in request_settings.SAMPLING)
        if _given(ctx, field) and getattr(params, field) != getattr(session.sampling, field)
    }
    changed = [f"{k} {getattr(session.sampling, k)} -> {v}" for k, v in updates.items()]
    session.sampling = dataclasses.replace(session.sampling, **updates)
    if _given(ctx, "stop") and run.stop_strings() != session.stop:
        changed.append(f"stop {list(session.stop)} -> {list(run.stop_strings())}")
        session.stop = run.stop_strings()
    if system is not None and system != session.system:
        changed.append("system message")
        session.system = system
    return changed


def _lines_from_tty(history: Path) -> Iterator[str]:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory

    history.parent.mkdir(parents=True, exist_ok=True)
    prompt: PromptSession[str] = PromptSession(history=FileHistory(str(history)))
    while True:
        try:
            parts = [prompt.prompt("you> ")]
            while parts[-1].endswith("\\"):
                parts[-1] = parts[-1][:-1]
                parts.append(prompt.prompt("...> "))
        except KeyboardInterrupt:
            continue
        except EOFError:
            return
        yield "\n".join(parts)


def _lines_from_pipe() -> Iterator[str]:
    parts: list[str] = []
    for number, raw in enumerate(sys.stdin.buffer, start=1):
        line = o.utf8(raw, f"stdin line {number}").rstrip("\n")
        if line.endswith("\\"):
            parts.append(line[:-1])
            continue
        yield "\n".join([*parts, line])
        parts = []
    if parts:
        yield "\n".join(parts)


@o.with_run_options(max_tokens=512)
def chat_cmd(
    ctx: typer.Context,
    system: o.System = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume",
            "-r",
            metavar="NAME",
            help="Reopen a saved session (later turns are saved to it); options given "
            "beside it change its settings.",
        ),
    ] = None,
    list_sessions: Annotated[
        bool, typer.Option("--list", "-l", help="List the saved sessions and exit.")
    ] = False,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Render replies as Markdown.")
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Resume (or /load) a session made with another model, with this one."
        ),
    ] = False,
    server: remote.ServerUrl = None,
    *,
    run: o.RunOptions,
) -> None:
    """Chat in the terminal; every turn resumes the conversation from the prompt cache."""
    from mlxcache.modes import chat

    sessions = session_dirs(run.cache_dir)
    if list_sessions:
        ui.out_text(saved_sessions(sessions) + "\n")
        return
    params, stops = run.sampling(), run.stop_strings()
    system = o.text_or_file(system, "system")
    changed: list[str] = []
    if resume is not None:
        session = chat.load(sessions, resume)  # checked before the model loads
        changed = apply_options(ctx, session, run, system)
    else:
        session = chat.ChatSession(system=system, sampling=params, stop=stops)
    with _backend(server, run, session) as backend:
        note = on_model(session, resume or "", backend.model, force)
        if resume is not None:
            ui.info(describe_session(resume, session))
            if changed:
                ui.info("changed: " + ", ".join(changed))
        if note:
            ui.warn(note)
        _repl(Repl(backend, session, sessions, markdown, run.quiet, force), resume, run)


@contextlib.contextmanager
def _backend(server: str | None, run: o.RunOptions, session: chat.ChatSession) -> Iterator[Backend]:
    """The running server at `server` (its identity checked), else the model loaded here."""
    if server:
        with contextlib.closing(remote.chat_server(server, run, session.sampling)) as backend:
            yield backend
        return
    from mlxcache.worker import EngineWorker

    with EngineWorker(run.engine(invariant=True)) as worker:
        yield Local(worker)


def _repl(repl: Repl, resume: str | None, run: o.RunOptions) -> None:
    repl.name = resume
    interactive = sys.stdin.isatty()
    if interactive:
        ui.err.print(
            f"mlxcache chat · {repl.backend.model.name} · /help for commands · Ctrl-D to leave",
            style="stats",
        )
    lines = (
        _lines_from_tty(resolve_cache_dir(run.cache_dir) / "chat_history")
        if interactive
        else _lines_from_pipe()
    )
    for line in lines:
        if not repl.handle(line):
            break
    if repl.failed and not interactive:
        raise typer.Exit(2)

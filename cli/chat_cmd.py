"""`mlxcache chat`: a terminal chat REPL; with stdin not a TTY, one turn per input line."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.live import Live
from rich.markdown import Markdown

from mlxcache.engine import Engine
from mlxcache.errors import MlxcacheError, UserInputError
from mlxcache.events import Done, Event, Token
from mlxcache.modes import chat
from mlxcache.paths import cache_dir as resolve_cache_dir
from mlxcache_cli import options as o
from mlxcache_cli import ui

HELP = """commands:
  /retry            regenerate the last reply
  /edit N TEXT      rewrite turn N and continue from there
  /undo             remove the last turn
  /system TEXT      set the system message (/system alone clears it)
  /save NAME        save the session (later turns are saved too)
  /load NAME        open a saved session
  /stats            session and cache statistics
  /clear            forget every turn
  /help             this list
  /exit             leave (Ctrl-D too)
A line ending in \\ continues on the next line. Ctrl-C stops a reply and keeps the session."""


class Repl:
    """Holds the session and what the commands act on."""

    def __init__(
        self, engine: Engine, session: chat.ChatSession, sessions: Path, markdown: bool
    ) -> None:
        self.engine = engine
        self.session = session
        self.sessions = sessions
        self.markdown = markdown
        self.name: str | None = None
        self.failed = False

    def reply(self, events: Iterator[Event]) -> None:
        """Stream a reply to stdout; Ctrl-C stops it (the partial reply stays in the session)."""
        text = ""
        stats = None
        live = Live(Markdown(""), console=ui.out, auto_refresh=False) if self.markdown else None
        try:
            if live:
                live.start()
            for event in events:
                if isinstance(event, Token):
                    text += event.text
                    if live:
                        live.update(Markdown(text), refresh=True)
                    else:
                        ui.out_text(event.text)
                elif isinstance(event, Done):
                    stats = event.result.stats.as_dict()
        except KeyboardInterrupt:
            close = getattr(events, "close", None)
            if close:
                close()
        finally:
            if live:
                live.stop()  # before anything else is printed: Live owns the cursor until then
        if not live:
            ui.out_text("\n")
        if stats is None:
            ui.warn("reply stopped; it stays in the session (/retry to regenerate)")
        else:
            ui.stats_line(stats)
        self.autosave()

    def autosave(self) -> None:
        if self.name:
            chat.save(self.session, self.sessions, self.name)

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line[1:].partition(" ")
        handlers: dict[str, Callable[[str], bool | None]] = {
            "retry": lambda _: self.reply(self.session.retry(self.engine)),
            "edit": self._edit,
            "undo": lambda _: self._undo(),
            "system": self._system,
            "save": self._save,
            "load": self._load,
            "stats": lambda _: self._stats(),
            "clear": lambda _: self.session.clear(),
            "help": lambda _: ui.info(HELP),
            "exit": lambda _: False,
            "quit": lambda _: False,
        }
        handler = handlers.get(name)
        if handler is None:
            raise UserInputError(f"unknown command /{name} (try /help)")
        return handler(arg.strip()) is not False

    def _undo(self) -> None:
        turn = self.session.undo()
        ui.info(f"removed turn {len(self.session.turns) + 1}: {turn.user!r}")
        self.autosave()

    def _edit(self, arg: str) -> None:
        number, _, text = arg.partition(" ")
        if not number.isdigit() or not text.strip():
            raise UserInputError("usage: /edit N TEXT")
        self.reply(self.session.edit(self.engine, int(number), text))

    def _system(self, arg: str) -> None:
        self.session.system = arg or None
        self.autosave()

    def _save(self, arg: str) -> None:
        if arg != self.name and chat.session_path(self.sessions, arg).exists():
            raise UserInputError(
                f"a session {arg!r} exists already: pick another name, or /load it"
            )
        path = chat.save(self.session, self.sessions, arg)
        self.name = arg
        ui.info(f"saved {path}")

    def _load(self, arg: str) -> None:
        self.session = chat.load(self.sessions, arg)
        self.name = arg
        ui.info(f"loaded {arg}: {len(self.session.turns)} turns")

    def _stats(self) -> None:
        report = {"turns": len(self.session.turns), **self.engine.cache.report()}
        ui.info(" · ".join(f"{k} {v}" for k, v in report.items()))

    def handle(self, line: str) -> bool:
        """One input line: a command or a message. False means leave."""
        if not line.strip():
            return True
        try:
            if line.startswith("/"):
                return self.command(line.strip())
            self.reply(self.session.ask(self.engine, line))
        except MlxcacheError as exc:
            self.failed = True
            ui.error(str(exc))
        return True


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


# Chat turns add tens of tokens at a time: 32-token blocks let even the first retry resume
# (at 256 nothing is reused before the context passes 256 tokens). The price: smaller
# prefill chunks for a long pasted text, which Metal runs less efficiently.
@o.with_run_options(max_tokens=512, block_size=32)
def chat_cmd(
    system: o.System = None,
    resume: Annotated[
        str | None,
        typer.Option(
            "--resume", "-r", help="Reopen a saved session (later turns are saved to it)."
        ),
    ] = None,
    markdown: Annotated[
        bool, typer.Option("--markdown", help="Render replies as Markdown.")
    ] = False,
    *,
    run: o.RunOptions,
) -> None:
    """Chat in the terminal; every turn resumes the conversation from the prompt cache."""
    params = run.sampling()
    sessions = resolve_cache_dir(run.cache_dir) / "sessions"
    if resume is not None:
        session = chat.load(sessions, resume)
        if system is not None:
            session.system = system
    else:
        session = chat.ChatSession(system=system, sampling=params)
    engine = run.engine()
    repl = Repl(engine, session, sessions, markdown)
    repl.name = resume
    interactive = sys.stdin.isatty()
    if interactive:
        ui.err.print("mlxcache chat · /help for commands · Ctrl-D to leave", style="stats")
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

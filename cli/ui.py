"""Presentation: one Rich theme; results on stdout, progress, stats and errors on stderr."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlxcache import request_settings
from mlxcache.config import human_bytes as human_bytes  # the CLI's sizes, as the library says them
from mlxcache.errors import worded

if TYPE_CHECKING:  # imported where used: `--version` or `json --check` draw nothing
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from mlxcache.events import Probing

STYLES = {
    "error": "bold red",
    "stats": "dim",
    "cached": "green",
    "warn": "yellow",
    "thought": "dim italic",
}
"""The theme every console of the CLI shares."""


def console(stderr: bool = False, **options: Any) -> Console:
    """A Rich console with the CLI's theme (on stdout, or stderr)."""
    from rich.console import Console
    from rich.theme import Theme

    return Console(stderr=stderr, theme=Theme(STYLES), highlight=False, **options)


def _shared(name: str) -> Console:
    """`err` or `out`: the module's console of that name (a test may set one), made on
    first use."""
    made: Console | None = globals().get(name)
    if made is None:
        made = globals()[name] = console(stderr=name == "err")
    return made


def __getattr__(name: str) -> Console:
    """`err` and `out`, the consoles on stderr and stdout, made on first use: importing
    Rich's console costs ~50 ms of a command that prints nothing through it."""
    if name not in ("err", "out"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _shared(name)


_stdout = {"mid_line": False}


def out_text(text: str) -> None:
    """Write reply text to stdout exactly as generated (no markup, no wrapping)."""
    sys.stdout.write(text)
    sys.stdout.flush()
    if text:
        _stdout["mid_line"] = not text.endswith("\n")


def stdin_is_terminal() -> bool:
    """Whether stdin is a terminal: someone there can answer a question."""
    try:
        return sys.stdin.isatty()
    except (AttributeError, ValueError):  # closed, or a stand-in without a descriptor
        return False


def stdout_is_terminal() -> bool:
    """Whether stdout is a terminal (read there), not a file or a pipe."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):  # closed, or a stand-in without a descriptor
        return False


def end_line() -> None:
    """End a reply cut mid-line (Ctrl-C), so that the error line starts a line of its own."""
    if _stdout["mid_line"]:
        out_text("\n")


def out_json(obj: Any) -> None:
    """One JSON document on a line of stdout."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def out_table(table: Any) -> None:
    """A Rich table on stdout; piped, as wide as its content (paths are never cut)."""
    out = _shared("out")
    if out.is_terminal:
        out.print(table)
    else:  # Console.print caps width at the console's: a wide console of its own
        console(file=sys.stdout, width=10_000).print(table)


def age(seconds: float) -> str:
    """How long ago, coarsely: 45s, 12m, 3h, 2d."""
    for unit, length in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= length:
            return f"{int(seconds // length)}{unit}"
    return f"{max(0, int(seconds))}s"


def plural(n: int, word: str) -> str:
    """`1 token`, `2 tokens`, `1 entry`, `3 entries`."""
    if n == 1:
        return f"1 {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def preview(text: str, width: int = 60) -> str:
    """One line of at most `width` characters: whitespace folded, the cut marked with …."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


FLAGS = {
    "block_size": "--block-size",
    "state_stride": "--state-stride",
    "kv_bits": "--kv-bits",
    "kv_group_size": "--kv-group-size",
    "mem_limit": "--mem-limit",
    "think": "--think",
    "think_budget": "--think-budget",
    "tool_choice": "--tool-choice",
    "tool_result": "--tool-result",
    "strict": "drop --strict",
    "messages": "--messages FILE",
    "json_output": "previous --json output",
    "split": "--split",
    "draft": "--draft",
    "draft_tokens": "--draft-tokens",
    "draft_ngram": "--draft-ngram",
}
"""The words of the CLI for the settings library messages name (`errors.Worded`): their
flags, where the library names them as its API does (max_tokens -> --max-tokens); the
request settings' are their table's (`flags`)."""


def flags() -> dict[str, str]:
    """`FLAGS` and the request settings' flags (max_tokens -> --max-tokens)."""
    return {**{row.name: row.flag for row in request_settings.SAMPLING}, **FLAGS}


def as_flags(message: object) -> str:
    """A library error or message in the CLI's words: settings named by their flags."""
    return worded(message, flags())


def error(message: object) -> None:
    """The one red line a failed command prints (`message`: text, or a library error)."""
    _shared("err").print(f"error: {as_flags(message)}", style="error", markup=False, soft_wrap=True)


def info(message: str) -> None:
    """A plain status line on stderr (never wrapped: scripts may parse it)."""
    _shared("err").print(message, style="stats", markup=False, soft_wrap=True)


def thought(reasoning: str | None) -> None:
    """A plain reply's thinking section, on stderr: seen, and kept out of stdout's answer."""
    if reasoning:
        _shared("err").print(
            f"thinking: {reasoning}",
            style="thought",
            markup=False,
            highlight=False,
            soft_wrap=True,  # as generated: no line breaks added at the terminal's width
        )


def warn(message: object) -> None:
    _shared("err").print(
        f"warning: {as_flags(message)}", style="warn", markup=False, soft_wrap=True
    )


def finish_note(finish_reason: str, tokens: int, text: str = "") -> None:
    """Say when a plain reply ended at the token limit rather than where the model stopped,
    and when it was looping (a small model at greedy decoding): what helps."""
    if finish_reason != "length":
        return
    from mlxcache.modes.repeats import describe_loop

    loop = describe_loop(text)
    if loop:
        info(
            f"stopped at the token limit ({plural(tokens, 'token')}){loop}: "
            "--repetition-penalty 1.1 or --temp 0.7 can get it out, -n caps it sooner"
        )
    else:
        info(f"stopped at the token limit ({plural(tokens, 'token')}; -n for more)")


EXTRAPOLATE_FROM = 128
"""Prompt tokens a cold prefill needs before its per-token cost prices more cached tokens
than it had: a shorter one's fixed costs (the first token's sampling, call overheads) weigh
on each of its few tokens, and scaled up they would claim more than a cold prefill takes."""


@dataclass(slots=True)
class PrefillRate:
    """Prefill cost measured on this run's own cold prefills (nothing cached: tokens from
    position 0, as the cached ones were computed), the longest one: what a cached token
    would have cost here. A resumed prefill is no measure: its few tokens attend to the
    whole cached prefix and carry the restore, so per token it costs more than cold.
    A prefill's time is its time to first token less its restore."""

    tokens: int = 0
    seconds: float = 0.0

    def add(self, stats: dict[str, Any]) -> None:
        if stats["cached_tokens"] == 0 and stats["prefilled_tokens"] > self.tokens:
            self.tokens = stats["prefilled_tokens"]
            self.seconds = max(0.0, stats["ttft_s"] - stats["restore_s"])

    def saved_s(self, stats: dict[str, Any]) -> float | None:
        """Seconds the cached tokens would have taken to prefill cold, less their restore;
        None when unknown: nothing cached, no cold prefill measured, or one shorter than
        the cached tokens and than `EXTRAPOLATE_FROM`."""
        cached = stats["cached_tokens"]
        if not cached or self.seconds <= 0 or self.tokens < min(cached, EXTRAPOLATE_FROM):
            return None
        return max(0.0, cached * self.seconds / self.tokens - stats["restore_s"])


def seconds(value: float) -> str:
    """A duration as people read it: 3.1 s, 0.25 s."""
    return f"{value:.1f} s" if value >= 1 else f"{value:.2f} s"


def stats_line(stats: dict[str, Any], rate: PrefillRate | None = None, quiet: bool = False) -> None:
    """Per-request stats: the user sees how much of the prompt came from the cache, from
    which tier (or why nothing did), about how much time that saved, what drafting did
    and what the KV holds an element in. `quiet` (-q): nothing.

    `rate`: the run's prefill cost so far (chat keeps one per session); this request's own
    prefill is added to it first.
    """
    rate = rate if rate is not None else PrefillRate()
    rate.add(stats)
    if quiet:
        return
    cached, prompt = stats["cached_tokens"], stats["prompt_tokens"]
    where = stats.get("cached_from") if cached else stats.get("miss_reason")
    why = f" ({where})" if where else ""
    saved = rate.saved_s(stats)
    saving = "" if saved is None else f" · saved ~{seconds(saved)}"
    kv = f" · KV {stats['kv']}" if stats.get("kv") else ""
    _shared("err").print(
        f"[cached]{cached}[/cached]/{prompt} prompt tokens cached{why}, "
        f"{stats['prefilled_tokens']} prefilled{saving} · TTFT {stats['ttft_s']:.2f}s · "
        f"{plural(stats['generated_tokens'], 'token')} at {stats['decode_tps']:.1f} tok/s"
        f"{drafted(stats)}{kv}",
        style="stats",
        markup=True,
        highlight=False,
        soft_wrap=True,  # one line, whatever the width: scripts and tests read it
    )


def drafted(stats: dict[str, Any]) -> str:
    """What drafting did for a reply, as the stats line says it ("" when it was not
    drafted): drafts made and accepted, and the model's forwards per token after the
    first (plain decoding makes one)."""
    if not stats.get("draft"):
        return ""
    steps = max(stats["generated_tokens"] - 1, 1)
    return (
        f" · {stats['draft']} drafted {stats['drafted_tokens']}, accepted "
        f"{stats['accepted_tokens']} · {stats['verify_forwards'] / steps:.2f} forwards/token"
    )


@contextmanager
def no_echo(fd: int | None = None) -> Iterator[None]:
    """Keys typed on the terminal (`fd`, default stdin) are not echoed meanwhile.

    Rich's live display redraws a reply in place by moving the cursor up as many lines as it
    drew; an echo (Ctrl-C's `^C` after a full-width line wraps to a new one) moves the
    cursor under it, and the final redraw then repeats the reply's first line. Not a
    terminal: nothing to do.
    """
    try:
        import termios

        fd = sys.stdin.fileno() if fd is None else fd
        before = termios.tcgetattr(fd)
    except ImportError:  # Windows
        yield
        return
    except (termios.error, OSError, ValueError, AttributeError):
        yield  # stdin is no terminal, or closed, or replaced by a test's stand-in
        return
    quiet = list(before)
    quiet[3] &= ~(termios.ECHO | termios.ECHOCTL)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, before)


class ProbeNotes:
    """The one-time probes of this device (`events.Probing`) on stderr: a line saying what
    one measures and why as it starts, a transient bar of its steps and the time spent
    while it runs (on a terminal), and a line with its duration when it is done."""

    def __init__(self) -> None:
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, event: Probing) -> None:
        if event.done == 0:
            info(f"measuring {event.what} for {event.model} (once): {event.why}")
            if _shared("err").is_terminal:
                self._start(event.total)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=event.done)
        if event.finished:
            if self._bar is not None:
                self._bar.stop()
            self._bar = self._task = None
            info(f"measured {event.what} for {event.model} in {seconds(event.elapsed_s)}")

    def close(self) -> None:
        """Stop a bar still drawn (its probe failed or was interrupted: no last event)."""
        if self._bar is not None:
            self._bar.stop()
        self._bar = self._task = None

    def _start(self, total: int) -> None:
        from rich.errors import LiveError

        bar = _new_bar("{task.description}", "{task.completed}/{task.total}", elapsed=True)
        try:
            bar.start()
        except LiveError:  # another display owns the terminal (a reply being drawn)
            return
        self._bar, self._task = bar, bar.add_task("measuring", total=total)


def regress_progress(quiet: bool) -> Callable[[str, str, str], None] | None:
    """Lines on stderr for each variant and case as it starts and ends, unless quiet (piped
    or not: a suite can run for minutes, and a log shows where it is)."""
    if quiet:
        return None
    started: dict[tuple[str, str], float] = {}

    def show(variant: str, case: str, what: str) -> None:
        name = f"{variant}: {case}" if case else variant
        if what == "start":
            started[(variant, case)] = time.monotonic()
            info(f"{name} ...")
        else:  # cases run side by side (lanes) are not timed one by one
            begun = started.pop((variant, case), None)
            info(
                f"{name} done"
                if begun is None
                else f"{name} done ({time.monotonic() - begun:.1f}s)"
            )

    return show


def _new_bar(
    label: str, count: str, transient: bool = True, rate: bool = False, elapsed: bool = False
) -> Progress:
    """A progress bar on stderr: label, bar, count, tok/s (`rate`), time left (or, with
    `elapsed`, time spent: steps of uneven length say nothing of what is left)."""
    from rich.progress import (
        BarColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task: Task) -> Text:
            return Text(f"{task.speed:.1f} tok/s" if task.speed else "", style="stats")

    speed = [Rate()] if rate else []
    clock = TimeElapsedColumn() if elapsed else TimeRemainingColumn()
    columns = [TextColumn(label), BarColumn(), TextColumn(count), *speed, clock]
    return Progress(*columns, console=_shared("err"), transient=transient)


class PrefillBar:
    """A transient prefill progress bar on stderr (tokens done/total, tok/s, ETA).

    Feed it a request's events. It shows up only on a terminal, only once a prefill has
    run for `delay` seconds, and goes away when the prefill ends; stdout never sees it.
    """

    def __init__(self, quiet: bool = False, delay: float = 1.0) -> None:
        self.replying = False
        """Whether the request got past its prefill (a token, or its end)."""
        self._on = not quiet and _shared("err").is_terminal
        self._delay = delay
        self._start = time.monotonic()
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __call__(self, event: object) -> None:
        from mlxcache.events import Done, Prefill, Token

        if isinstance(event, Token | Done):
            self.replying = True
        if not self._on or not isinstance(event, Prefill):
            return
        if event.done >= event.total:
            self.close()
            return
        if self._bar is None and time.monotonic() - self._start >= self._delay:
            self._bar = _new_bar("prefill", "{task.completed}/{task.total} tokens", rate=True)
            self._task = self._bar.add_task("prefill", total=event.total)
            self._bar.start()
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=event.done, total=event.total)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        self._bar = None
        self._start = time.monotonic()  # the next request's prefill waits its own delay

    def __enter__(self) -> PrefillBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


PIPED_MIN_STEPS = 64
"""A stage this long is said in a log (a real model's conversion: minutes, 200+ tensors);
a shorter one is over before anyone reads it."""


@contextmanager
def progress_bar(
    transient: bool = True, piped: str | None = None
) -> Iterator[Callable[[str, int, int], None]]:
    """A stderr progress bar, shown from the first update on; yields `update(stage, done,
    total)`. Not on a terminal: nothing, or with `piped`, one line per stage saying it."""
    bar: Progress | None = None
    tasks: dict[str, TaskID] = {}
    said: set[str] = set()

    def update(stage: str, done: int, total: int) -> None:
        nonlocal bar
        if not _shared("err").is_terminal:  # a log or a pipe: no redraw noise
            if piped is not None and total >= PIPED_MIN_STEPS and stage not in said:
                said.add(stage)
                info(f"{piped}: {stage}, {total} steps...")
            return
        if bar is None:
            bar = _new_bar("{task.description}", "{task.completed}/{task.total}", transient)
            bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    try:
        yield update
    finally:
        if bar is not None:
            bar.stop()


def batch_line(
    *, ran: int, skipped: int, failed: int, cached: int, prompt: int, seconds: float, output: str
) -> None:
    """End of a JSONL batch: what ran, what a rerun skipped, and what the cache saved."""
    if not ran:  # a rerun of a finished batch: nothing ran, nothing to measure
        info(f"0 lines run, {skipped} already in {output}")
        return
    _shared("err").print(
        f"{ran} lines run, {skipped} already in {output}, {failed} failed · "
        f"[cached]{cached}[/cached]/{prompt} prompt tokens cached · {seconds:.1f}s "
        f"({seconds / ran:.2f}s per line)",
        style="stats",
        soft_wrap=True,
    )

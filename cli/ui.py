"""Presentation: one Rich theme; results on stdout, progress, stats and errors on stderr."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.theme import Theme

THEME = Theme({"error": "bold red", "stats": "dim", "cached": "green", "warn": "yellow"})
err = Console(stderr=True, theme=THEME, highlight=False)


def out_text(text: str) -> None:
    """Write reply text to stdout exactly as generated (no markup, no wrapping)."""
    sys.stdout.write(text)
    sys.stdout.flush()


def out_json(obj: Any) -> None:
    """One JSON document on a line of stdout."""
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")
    sys.stdout.flush()


out = Console(theme=THEME, highlight=False)


def out_table(table: Any) -> None:
    """A Rich table on stdout."""
    out.print(table)


def error(message: str) -> None:
    """The one red line a failed command prints."""
    err.print(f"error: {message}", style="error", markup=False, soft_wrap=True)


def info(message: str) -> None:
    """A plain status line on stderr (never wrapped: scripts may parse it)."""
    err.print(message, style="stats", markup=False, soft_wrap=True)


def warn(message: str) -> None:
    err.print(f"warning: {message}", style="warn", markup=False, soft_wrap=True)


def stats_line(stats: dict[str, Any]) -> None:
    """Per-request stats: the user sees how much of the prompt came from the cache."""
    cached, prompt = stats["cached_tokens"], stats["prompt_tokens"]
    err.print(
        f"[cached]{cached}[/cached]/{prompt} prompt tokens cached, "
        f"{stats['prefilled_tokens']} prefilled · TTFT {stats['ttft_s']:.2f}s · "
        f"{stats['generated_tokens']} tokens at {stats['decode_tps']:.1f} tok/s",
        style="stats",
    )


@contextmanager
def progress_bar(transient: bool = True) -> Iterator[Callable[[str, int, int], None]]:
    """A stderr progress bar, shown from the first update on; yields `update(stage, done, total)`."""
    bar: Progress | None = None
    tasks: dict[str, TaskID] = {}

    def update(stage: str, done: int, total: int) -> None:
        nonlocal bar
        if not err.is_terminal:  # a log or a pipe gets no redraw noise
            return
        if bar is None:
            bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeRemainingColumn(),
                console=err,
                transient=transient,
            )
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
    per = f" ({seconds / ran:.2f}s per line)" if ran else ""
    err.print(
        f"{ran} lines run, {skipped} already in {output}, {failed} failed · "
        f"[cached]{cached}[/cached]/{prompt} prompt tokens cached · {seconds:.1f}s{per}",
        style="stats",
    )

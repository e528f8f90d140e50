"""Prefill progress: a transient bar on a terminal's stderr only; never on stdout."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from mlxcache.events import Prefill
from mlxcache_cli import ui


def bar_output(monkeypatch: pytest.MonkeyPatch, terminal: bool, quiet: bool) -> str:
    sink = io.StringIO()
    console = Console(file=sink, force_terminal=terminal, width=100)
    monkeypatch.setattr(ui, "err", console)
    with ui.PrefillBar(quiet, delay=0.0) as bar:
        for done in (32, 64, 96):
            bar(Prefill(0, done, 120))
    return sink.getvalue()


def test_bar_shows_tokens_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    out = bar_output(monkeypatch, terminal=True, quiet=False)
    assert "prefill" in out and "/120 tokens" in out


@pytest.mark.parametrize(("terminal", "quiet"), [(False, False), (True, True)])
def test_no_bar_when_piped_or_quiet(
    monkeypatch: pytest.MonkeyPatch, terminal: bool, quiet: bool
) -> None:
    assert bar_output(monkeypatch, terminal, quiet) == ""


@pytest.mark.model
def test_generate_shows_progress_on_a_pty_and_nothing_on_stdout(cache_root: Path) -> None:
    """A real process: stderr is a pseudo-terminal, stdout a pipe."""
    prompt = "Summarize: " + "the tide rises and falls twice a day, " * 8
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxcache_cli", "generate", "-n", "3", "--no-cache", prompt],
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "COLUMNS": "100", "TERM": "xterm"},
    )
    os.close(slave)
    seen = b""
    try:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed its end
                break
            if not chunk:
                break
            seen += chunk
        stdout = proc.communicate(timeout=600)[0]
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    assert proc.returncode == 0, seen.decode(errors="replace")
    assert b"prefill" in seen and b"tokens" in seen  # the bar, on the terminal
    assert b"prefill" not in stdout and b"\x1b[" not in stdout  # stdout: the reply alone

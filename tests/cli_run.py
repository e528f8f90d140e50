"""A command run through Typer's CliRunner, as the fault tests read it: (exit code,
stdout, stderr), with no exception escaping but SystemExit."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from mlxcache_cli.main import app

runner = CliRunner()


def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.stdout, result.stderr


def unloadable(folder: Path) -> Path:
    """A model file that exists (so `-m` passes the path check every command makes before
    any work) but cannot load: a test of a check made before the model loads uses it, so
    the model's own error would show that check came too late."""
    path = folder / "unloadable.gguf"
    path.write_bytes(b"not a GGUF file")
    return path


def refused(line: str) -> tuple[int, str, str]:
    """What a bad input gives: exit 2, nothing on stdout, one error line."""
    return 2, "", f"error: {line}\n"

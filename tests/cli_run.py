"""A command run through Typer's CliRunner, as the fault tests read it: (exit code,
stdout, stderr), with no exception escaping but SystemExit."""

from __future__ import annotations

from typer.testing import CliRunner

from mlxcache_cli.main import app

runner = CliRunner()


def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.stdout, result.stderr


def refused(line: str) -> tuple[int, str, str]:
    """What a bad input gives: exit 2, nothing on stdout, one error line."""
    return 2, "", f"error: {line}\n"

"""The `mlxcache` command itself: version, help, usage errors as one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from mlxcache import __version__
from mlxcache.errors import GrammarError, Setting, SettingError, Worded
from mlxcache.sampling import SamplingParams
from mlxcache_cli import ui
from mlxcache_cli.main import app

runner = CliRunner()


def _commands(group: Any, path: tuple[str, ...] = ()) -> list[list[str]]:
    """Every leaf command's words, found from the app (a new command is checked too)."""
    out = []
    for name, cmd in group.commands.items():
        sub = getattr(cmd, "commands", None)
        out += _commands(cmd, (*path, name)) if sub is not None else [[*path, name]]
    return out


COMMANDS = _commands(typer.main.get_command(app))


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(flag: str) -> None:
    result = runner.invoke(app, [flag])
    assert (result.exit_code, result.stdout, result.stderr) == (0, f"mlxcache {__version__}\n", "")


@pytest.mark.parametrize("args", [[], ["-h"], ["--help"], ["cache"], ["models"], ["regress"]])
def test_bare_and_short_help_exit_0(args: list[str]) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 0 and result.stderr == ""
    assert "Usage: mlxcache" in result.stdout and "Commands" in result.stdout


def test_completion_is_offered() -> None:
    assert "--install-completion" in runner.invoke(app, ["-h"]).stdout


def test_every_command_is_found() -> None:
    assert ["generate"] in COMMANDS and ["cache", "prune"] in COMMANDS and len(COMMANDS) >= 16


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_every_command_help_has_examples_and_no_type_noise(args: list[str]) -> None:
    result = runner.invoke(app, [*args, "-h"], terminal_width=200)
    assert result.exit_code == 0
    examples = result.stdout.split("Examples:", 1)[1]
    assert f"mlxcache {' '.join(args)}" in examples
    assert "<bool>" not in result.stdout and "list[" not in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cache", "prune"], "error: Missing option '--max-size'. (see 'mlxcache cache prune --help')"),
        (["cache", "nope"], "error: No such command 'nope'. (see 'mlxcache cache --help')"),
        (["models", "ls", "--json", "x"], "error: Got unexpected extra argument(s) (x) (see 'mlxcache models ls --help')"),
    ],
)  # fmt: skip
def test_usage_errors_are_one_line(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", message + "\n")


def test_text_options_read_at_file(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["generate", "hi", "-s", "@/no/system.txt"])
    assert (missing.exit_code, missing.stdout) == (2, "")
    assert (
        missing.stderr
        == "error: cannot read system file /no/system.txt: No such file or directory\n"
    )
    (tmp_path / "empty.txt").write_text(" \n")
    empty = runner.invoke(app, ["generate", "hi", "-s", f"@{tmp_path / 'empty.txt'}"])
    assert (empty.exit_code, empty.stderr) == (
        2,
        f"error: system file {tmp_path / 'empty.txt'} is empty\n",
    )


def test_library_settings_become_flags() -> None:
    cut = Worded("raise ", Setting("max_tokens"), ", or bound the schema") + " (a loop)"
    assert cut == "raise max_tokens, or bound the schema (a loop)"  # the library's words
    assert ui.as_flags(cut) == "raise --max-tokens, or bound the schema (a loop)"
    strict = Worded("(", Setting("strict", "leave strict mode"), ")")
    assert (strict, ui.as_flags(GrammarError(strict))) == ("(leave strict mode)", "(drop --strict)")
    with pytest.raises(SettingError) as bad:
        SamplingParams(temperature=-1.0)
    assert ui.as_flags(bad.value) == "--temp must be a finite number >= 0, got -1.0"
    # Prose is never rewritten: only settings carried as data are.
    assert ui.as_flags("raise max_tokens in tool_choice") == "raise max_tokens in tool_choice"


def test_defaults_have_one_home() -> None:
    """The CLI's defaults are read from SamplingParams, CacheConfig and ServerConfig, and the
    library's server entry point has the same ones (max_queue was 64 here, 0 there)."""
    import inspect

    from mlxcache.config import CacheConfig, ServerConfig
    from mlxcache.server.run import serve

    group = typer.main.get_command(app)
    generate = {p.name: p.default for p in group.commands["generate"].params}  # type: ignore[attr-defined]
    served = {p.name: p.default for p in group.commands["serve"].params}  # type: ignore[attr-defined]
    sampling = SamplingParams()
    assert (generate["temperature"], generate["top_p"], generate["seed"]) == (
        sampling.temperature,
        sampling.top_p,
        sampling.seed,
    )
    assert generate["warm_ahead"] is CacheConfig().warm_ahead
    library = inspect.signature(serve).parameters
    for name in ("host", "port", "max_queue"):
        assert served[name] == library[name].default == getattr(ServerConfig, name), name
    assert served["max_body"] == "8M" and ServerConfig.max_body == 8 << 20
    assert library["on_listen"].default is inspect.Parameter.empty  # the caller announces


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["generate", "--prompt", "hi"], "No such option: --prompt (the prompt is the argument"),
        (["generate", "--temperature", "1", "hi"], "No such option: --temperature (use --temp)"),
        (["generate", "--num-draft-tokens", "2", "hi"], "(use --draft-tokens)"),
        (["generate", "-m", "20", "hi"], "for a token limit use -n 20 (--max-tokens)"),
        (["generate", "-m", "smollm2", "hi"], "did you mean smollm2-135m?"),
    ],
)
def test_mlx_lm_habits_point_to_our_flags(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plurals() -> None:
    assert [ui.plural(n, "token") for n in (0, 1, 2)] == ["0 tokens", "1 token", "2 tokens"]
    assert [ui.plural(n, "entry") for n in (1, 3)] == ["1 entry", "3 entries"]


def test_a_looping_reply_says_what_helps(cache_root: Path, tiny_gguf: Path) -> None:
    """The tiny model at greedy decoding ends "hello" in one character, repeated."""
    result = CliRunner().invoke(
        app, ["generate", "--raw", "hello", "-m", str(tiny_gguf), "-n", "80"]
    )
    assert result.exit_code == 0, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("stopped at the token limit (80 tokens); it was repeating ")
    assert last.endswith(
        ": --repetition-penalty 1.1 or --temp 0.7 can get it out, -n caps it sooner"
    )


def test_a_packaged_model_not_installed_says_how_to_get_it(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcache.model import loader

    monkeypatch.setattr(loader, "PACKAGED", {"nano-1m": "nano-1m-gguf-not-installed"})
    result = CliRunner().invoke(app, ["generate", "-m", "nano-1m", "hi"])
    assert result.exit_code == 2
    assert result.stderr == (
        "error: nano-1m comes in the package nano-1m-gguf-not-installed: pip install "
        "nano-1m-gguf-not-installed (it brings its chunk packages; `make setup` installs them)\n"
    )


def test_an_interrupt_mid_reply_starts_its_error_on_a_line_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlxcache_cli import main

    def interrupted() -> None:
        ui.out_text("The capital of")
        raise KeyboardInterrupt

    sub = typer.Typer()
    main.command(interrupted, app=sub)
    sub.command("other")(lambda: None)
    result = CliRunner().invoke(sub, ["interrupted"])
    assert result.exit_code == 130
    assert result.stdout == "The capital of\n" and result.stderr == "error: interrupted\n"


def test_a_long_stage_piped_to_a_log_is_said_once(capsys: pytest.CaptureFixture[str]) -> None:
    """No terminal: a stage of 64 steps or more (a real model's conversion) is one line, a
    short one (a tiny model's) nothing; no redraws either way."""
    with ui.progress_bar(piped="converting the model (once)") as update:
        for i in range(300):
            update("weights", i + 1, 300)
        update("write", 1, 1)
    assert capsys.readouterr().err == "converting the model (once): weights, 300 steps...\n"

"""`mlxcache generate` transcripts through Typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from mlxcache_cli import options as o
from mlxcache_cli.main import app

runner = CliRunner()
CAPITAL = ["generate", "What is the capital of France?", "--max-tokens", "12"]


@pytest.mark.model
def test_plain(cache_root: Path) -> None:
    result = runner.invoke(app, CAPITAL)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "The capital of France is Paris.\n"
    assert "0/37 prompt tokens cached (no cached prefix), 37 prefilled" in result.stderr


@pytest.mark.model
def test_json_from_stdin(cache_root: Path) -> None:
    result = runner.invoke(
        app, ["generate", "--json", "-n", "12"], input="What is the capital of France?"
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["text"] == "The capital of France is Paris."
    assert doc["tokens"] == [504, 3575, 282, 4649, 314, 7042, 30]
    assert doc["finish_reason"] == "stop"
    assert doc["stats"]["prompt_tokens"] == 37 and doc["stats"]["generated_tokens"] == 7


@pytest.mark.model
def test_prompt_file_raw_and_length(cache_root: Path, tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text("The capital of France is")
    result = runner.invoke(
        app, ["generate", "--raw", "-f", str(tmp_path / "p.txt"), "-n", "3", "--json"]
    )
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["text"] == " Paris.\n" and doc["finish_reason"] == "length"


@pytest.mark.model
def test_same_seed_same_bytes(cache_root: Path) -> None:
    args = ["generate", "Write a word.", "--temp", "1.0", "--seed", "7", "-n", "6", "--json"]
    first, second = runner.invoke(app, args), runner.invoke(app, args)
    assert first.exit_code == 0, first.stderr
    assert json.loads(first.stdout)["tokens"] == json.loads(second.stdout)["tokens"]
    other = runner.invoke(app, [*args[:-3], "--seed", "8", "-n", "6", "--json"])
    assert json.loads(other.stdout)["tokens"] != json.loads(first.stdout)["tokens"]


@pytest.mark.parametrize(
    ("args", "stdin", "message"),
    [
        (
            ["generate", "hi", "-m", "/nonexistent/model.gguf"],
            None,
            "error: model file not found: /nonexistent/model.gguf",
        ),
        (
            ["generate", "hi", "-m", "/nonexistent/folder"],
            None,
            "error: model not found: /nonexistent/folder (expected a .gguf file, an mlx-lm "
            "folder, a Hub repo id or a name of `mlxcache models ls`)",
        ),
        (["generate", ""], None, "error: the prompt is empty"),
        (["generate", "-"], "  \n", "error: the prompt is empty"),
        (["generate", "hi", "--max-tokens", "0"], None, "error: --max-tokens must be >= 1, got 0"),
        (["generate", "hi", "--top-p", "0"], None, "error: --top-p must be in (0, 1], got 0.0"),
        (
            ["generate", "hi", "--temp", "-1"],
            None,
            "error: --temp must be a finite number >= 0, got -1.0",
        ),
        (["generate", "hi", "--top-k", "-2"], None, "error: --top-k must be >= 0, got -2"),
        (["generate", "hi", "--stop", ""], None, "error: --stop needs a non-empty text"),
        (["generate", "hi", "--min-p", "1"], None, "error: --min-p must be in [0, 1), got 1.0"),
        (
            ["generate", "hi", "--repetition-penalty", "0"],
            None,
            "error: --repetition-penalty must be > 0, got 0.0",
        ),
        (
            ["generate", "hi", "-n", "abc"],
            None,
            "error: Invalid value for '--max-tokens' / '-n': Input should be a valid integer, "
            "unable to parse string as an integer (see 'mlxcache generate --help')",
        ),
        (
            ["generate", "hi", "--bogus"],
            None,
            "error: No such option: --bogus (see 'mlxcache generate --help')",
        ),
        (["nope"], None, "error: No such command 'nope'. (see 'mlxcache --help')"),
        (
            ["generate", "hi", "--cache-mem", "lots"],
            None,
            "error: not a size: 'lots' (try 512M or 2G)",
        ),
    ],
)
def test_bad_input(cache_root: Path, args: list[str], stdin: str | None, message: str) -> None:
    result = runner.invoke(app, args, input=stdin)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.strip() == message


def test_unsupported_gguf(cache_root: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    result = runner.invoke(app, ["generate", "hi", "-m", str(bad)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith("error: cannot read GGUF") and result.stderr.count("\n") == 1


def test_prompt_longer_than_context(cache_root: Path, tiny_gguf: Path) -> None:
    result = runner.invoke(app, ["generate", "--raw", "x" * 300, "-m", str(tiny_gguf)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == "error: the prompt has 300 tokens; the model's context is 256"


def dataclass_run(**values: Any) -> o.RunOptions:
    fields = {name: default for name, _, default in o._run_options()}
    return o.run_options({**fields, **values})


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("\\n\\n", "\n\n"),
        ("a\\tb\\r", "a\tb\r"),
        ("\\\\n", "\\n"),  # an escaped backslash, then a plain n
        ("C:\\x", "C:\\x"),  # other backslashes stay
        ("END", "END"),
    ],
)
def test_stop_reads_escapes(given: str, read: str) -> None:
    run = dataclass_run(stop=[given])
    assert run.stop_strings() == (read,)


def test_the_generate_help_example_of_stop_works() -> None:
    help_text = runner.invoke(app, ["generate", "--help"]).stdout
    assert '--stop "\\n\\n"' in help_text
    assert dataclass_run(stop=["\\n\\n"]).stop_strings() == ("\n\n",)

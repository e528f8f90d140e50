"""Sampling options on the command line (tiny model): --stop, the token-limit note, the
presence and frequency penalties."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_run import unloadable
from test_sampling import openai_penalties
from typer.testing import CliRunner

from mlxcache.engine import Engine, Request
from mlxcache.sampling import SamplingParams
from mlxcache_cli.main import app

runner = CliRunner()


def generate(tiny_gguf: Path, *args: str) -> tuple[int, str, str]:
    base = ["generate", "--raw", "hello there", "-m", str(tiny_gguf), "--no-cache", "-n", "10"]
    result = runner.invoke(app, [*base, *args])
    return result.exit_code, result.stdout, result.stderr


def test_stop_and_token_limit(cache_root: Path, tiny_gguf: Path) -> None:
    code, out, err = generate(tiny_gguf, "--json")
    full = json.loads(out)
    assert code == 0 and full["finish_reason"] == "length" and "token limit" not in err
    text = full["text"]
    code, out, err = generate(tiny_gguf)
    assert (code, out) == (0, text + "\n")
    assert err.splitlines()[-1] == "stopped at the token limit (10 tokens; -n for more)"
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    code, out, err = generate(tiny_gguf, "--stop", "never there", "--stop", stop)
    assert (code, out) == (0, text[: text.index(stop)] + "\n")
    assert "token limit" not in err


def test_sampling_options_reach_the_sampler(cache_root: Path, tiny_gguf: Path) -> None:
    greedy = generate(tiny_gguf, "--json")[1]
    top1 = generate(tiny_gguf, "--json", "--temp", "3", "--seed", "5", "--top-k", "1")[1]
    assert json.loads(top1)["tokens"] == json.loads(greedy)["tokens"]
    penalised = generate(tiny_gguf, "--json", "--repetition-penalty", "3")[1]
    assert json.loads(penalised)["tokens"] != json.loads(greedy)["tokens"]


def test_presence_and_frequency_penalties(cache_root: Path, tiny_gguf: Path, tiny: Any) -> None:
    flags = ["--presence-penalty", "1", "--frequency-penalty", "0.5"]
    code, out, _ = generate(tiny_gguf, "--json", *flags)
    engine = Engine(tiny, block_size=4)
    ids = engine.encoder.encode("hello there")
    penalties = openai_penalties(len(ids), 1.0, 0.5)
    expected = engine.complete(Request(ids, SamplingParams(max_tokens=10), [penalties]))
    assert code == 0 and json.loads(out)["tokens"] == expected.tokens
    assert expected.tokens != json.loads(generate(tiny_gguf, "--json")[1])["tokens"]


@pytest.mark.parametrize("command", ["generate", "json", "tools"])
@pytest.mark.parametrize(
    ("flag", "value"), [("--presence-penalty", "2.5"), ("--frequency-penalty", "-3")]
)
def test_out_of_range_penalties_are_refused(
    command: str, flag: str, value: str, tmp_path: Path
) -> None:
    tool = '[{"type": "function", "function": {"name": "f"}}]'
    args = {"generate": [], "json": ["--schema", '{"type": "object"}'], "tools": ["--tools", tool]}
    model = unloadable(tmp_path)
    result = runner.invoke(app, [command, "hi", "-m", str(model), *args[command], flag, value])
    line = f"error: {flag} must be in [-2, 2], got {float(value)}\n"
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", line)

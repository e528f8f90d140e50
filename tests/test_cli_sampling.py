"""Sampling options on the command line (tiny model): --stop, the token-limit note."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

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

"""Saved chat sessions: where they live, the model they were made with, and sessions written by older versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import refused, run
from tinymodel import write_tiny_gguf
from typer.testing import CliRunner

from mlxcache.modes import chat
from mlxcache_cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model (other weights)."""
    path = tmp_path_factory.mktemp("other") / "other.gguf"
    write_tiny_gguf(path, seed=9)
    return path


def test_a_session_resumes_on_its_own_model_unless_forced(
    tmp_path: Path, tiny_gguf: Path, other_gguf: Path, cache_root: Path
) -> None:
    common = ["--cache-dir", str(tmp_path), "--cache-disk", "0", "-n", "2"]
    code, _, err = run("chat", "-m", str(tiny_gguf), *common, stdin="/save s\nhi\n")
    assert code == 0, err
    recorded = json.loads((tmp_path / "sessions" / "s.json").read_text())
    assert recorded["model"] == "tiny.gguf" and len(recorded["model_key"]) == 32
    again = ["chat", "--resume", "s", *common]
    assert run(*again, "-m", str(other_gguf), stdin="next\n") == refused(
        "session 's' was made with model tiny.gguf, not other.gguf: pass --model for it, "
        "or --force to go on with other.gguf"
    )
    assert json.loads((tmp_path / "sessions" / "s.json").read_text()) == recorded
    code, _, err = run("chat", *common, "-m", str(other_gguf), stdin="/load s\n")
    assert code == 2 and err.splitlines()[-1] == (
        "error: session 's' was made with model tiny.gguf, not other.gguf: pass --model for "
        "it, or --force to go on with other.gguf"
    )
    code, _, err = run(*again, "-m", str(other_gguf), "--force", stdin="next\n")
    assert (
        code == 0
        and (
            "warning: session 's' was made with model tiny.gguf, not other.gguf: going on with "
            "other.gguf (--force)"
        )
        in err.splitlines()
    )
    assert json.loads((tmp_path / "sessions" / "s.json").read_text())["model"] == "other.gguf"


def test_a_session_without_a_model_still_resumes(
    tmp_path: Path, tiny_gguf: Path, cache_root: Path
) -> None:
    old = chat.ChatSession(turns=[chat.Turn("hi", "there")]).to_json()
    del old["model"], old["model_key"]  # written before sessions recorded their model
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "s.json").write_text(json.dumps(old))
    args = ["chat", "--resume", "s", "--cache-dir", str(tmp_path), "--cache-disk", "0"]
    code, _, err = run(*args, "-m", str(tiny_gguf), "-n", "2", stdin="next\n")
    assert code == 0, err
    assert json.loads((tmp_path / "sessions" / "s.json").read_text())["model"] == "tiny.gguf"


def _chat(tmp_path: Path, tiny_gguf: Path, stdin: str, *args: str) -> tuple[int, str, str]:
    extra = ["-m", str(tiny_gguf), "--cache-dir", str(tmp_path / "cache"), "--block-size", "4"]
    result = runner.invoke(app, ["chat", "-n", "2", *args, *extra], input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_sessions_live_in_the_data_directory_and_old_ones_still_load(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, old = tmp_path / "data", tmp_path / "cache" / "sessions"
    monkeypatch.setenv("MLXCACHE_DATA_DIR", str(data))
    chat.save(chat.ChatSession(turns=[chat.Turn("from before", "yes")]), old, "before")
    code, out, _ = _chat(tmp_path, tiny_gguf, "", "--list")
    assert code == 0 and out.split()[:3] == ["before", "1", "turns"]
    stdin = "/save before\n/load before\n/save fresh\n/load nope\n"
    code, _, err = _chat(tmp_path, tiny_gguf, stdin)
    assert code == 2
    assert err.splitlines() == [
        "error: a session 'before' exists already: pick another name, or /load it",
        "session before: 1 turns",
        "  last: you> from before",
        "        yes",
        f"saved {data / 'sessions' / 'fresh.json'}",
        f"error: no saved session 'nope' in {data / 'sessions'} or {old}",
    ]
    assert chat.load(data / "sessions", "fresh").turns[0].user == "from before"
    assert sorted(p.name for p in old.iterdir()) == ["before.json"]  # never written


def test_data_dir_follows_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    from platformdirs import user_data_dir

    from mlxcache.paths import data_dir

    monkeypatch.delenv("MLXCACHE_DATA_DIR")
    assert data_dir() == Path(user_data_dir("mlxcache", appauthor=False))

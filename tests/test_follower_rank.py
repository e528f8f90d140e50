"""What the CLI runs on a rank other than 0 of an `mlx.launch` run: a model-running
command opens the engine its options name and replays rank 0's calls instead of its body;
every other command runs as on rank 0 (no model, nothing to follow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import mlxcache.distributed
from mlxcache_cli import options
from tests.cli_run import run


@pytest.fixture
def followed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Rank 1 of a launched run whose engine opening and following are recorded."""
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setattr(
        options.RunOptions,
        "engine",
        lambda self, invariant=False: (
            "engine",
            self.model,
            self.settings["max_tokens"],
            self.cache_dir,
        ),
    )
    monkeypatch.setattr(mlxcache.distributed, "follow", lambda engine: seen.append(engine))
    return seen


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "hi"],
        ["chat"],
        ["json", "Ada"],
        ["tools", "--tools", "missing.json", "hi"],
        ["serve", "--port", "1"],
    ],
)
def test_a_model_running_command_follows_with_its_own_options(
    followed: list[tuple[Any, ...]], argv: list[str], tmp_path: Path
) -> None:
    model = tmp_path / "some.gguf"  # it exists: the path check made before any work passes
    model.write_bytes(b"")
    code, out, err = run(*argv, "-m", str(model), "-n", "7", "--cache-dir", str(tmp_path))
    assert (code, out, err) == (0, "", "")  # the body (and its input checks) is rank 0's
    assert followed == [("engine", str(model), 7, tmp_path)]


def test_a_command_without_a_model_runs_on_every_rank(
    followed: list[tuple[Any, ...]], tmp_path: Path
) -> None:
    code, out, _ = run("cache", "stats", "--cache-dir", str(tmp_path))
    assert code == 0 and out and followed == []


def test_rank_0_runs_the_body(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setattr(mlxcache.distributed, "follow", pytest.fail)
    code, out, err = run("tools", "--tools", str(tmp_path / "missing.json"), "hi")
    assert code == 2 and out == "" and "missing.json" in err  # the body's own check ran

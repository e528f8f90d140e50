"""JSONL batch reruns: records say what produced them; another run is refused unless --force."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mlxcache.modes.batch import run_description
from mlxcache.sampling import SamplingParams
from mlxcache_cli.main import app

runner = CliRunner()
SHORT = json.dumps({"type": "string", "maxLength": 4})


def batch(tmp_path: Path, tiny_gguf: Path, *args: str) -> tuple[int, str]:
    base = ["json", "--schema", SHORT, "--input", str(tmp_path / "in.jsonl")]
    extra = ["-o", str(tmp_path / "out.jsonl"), "-m", str(tiny_gguf), "--no-cache", "-n", "8"]
    result = runner.invoke(app, [*base, *extra, *args])
    assert result.stdout == ""
    return result.exit_code, result.stderr


def test_rerun_of_another_run_is_refused_unless_forced(
    cache_root: Path, tmp_path: Path, tiny_gguf: Path
) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    code, err = batch(tmp_path, tiny_gguf)
    assert code == 0, err
    first = out.read_bytes()
    run = json.loads(first.splitlines()[0])["run"]
    assert run["schema"] is not None and run["instructions"] is None
    assert run["sampling"]["max_tokens"] == 8 and len(run["model"]) == 16
    assert batch(tmp_path, tiny_gguf) == (0, f"0 lines run, 2 already in {out}\n")

    code, err = batch(tmp_path, tiny_gguf, "--seed", "5", "--instructions", "Be brief.")
    assert code == 2 and out.read_bytes() == first
    assert err == (
        f"error: output file {out} holds records of another run (line 1 differs in: "
        "instructions, seed): pass --force to redo its lines, or choose another --output\n"
    )
    code, err = batch(tmp_path, tiny_gguf, "--seed", "5", "--force")
    assert code == 0 and err.startswith(f"2 lines run, 0 already in {out}, 0 failed"), err
    redone = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in redone] == [1, 2]
    assert [r["run"]["sampling"]["seed"] for r in redone] == [5, 5]


def test_run_description_digests_inputs() -> None:
    params = SamplingParams(top_k=3)
    one = run_description("ab" * 32, params, schema={"type": "string"}, instructions=None)
    assert one == {
        "model": "ab" * 8,
        "schema": one["schema"],
        "instructions": None,
        "sampling": {**one["sampling"], "top_k": 3},
    }
    assert len(one["schema"]) == 16
    other = run_description("ab" * 32, params, schema={"type": "number"}, instructions=None)
    assert other["schema"] != one["schema"]


def test_records_from_before_the_penalties_count_as_their_default(
    cache_root: Path, tmp_path: Path, tiny_gguf: Path
) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    assert batch(tmp_path, tiny_gguf)[0] == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for record in records:  # as written before the fields existed
        del record["run"]["sampling"]["presence_penalty"]
        del record["run"]["sampling"]["frequency_penalty"]
    old = "".join(json.dumps(r) + "\n" for r in records).encode()
    out.write_bytes(old)
    assert batch(tmp_path, tiny_gguf) == (0, f"0 lines run, 2 already in {out}\n")
    assert batch(tmp_path, tiny_gguf, "--frequency-penalty", "1") == (
        2,
        f"error: output file {out} holds records of another run (line 1 differs in: "
        "frequency_penalty): pass --force to redo its lines, or choose another --output\n",
    )
    assert out.read_bytes() == old

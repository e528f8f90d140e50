"""`mlxcache bench schemas`: exact counts on a small folder, generation on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mlxcache.bench.schemas_bench import refusal_kind, run
from mlxcache_cli.main import app

TWINS = {
    "type": "array",
    "items": {"enum": ["a"]},
    "minItems": 2,
    "maxItems": 2,
    "uniqueItems": True,
}


def folder(tmp_path: Path) -> Path:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a_enum.json").write_text(json.dumps({"enum": ["a", "b"]}))
    (tmp_path / "sub" / "b_twins.json").write_text(json.dumps(TWINS))  # lenient only
    (tmp_path / "c_invalid.json").write_text('{"type": "strin"}')
    (tmp_path / "d_broken.json").write_text("{")
    (tmp_path / "notes.txt").write_text("not a schema")
    return tmp_path


def test_counts_and_generation(cache_root: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    result = run(folder(tmp_path), generate_n=2, model=str(tiny_gguf), max_tokens=16)
    assert (result["files"], result["compiled"], result["coverage"]) == (4, 2, 0.5)
    assert result["refused"] == {"invalid schema": 1, "unreadable": 1}
    assert result["crashes"] == [] and result["crash_count"] == 0
    assert result["strict_coverage"] == 0.25
    assert result["strict_refused"] == {
        "invalid schema": 1,
        "unreadable": 1,
        "unimplemented keyword": 1,
    }
    assert set(result["compile_ms"]) == {"p50", "p99", "max"}
    assert result["goals_pass"] is False  # 50% coverage
    gen = result["generate"]
    # The enum is always valid; the grammar can only write ["a", "a"], which uniqueItems refuses.
    assert (gen["valid"], gen["invalid"], gen["length"]) == (1, 1, 0)
    assert gen["invalid_errors"] == [
        "b_twins.json: the reply does not satisfy the schema: uniqueItems at /: ['a', 'a'] "
        "has non-unique elements"
    ]
    assert gen["length_files"] == []
    assert gen["goals_pass"] is False


def test_refusal_kinds() -> None:
    assert (
        refusal_kind("schema has a $ref cycle that never reaches a value at /$ref") == "$ref cycle"
    )
    assert refusal_kind("schema uses ...: Unknown format: foo at /format") == "unknown format"
    assert refusal_kind("something new") == "other"


def test_cli_prints_one_json_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "schemas", str(folder(tmp_path))])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["compiled"] == 2 and result.stdout.count("\n") == 1
    missing = CliRunner().invoke(app, ["bench", "schemas", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    assert missing.stderr.strip() == f"error: {tmp_path / 'nope'} is not a folder of JSON Schemas"

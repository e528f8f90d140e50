"""`mlxcache bench schemas`: exact counts on a small folder, generation on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from mlxcache.bench.schemas_bench import refusal_kind, run, tally
from mlxcache.modes.json_mode import JsonReply
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


GENERATED = {"valid", "invalid", "length", "invalid_errors", "length_files", "length_ends"}


def test_peer_runs_the_same_schemas(cache_root: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    lines: list[str] = []
    result = run(folder(tmp_path), 2, str(tiny_gguf), 16, "llguidance", on_reply=lines.append)
    assert lines == [
        "1/2 a_enum.json: mlxcache valid, llguidance valid",
        "2/2 b_twins.json: mlxcache invalid, llguidance refused",
    ]
    gen = result["generate"]
    assert set(gen) == GENERATED | {"seconds", "peer", "goals_pass"}
    assert (gen["valid"], gen["invalid"], gen["length"]) == (1, 1, 0)
    peer = gen["peer"]
    assert set(peer) == GENERATED | {"peer", "refused", "refused_errors", "seconds"}
    assert peer["peer"] == "llguidance"
    # The enum is valid whatever the weights; plain llguidance refuses uniqueItems outright
    # (mlxcache skips it while decoding and checks it after).
    assert (peer["valid"], peer["invalid"], peer["length"], peer["refused"]) == (1, 0, 0, 1)
    assert peer["refused_errors"] == ['b_twins.json: Unimplemented keys: ["uniqueItems"]']
    assert peer["length_files"] == [] and peer["length_ends"] == {}
    assert gen["goals_pass"] is False  # mlxcache's reply to b_twins is invalid


def test_tally_names_the_loop() -> None:
    replies = {
        "ok.json": JsonReply({}, "{}", "stop", {}),
        "loop.json": JsonReply(None, '{"a": [' + "1, " * 20, "length", {}, "cut"),
        "cut.json": JsonReply(None, '{"a": "xyz', "length", {}, "cut"),
        "bad.json": JsonReply(None, "{", "stop", {}, "not JSON: x"),
    }
    assert tally(replies) == {
        "valid": 1,
        "invalid": 1,
        "length": 2,
        "invalid_errors": ["bad.json: not JSON: x"],
        "length_files": ["loop.json", "cut.json"],
        "length_ends": {
            "loop.json": 'it was repeating "1, " (20 times)',
            "cut.json": 'ends "{\\"a\\": \\"xyz"',
        },
    }


def test_refusal_kinds() -> None:
    assert (
        refusal_kind("schema has a $ref cycle that never reaches a value at /$ref") == "$ref cycle"
    )
    assert refusal_kind("schema uses ...: Unknown format: foo at /format") == "unknown format"
    assert refusal_kind("something new") == "other"


def test_cli_prints_one_json_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["bench", "schemas", str(folder(tmp_path))])
    assert result.exit_code == 1  # 50% coverage misses the goal
    assert result.stderr == "error: bench schemas: goal not met: goals_pass\n"
    assert json.loads(result.stdout)["compiled"] == 2 and result.stdout.count("\n") == 1
    missing = CliRunner().invoke(app, ["bench", "schemas", str(tmp_path / "nope")])
    assert missing.exit_code == 2
    assert missing.stderr.strip() == f"error: {tmp_path / 'nope'} is not a folder of JSON Schemas"


def test_cli_peer(cache_root: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    args = ["bench", "schemas", str(folder(tmp_path))]
    unknown = CliRunner().invoke(app, [*args, "--generate", "1", "--peer", "outlines"])
    assert unknown.exit_code == 2
    assert unknown.stderr.strip() == "error: --peer must be one of: llguidance; got 'outlines'"
    alone = CliRunner().invoke(app, [*args, "--peer", "llguidance"])
    assert alone.exit_code == 2
    assert alone.stderr.strip() == (
        "error: --peer compares generated replies: give --generate N too"
    )
    one = tmp_path / "one"
    one.mkdir()
    (one / "a_enum.json").write_text(json.dumps({"enum": ["a", "b"]}))
    model = ["-m", str(tiny_gguf), "-n", "8"]
    both = CliRunner().invoke(
        app, ["bench", "schemas", str(one), "--generate", "1", "--peer", "llguidance", *model]
    )
    assert both.exit_code == 0, both.stderr
    assert both.stderr == (
        "1/1 a_enum.json: mlxcache valid, llguidance valid\nbench schemas: every goal met\n"
    )
    gen = json.loads(both.stdout)["generate"]
    assert (gen["valid"], gen["peer"]["peer"], gen["peer"]["valid"]) == (1, "llguidance", 1)
    assert gen["goals_pass"] is True  # 0 invalid, 0 cut-offs against the peer's 0

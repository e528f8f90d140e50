"""`mlxcache json` transcripts through Typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from mlxcache_cli.main import app

runner = CliRunner()
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
CITY_ARG = json.dumps(CITY)


def fill(text: str, paths: dict[str, Path]) -> str:
    for key, path in paths.items():
        text = text.replace("{" + key + "}", str(path))
    return text


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def without_stats(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in ("stats", "run")} for r in recs]


@pytest.mark.model
def test_capital_of_france(cache_root: Path) -> None:
    args = ["json", "What is the capital of France?", "--schema", CITY_ARG, "-n", "20"]
    result = runner.invoke(app, [*args, "--no-cache"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout == '{"city": "Paris,"}\n'  # SmolLM2-135M's answer, comma included
    jsonschema.validate(json.loads(result.stdout), CITY)
    assert "0/73 prompt tokens cached (cache off), 73 prefilled" in result.stderr
    assert "7 tokens at" in result.stderr


@pytest.fixture
def batch(tmp_path: Path) -> Path:
    (tmp_path / "in.jsonl").write_text(
        '{"prompt": "What is the capital of {{country}}?", "vars": {"country": "France"}, "id": "fr"}\n'
        "\n"
        '{"prompt": "What is the capital of Italy?"}\n'
    )
    (tmp_path / "instructions.txt").write_text("Answer briefly.")
    return tmp_path


def run_batch(folder: Path, out: str, *extra: str) -> Any:
    args = ["json", "--schema", CITY_ARG, "--instructions", str(folder / "instructions.txt")]
    args += ["--input", str(folder / "in.jsonl"), "--output", str(folder / out), "-n", "16"]
    return runner.invoke(app, [*args, *extra])


@pytest.mark.model
def test_batch_lanes_give_the_same_bytes_and_rerun_skips(cache_root: Path, batch: Path) -> None:
    two = run_batch(batch, "two.jsonl", "--lanes", "2", "--no-cache")
    assert two.exit_code == 0, two.stderr
    assert two.stdout == ""
    assert without_stats(records(batch / "two.jsonl")) == [
        {"line": 1, "id": "fr", "output": {"city": "Paris,"}, "finish_reason": "stop"},
        {"line": 3, "id": None, "output": {"city": "Rome,"}, "finish_reason": "stop"},
    ]
    assert "2 lines run, 0 already in" in two.stderr
    one = run_batch(batch, "one.jsonl", "--concurrency", "1", "--no-cache")
    assert one.exit_code == 0, one.stderr
    assert without_stats(records(batch / "one.jsonl")) == without_stats(
        records(batch / "two.jsonl")
    )
    before = (batch / "one.jsonl").read_bytes()
    again = run_batch(batch, "one.jsonl", "--no-cache")
    assert again.exit_code == 0, again.stderr
    assert "0 lines run, 2 already in" in again.stderr
    assert (batch / "one.jsonl").read_bytes() == before


@pytest.mark.model
def test_second_request_reuses_the_shared_prefix(cache_root: Path, batch: Path) -> None:
    cached = run_batch(batch, "cached.jsonl", "--block-size", "32", "--cache-disk", "0")
    assert cached.exit_code == 0, cached.stderr
    _, second = records(batch / "cached.jsonl")
    assert second["stats"]["cached_tokens"] > 0
    fresh = runner.invoke(
        app,
        [
            *("json", "What is the capital of Italy?", "--schema", CITY_ARG, "-n", "16"),
            *("--instructions", str(batch / "instructions.txt"), "--block-size", "32"),
            "--no-cache",
        ],
    )
    assert fresh.exit_code == 0, fresh.stderr
    assert fresh.stdout == json.dumps(second["output"]) + "\n"


# -- the tiny random model: fast CLI mechanics ------------------------------------------

SHORT = '{"type": "string", "maxLength": 6}'


def test_torn_last_line_is_redone(cache_root: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"}\n')
    args = ["json", "--schema", SHORT, "-m", str(tiny_gguf), "--input", str(tmp_path / "in.jsonl")]
    args += ["--output", str(tmp_path / "out.jsonl"), "--temp", "1", "--seed", "5", "--lanes", "2"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.stderr
    full = (tmp_path / "out.jsonl").read_bytes()
    assert [r["line"] for r in records(tmp_path / "out.jsonl")] == [1, 2, 3]
    cut = full.rindex(b"\n", 0, len(full) - 1) + 1
    (tmp_path / "out.jsonl").write_bytes(full[: cut + 10])  # a crash mid-write of line 3
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.stderr
    assert "dropping a partly written last line" in second.stderr
    assert "1 lines run, 2 already in" in second.stderr
    assert without_stats(records(tmp_path / "out.jsonl")) == without_stats(
        [json.loads(x) for x in full.splitlines()]
    )


def test_cut_off_reply_says_so(cache_root: Path, tiny_gguf: Path) -> None:
    schema = '{"type": "string", "minLength": 50}'
    result = runner.invoke(
        app, ["json", "x", "--schema", schema, "-m", str(tiny_gguf), "-n", "3", "--json"]
    )
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["output"] is None and doc["finish_reason"] == "length"
    assert result.stderr.strip().splitlines()[-1] == (
        "error: the reply reached the token limit (3) before the JSON document was complete "
        '(finish_reason "length"); raise --max-tokens, or bound the schema (maxLength, maxItems)'
    )


# -- bad input: exit 2, one line, nothing written -----------------------------------------

BAD = [
    (
        ["hi", "--schema", '{"type": "object",'],
        "error: schema is not JSON: Expecting property name enclosed in double quotes at line 1 column 19",
    ),
    (
        ["hi", "--schema", '{"properties": {"age": {"type": "int"}}}'],
        "error: schema is not valid JSON Schema at /properties/age/type (anyOf): 'int' is not valid under any of the given schemas",
    ),
    (
        ["hi", "--strict", "--schema", '{"properties": {"tags": {"uniqueItems": true}}}'],
        'error: schema uses what constrained decoding cannot enforce: Unimplemented keys: ["uniqueItems"] at /properties/tags/uniqueItems (remove or rewrite that part, or drop --strict)',
    ),
    (
        ["--check", "--schema", '{"$ref": "#"}'],
        "error: schema has a $ref cycle that never reaches a value at /$ref",
    ),
    (
        ["hi", "--schema", "/no/schema.json"],
        "error: cannot read schema file /no/schema.json: No such file or directory",
    ),
    (["hi", "--schema", SHORT, "--concurrency", "0"], "error: --concurrency must be >= 1, got 0"),
    (["hi", "--schema", SHORT, "--lanes", "0"], "error: --concurrency must be >= 1, got 0"),
    (["hi", "--schema", SHORT, "-n", "0"], "error: --max-tokens must be >= 1, got 0"),
    (
        ["hi", "--schema", SHORT, "--stop", "}"],
        "error: --stop does not apply to json: a reply ends with its JSON document",
    ),
    (
        ["hi", "--schema", SHORT, "--output", "{out}"],
        "error: --output goes with --input (a JSONL batch)",
    ),
    (
        ["--schema", SHORT, "--input", "{in}"],
        "error: --input needs --output FILE (the file a rerun resumes)",
    ),
    (
        ["hi", "--schema", SHORT, "--input", "{in}", "--output", "{out}"],
        "error: give prompts in the --input file or as an argument, not both",
    ),
    (
        ["--schema", SHORT, "--input", "{bad}", "--output", "{out}"],
        "error: {bad} line 2: not JSON: Expecting value at column 1",
    ),
    (
        ["hi", "--schema", SHORT, "--instructions", "@/no/instr.txt"],
        "error: cannot read instructions file /no/instr.txt: No such file or directory",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD)
def test_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    paths = {
        "in": tmp_path / "in.jsonl",
        "bad": tmp_path / "bad.jsonl",
        "out": tmp_path / "out.jsonl",
    }
    paths["in"].write_text('{"prompt": "a"}\n')
    paths["bad"].write_text('{"prompt": "a"}\nnope\n')
    paths["out"].write_text('{"line": 9, "output": "kept"}\n{"line": 10, "ou')
    before = paths["out"].read_bytes()
    result = runner.invoke(app, ["json", *(fill(a, paths) for a in args)])
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.strip() == fill(message, paths)
    assert paths["out"].read_bytes() == before  # untouched, torn line included


@pytest.mark.parametrize(
    ("lines", "out", "message"),
    [
        (
            '{"prompt": "{{x}}"}\n',
            "",
            'error: {in} line 1: no value for {{x}} (add it to "vars")',
        ),
        (
            '{"prompt": "a"}\n',
            "junk\n",
            "error: output file {out} line 1 is not a record of this command; fix or remove it, or write to another file",
        ),
    ],
)
def test_bad_batch_found_after_loading(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, lines: str, out: str, message: str
) -> None:
    paths = {"in": tmp_path / "in.jsonl", "out": tmp_path / "out.jsonl"}
    paths["in"].write_text(lines)
    paths["out"].write_text(out)
    args = ["json", "--schema", SHORT, "-m", str(tiny_gguf), "--input", str(paths["in"])]
    result = runner.invoke(app, [*args, "--output", str(paths["out"])])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == fill(message, paths)
    assert paths["out"].read_text() == out


def test_unwritable_output_is_one_line(cache_root: Path, tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "out.jsonl"
    args = ["json", "--schema", SHORT, "-m", str(tiny_gguf), "--input", str(tmp_path / "in.jsonl")]
    result = runner.invoke(app, [*args, "--output", str(out)])
    assert result.exit_code != 0 and result.stdout == ""
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert (tmp_path / "file").read_text() == "not a directory"


# -- lenient by default: what the grammar cannot enforce is checked after decoding ---------

TWINS = json.dumps(
    {"type": "array", "items": {"enum": ["a"]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}
)


def test_check_compiles_without_a_model() -> None:
    args = ["json", "--check", "--schema", TWINS, "-m", "/no/such/model"]
    plain = runner.invoke(app, args)
    assert plain.exit_code == 0, plain.stderr
    assert plain.stdout == "ok\n"
    assert (
        'checked after decoding, not while: Unimplemented keys: ["uniqueItems"] at /uniqueItems'
        in plain.stderr
    )
    as_json = runner.invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {
        "ok": True,
        "unenforced": ['Unimplemented keys: ["uniqueItems"] at /uniqueItems'],
    }
    strict = runner.invoke(app, [*args, "--strict"])
    assert strict.exit_code == 2 and strict.stdout == ""
    assert strict.stderr.startswith("error: schema uses what constrained decoding cannot enforce")


def test_output_breaking_an_unenforced_rule_fails_keeping_the_text(
    cache_root: Path, tiny_gguf: Path
) -> None:
    # The grammar can only write ["a", "a"]: uniqueItems, checked after, refuses it.
    args = ["json", "x", "--schema", TWINS, "-m", str(tiny_gguf), "-n", "12", "--no-cache"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert (doc["output"], doc["text"], doc["finish_reason"]) == (None, '["a", "a"]', "stop")
    rule = "uniqueItems at /: ['a', 'a'] has non-unique elements"
    assert doc["error"] == f"the reply does not satisfy the schema: {rule}"
    assert result.stderr.strip().endswith(f"error: the reply does not satisfy the schema: {rule}")

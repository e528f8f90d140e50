"""What the CLI reads is checked as it is read: environment values, schema size and number bounds, lone surrogates in messages, batch lines and sessions, damaged sessions and goldens, sampling values. Each is one `error:` line and exit 2, before any model loads where it can."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_run import refused, run, unloadable

from mlxcache import __version__
from mlxcache.modes import chat
from mlxcache.modes.schema import MAX_SCHEMA_OBJECTS
from mlxcache.sampling import SamplingParams

LONG_WAIT_S = 300
"""How long a test waits for what must happen at once (only reached when it fails)."""


def wide_schema(properties: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(properties)},
    }


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`unloadable.gguf` (`cli_run.unloadable`) in the working directory: each test shows
    its check comes before the model loads."""
    unloadable(tmp_path)
    monkeypatch.chdir(tmp_path)


SURROGATE = "weather \\ud800 in Paris?"  # as JSON text: an escape of half a UTF-16 pair


def save_session(cache: Path, name: str, **fields: Any) -> None:
    doc = {**chat.ChatSession(turns=[chat.Turn("hi", "there")]).to_json(), **fields}
    (cache / "sessions").mkdir(parents=True, exist_ok=True)
    (cache / "sessions" / f"{name}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("value", "args", "expected"),
    [
        ("abc", ["--version"], (0, f"mlxcache {__version__}\n", "")),
        (
            "0",
            ["generate", "hi", "-m", "unloadable.gguf"],
            (2, "", "error: MLXCACHE_BLOCK_SIZE must be a whole number >= 1, got '0'\n"),
        ),
    ],
)
def test_a_bad_block_size_variable_is_one_line(
    value: str, args: list[str], expected: tuple[int, str, str], tmp_path: Path
) -> None:
    # A new process: the value used to break the import of the command itself.
    env = {**os.environ, "MLXCACHE_BLOCK_SIZE": value, "MLXCACHE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "mlxcache_cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=LONG_WAIT_S,
    )
    assert (done.returncode, done.stdout, done.stderr) == expected


def test_a_schema_past_the_size_bound_is_refused_at_once(tmp_path: Path) -> None:
    schema = tmp_path / "wide.json"
    schema.write_text(json.dumps(wide_schema(MAX_SCHEMA_OBJECTS + 100)))
    assert run("json", "--check", "--schema", str(schema)) == refused(
        "schema is too large: more than 2,000 JSON objects (split or simplify it)"
    )


def test_tools_share_one_size_bound(tmp_path: Path) -> None:
    each = wide_schema(MAX_SCHEMA_OBJECTS // 2)  # each one alone is within the bound
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": f"f{i}", "parameters": each} for i in range(3)]))
    assert run("tools", "--tools", str(tools), "hi", "-m", "unloadable.gguf") == refused(
        f"tools {tools} is too large: more than 2,000 JSON objects (split or simplify it)"
    )


@pytest.mark.parametrize(
    ("schema", "line"),
    [
        (
            '{"type": "array", "minItems": 100000000000000000000}',
            "schema has a number constrained decoding cannot read at /minItems (integers "
            "must fit in 64 bits, numbers must be finite)",
        ),
        (
            '{"type": "integer", "minimum": -9223372036854775809}',
            "schema has a number constrained decoding cannot read at /minimum (integers "
            "must fit in 64 bits, numbers must be finite)",
        ),
        (
            '{"const": ' + "9" * 5000 + "}",
            "schema is not JSON: an integer longer than 4300 digits at line 1 column 11",
        ),
    ],
)
def test_a_huge_number_in_a_schema_is_one_line(schema: str, line: str) -> None:
    assert run("json", "--check", "--schema", schema) == refused(line)


def test_a_lone_surrogate_in_messages_is_refused(tmp_path: Path, tiny_gguf: Path) -> None:
    messages = tmp_path / "messages.json"
    text = '[{"role": "user", "content": "' + SURROGATE + '"}]'
    messages.write_text(text)
    tools = tmp_path / "tools.json"
    tools.write_text('[{"name": "f", "parameters": {"type": "object", "properties": {}}}]')
    got = run("tools", "--tools", str(tools), "--messages", str(messages), "-m", str(tiny_gguf))
    assert got == refused(
        f"messages file {messages} is not JSON: a lone surrogate in a string (not valid "
        f"text) at line 1 column {text.index(chr(92)) + 1}"
    )


def test_a_lone_surrogate_in_a_batch_line_is_refused(tmp_path: Path, tiny_gguf: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "fine"}\n{"prompt": "' + SURROGATE + '"}\n')
    out = tmp_path / "out.jsonl"
    got = run("json", "--input", str(lines), "-o", str(out), "-m", str(tiny_gguf))
    assert got == refused(
        f"{lines} line 2: not JSON: a lone surrogate in a string (not valid text) at column "
        f"{lines.read_text().splitlines()[1].index(chr(92)) + 1}"
    )
    assert not out.exists()


def test_a_lone_surrogate_in_a_session_is_refused(tmp_path: Path, tiny_gguf: Path) -> None:
    saved = chat.ChatSession(turns=[chat.Turn("PLACEHOLDER", "fine")]).to_json()
    text = json.dumps(saved).replace("PLACEHOLDER", SURROGATE)
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "s.json").write_text(text)
    got = run("chat", "--resume", "s", "--cache-dir", str(tmp_path), "-m", str(tiny_gguf))
    at = text.index("\\ud800") + 1
    assert got == refused(
        f"cannot read session 's': a lone surrogate in a string (not valid text): line 1 "
        f"column {at} (char {at - 1})"
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"sampling": {"seed": 1.5}}, "seed must be an integer, got 1.5"),
        ({"sampling": {"temperature": "hot"}}, "temperature must be a number, got 'hot'"),
        ({"generations": "3"}, "'generations' has the wrong type (str): '3'"),
        ({"turns": [{"user": "hi", "reply": 7}]}, "'reply' has the wrong type (int): 7"),
        ({"stop": [""]}, "'stop' must be a list of non-empty strings"),
    ],
)
def test_a_damaged_session_is_one_line_before_the_model_loads(
    fields: dict[str, Any], reason: str, tmp_path: Path
) -> None:
    save_session(tmp_path, "s", **fields)
    got = run("chat", "--resume", "s", "--cache-dir", str(tmp_path), "-m", "unloadable.gguf")
    assert got == refused(f"session 's': not a saved chat session: {reason}")


def test_a_damaged_golden_is_refused_before_any_model_loads(tmp_path: Path) -> None:
    suite = tmp_path / "suite.yaml"
    # A model that does not exist: reaching it would be a different error.
    suite.write_text("cases:\n  - {name: p, kind: plain, prompt: hi, model: missing.gguf}\n")
    golden = tmp_path / "golden.json"
    golden.write_text(
        json.dumps(
            {"format": "mlxcache-golden-v1", "versions": "x", "cases": {"p": {"outputs": []}}}
        )
    )
    assert run("regress", "check", str(suite), str(golden)) == refused(
        f"{golden}: 'versions' must be an object of version strings"
    )


def test_sampling_settings_are_type_checked() -> None:
    with pytest.raises(ValueError, match=r"^seed must be an integer, got 1\.5$"):
        SamplingParams(seed=1.5)
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer, got True$"):
        SamplingParams(max_tokens=True)

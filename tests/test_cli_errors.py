"""Fault injection over every command: each bad input is one `error:` line, nothing else.

Every row of the table runs one command through Typer's CliRunner and must end with the
documented exit code (2: the request is wrong as given; 1: the environment failed), exactly
one stderr line starting with `error:`, nothing on stdout and no exception escaping. Most
rows fail before a model loads; the rest use the tiny model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxcache_cli.main import app

runner = CliRunner()
DEEP = 1800  # levels: far past Python's recursion limit for a recursive reader
BAD_UTF8 = b"Hello \xff\xfe world"
ARGV_BAD_UTF8 = "Hello \udcff world"  # how Python hands over undecodable argv bytes


@dataclass(frozen=True)
class Case:
    args: list[str]
    stdin: bytes | None = None
    code: int = 2
    needle: str = ""
    """Text the error line must contain (the part that tells the user what is wrong)."""


def deep_json() -> str:
    return "[" * DEEP + "]" * DEEP


def deep_schema() -> str:
    schema: dict = {"type": "string"}
    for _ in range(900):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Bad (and a few good) input files, by name."""
    d = tmp_path_factory.mktemp("bad-inputs")
    good_tools = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]
    contents: dict[str, str | bytes] = {
        "deep.json": deep_json(),
        "deep_schema.json": deep_schema(),
        "deep.yaml": "cases: " + deep_json(),
        "deep_block.yaml": "cases:\n" + "".join("  " * i + "- \n" for i in range(600)),
        "cycle.yaml": "cases: &a [*a]\n",
        "bomb.yaml": "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        + "".join(
            f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=True)
        )
        + "cases: *i\n",
        "deep.jsonl": deep_json() + "\n",
        "deep_line.jsonl": '{"prompt": "x"}\n{"prompt": "y", "vars": {"v": ' + deep_json() + "}}\n",
        "not_json.jsonl": "{nope\n",
        "invalid.json": "{nope",
        "not_schema.json": '{"type": "strin"}',
        "tools.json": json.dumps(good_tools),
        "deep_messages.json": json.dumps([{"role": "user", "content": "x"}])[:-1]
        + ", "
        + deep_json()
        + "]",
        "bad_utf8.txt": BAD_UTF8,
        "empty.txt": "",
        "garbage.gguf": b"this is not a GGUF file",
        "regular_file": "a file where a directory should be",
        "suite.yaml": "cases:\n  - {name: p, kind: plain, prompt: hi}\n",
        "invalid.yaml": "cases: [unclosed\n",
        "in.jsonl": '{"prompt": "x"}\n',
    }
    for name, text in contents.items():
        path = d / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    (d / "no_config").mkdir()
    # A cache directory with a damaged index and saved sessions that are not sessions.
    cache = d / "cache"
    (cache / "kv").mkdir(parents=True)
    (cache / "kv" / "index.sqlite").write_bytes(b"garbage" * 1000)
    (cache / "sessions").mkdir()
    (cache / "sessions" / "deep.json").write_text(deep_json())
    (cache / "sessions" / "garbage.json").write_bytes(BAD_UTF8)
    named = {name: d / name for name in contents}
    return {**named, "dir": d, "missing": d / "missing", "cache": cache}


def cases(f: dict[str, Path], tiny: str) -> dict[str, Case]:
    """The table: (command, fault) -> Case."""
    m = ["-m", tiny]
    out: dict[str, Case] = {}
    prompt_commands = {
        "generate": ["generate"],
        "json": ["json", "--schema", '{"type": "string"}'],
        "tools": ["tools", "--tools", str(f["tools.json"])],
    }
    run_commands = {**prompt_commands, "chat": ["chat"]}
    for name, cmd in run_commands.items():
        prompt = [] if name == "chat" else ["hi"]
        for fault, extra, needle in [
            ("temp-nan", ["--temp", "nan"], "finite"),
            ("temp-inf", ["--temp", "inf"], "finite"),
            ("temp-negative", ["--temp", "-1"], "--temp"),
            ("top-p-nan", ["--top-p", "nan"], "top"),
            ("top-p-zero", ["--top-p", "0"], "top"),
            ("max-tokens-zero", ["-n", "0"], "--max-tokens"),
            ("max-tokens-text", ["-n", "abc"], "--max-tokens"),
            ("seed-negative", ["--seed", "-1"], "seed"),
            ("block-size-zero", ["--block-size", "0"], "block"),
            ("cache-mem-text", ["--cache-mem", "lots"], "lots"),
            ("cache-disk-negative", ["--cache-disk", "-5"], "-5"),
            ("cache-dir-file", ["--cache-dir", str(f["regular_file"])], "not a directory"),
            ("cache-dir-under-file", ["--cache-dir", str(f["regular_file"] / "x")], "a file"),
            ("model-missing", ["-m", str(f["missing"]) + ".gguf"], "not found"),
            ("model-garbage", ["-m", str(f["garbage.gguf"])], "GGUF"),
            ("model-dir-no-config", ["-m", str(f["dir"] / "no_config")], "config.json"),
            ("unknown-option", ["--frobnicate"], "--frobnicate"),
        ]:
            model = [] if "-m" in extra else m
            out[f"{name}/{fault}"] = Case([*cmd, *prompt, *model, *extra], needle=needle)
        out[f"{name}/stdin-invalid-utf8"] = Case(
            [*cmd, *([] if name == "chat" else ["-"]), *m, "-n", "2"], BAD_UTF8, needle="UTF-8"
        )
        if name == "json":
            continue  # json takes --instructions instead of --system
        out[f"{name}/system-invalid-utf8"] = Case(
            [*cmd, *prompt, *m, "--system", ARGV_BAD_UTF8], needle="UTF-8"
        )
        out[f"{name}/system-file-missing"] = Case(
            [*cmd, *prompt, *m, "--system", "@" + str(f["missing"])], needle="missing"
        )
    for name, cmd in prompt_commands.items():
        for fault, extra, needle in [
            ("argv-invalid-utf8", [ARGV_BAD_UTF8], "UTF-8"),
            ("prompt-empty", [""], "empty"),
            ("prompt-blank", ["  \n"], "empty"),
            ("prompt-and-file", ["hi", "-f", str(f["tools.json"])], "not both"),
            ("prompt-file-missing", ["-f", str(f["missing"])], "missing"),
            ("prompt-file-invalid-utf8", ["-f", str(f["bad_utf8.txt"])], "bad_utf8"),
            ("prompt-file-directory", ["-f", str(f["dir"])], str(f["dir"])),
            ("prompt-file-empty", ["-f", str(f["empty.txt"])], "empty"),
        ]:
            out[f"{name}/{fault}"] = Case([*cmd, *m, *extra], needle=needle)
        out[f"{name}/stdin-empty"] = Case([*cmd, "-", *m], b"", needle="empty")
    j = ["json", *m]
    for fault, extra, needle in [
        ("schema-deep-inline", ["hi", "--schema", deep_json()], "nested deeper"),
        ("schema-deep-file", ["hi", "--schema", str(f["deep_schema.json"])], "nested deeper"),
        ("schema-invalid-json", ["hi", "--schema", str(f["invalid.json"])], "not JSON"),
        ("schema-file-missing", ["hi", "--schema", str(f["missing"])], "missing"),
        ("schema-not-a-schema", ["hi", "--schema", str(f["not_schema.json"])], "strin"),
        ("schema-invalid-utf8", ["hi", "--schema", str(f["bad_utf8.txt"])], "bad_utf8"),
        ("input-deep-line", ["--input", str(f["deep_line.jsonl"]), "-o", "o.jsonl"], "line 2"),
        ("input-not-json", ["--input", str(f["not_json.jsonl"]), "-o", "o.jsonl"], "not JSON"),
        ("input-missing", ["--input", str(f["missing"]), "-o", "o.jsonl"], "missing"),
        ("input-invalid-utf8", ["--input", str(f["bad_utf8.txt"]), "-o", "o.jsonl"], "bad_utf8"),
        ("input-without-output", ["--input", str(f["in.jsonl"])], "--output"),
        ("output-without-input", ["hi", "-o", "o.jsonl"], "--input"),
        (
            "output-dir-missing",
            ["--input", str(f["in.jsonl"]), "-o", str(f["missing"] / "o.jsonl")],
            "does not exist",
        ),
        (
            "concurrency-zero",
            ["--input", str(f["in.jsonl"]), "-o", "o.jsonl", "--concurrency", "0"],
            "--concurrency",
        ),
        ("instructions-missing", ["hi", "--instructions", "@" + str(f["missing"])], "missing"),
    ]:
        schema = [] if fault.startswith("schema") else ["--schema", '{"type": "string"}']
        out[f"json/{fault}"] = Case([*j, *schema, *extra], needle=needle)
    t = ["tools", *m]
    for fault, extra, needle in [
        ("tools-missing-option", ["hi"], "--tools"),
        ("tools-deep", ["hi", "--tools", str(f["deep.json"])], "nested deeper"),
        ("tools-invalid-json", ["hi", "--tools", str(f["invalid.json"])], "not JSON"),
        ("tools-file-missing", ["hi", "--tools", str(f["missing"])], "missing"),
        ("tools-not-tools", ["hi", "--tools", str(f["not_schema.json"])], "tools"),
        ("messages-deep", ["--messages", str(f["deep_messages.json"])], "nested deeper"),
        ("messages-missing", ["--messages", str(f["missing"])], "missing"),
        ("tool-choice-unknown", ["hi", "--tool-choice", "nope"], "nope"),
    ]:
        tools = [] if fault.startswith("tools") else ["--tools", str(f["tools.json"])]
        out[f"tools/{fault}"] = Case([*t, *tools, *extra], needle=needle)
    out["chat/resume-missing-session"] = Case(["chat", *m, "--resume", "nope"], b"", needle="nope")
    out["chat/resume-bad-name"] = Case(["chat", *m, "--resume", "../x"], b"", needle="../x")
    for session in ("deep", "garbage"):
        out[f"chat/resume-{session}-session"] = Case(
            ["chat", *m, "--cache-dir", str(f["cache"]), "--resume", session], b"", needle=session
        )
    for verb in ("record", "check"):
        golden = ["-o", str(f["dir"] / "g.json")] if verb == "record" else [str(f["deep.json"])]
        for fault, suite, needle in [
            ("suite-deep-yaml", "deep.yaml", "nested deeper"),
            ("suite-deep-block-yaml", "deep_block.yaml", "nested deeper"),
            ("suite-deep-jsonl", "deep.jsonl", "nested deeper"),
            ("suite-self-referring-yaml", "cycle.yaml", "nested deeper"),
            ("suite-alias-bomb", "bomb.yaml", "aliases"),
            ("suite-invalid-yaml", "invalid.yaml", "invalid.yaml"),
            ("suite-missing", "missing", "missing"),
            ("suite-invalid-utf8", "bad_utf8.txt", "bad_utf8"),
        ]:
            out[f"regress-{verb}/{fault}"] = Case(
                ["regress", verb, str(f[suite]), *golden], needle=needle
            )
    out["regress-check/golden-deep"] = Case(
        ["regress", "check", str(f["suite.yaml"]), str(f["deep.json"])], needle="nested deeper"
    )
    out["regress-check/golden-missing"] = Case(
        ["regress", "check", str(f["suite.yaml"]), str(f["missing"])], needle="missing"
    )
    out["regress-check/variants-unknown"] = Case(
        ["regress", "check", str(f["suite.yaml"]), str(f["deep.json"]), "--variants", "hot"],
        needle="hot",
    )
    for verb in ("stats", "ls", "clear"):
        out[f"cache-{verb}/cache-dir-file"] = Case(
            ["cache", verb, "--cache-dir", str(f["regular_file"])], needle="not a directory"
        )
    for verb in (["stats"], ["ls"], ["prune", "--max-size", "1"]):
        # The environment failed, not the request: exit 1, and the line says how to recover.
        out[f"cache-{verb[0]}/damaged-index"] = Case(
            ["cache", *verb, "--cache-dir", str(f["cache"])], code=1, needle="cache clear"
        )
    out["cache-prune/size-text"] = Case(["cache", "prune", "--max-size", "lots"], needle="lots")
    out["cache-prune/size-missing"] = Case(["cache", "prune"], needle="--max-size")
    out["cache/unknown-verb"] = Case(["cache", "frob"], needle="frob")
    out["models-info/missing"] = Case(["models", "info", "-m", str(f["missing"])], needle="missing")
    out["models-info/garbage-gguf"] = Case(
        ["models", "info", "-m", str(f["garbage.gguf"])], needle="GGUF"
    )
    out["models-ls/cache-dir-file"] = Case(
        ["models", "ls", "--cache-dir", str(f["regular_file"])], needle="not a directory"
    )
    for bench, extra in [
        ("decode", ["--tokens", "0"]),
        ("decode", ["--rounds", "0"]),
        ("resume", ["--block-size", "0"]),
        ("json", ["--lines", "0"]),
        ("index", ["--runs", "0"]),
    ]:
        out[f"bench-{bench}/{extra[0][2:]}-zero"] = Case(["bench", bench, *extra], needle=extra[0])
    out["bench-decode/model-missing"] = Case(
        ["bench", "decode", "-m", str(f["missing"]) + ".gguf"], needle="not found"
    )
    out["top/unknown-command"] = Case(["frobnicate"], needle="frobnicate")
    return out


class _Placeholders(dict[str, Path]):
    """File names standing in for the real files while the table's keys are collected."""

    def __missing__(self, name: str) -> Path:
        return Path(name)


KEYS = sorted(cases(_Placeholders(), "tiny.gguf"))


@pytest.mark.parametrize("key", KEYS)
def test_bad_input_is_one_error_line(
    key: str,
    files: dict[str, Path],
    tiny_gguf: Path,
    cache_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = cases(files, str(tiny_gguf))[key]
    monkeypatch.chdir(tmp_path)  # relative outputs (-o o.jsonl) land in the test's own dir
    result = runner.invoke(app, case.args, input=case.stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    lines = result.stderr.splitlines()
    assert (result.exit_code, result.stdout) == (case.code, ""), result.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert case.needle in lines[0] and "Traceback" not in result.stderr


def test_the_sweep_covers_every_command() -> None:
    commands = {key.split("/")[0].split("-")[0] for key in KEYS}
    assert commands == {
        "generate",
        "chat",
        "json",
        "tools",
        "regress",
        "cache",
        "models",
        "bench",
        "top",
    }
    assert len(KEYS) >= 150

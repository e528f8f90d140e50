"""`mlxcache regress`: record then check, tampered goldens, model-key changes, variants."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from mlxcache.errors import UserInputError
from mlxcache.regress import golden, suite
from mlxcache.regress.golden import first_difference
from mlxcache.regress.runner import LocalRunner
from mlxcache_cli.main import app
from mlxcache_cli.regress_cmd import _describe

pytestmark = pytest.mark.slow  # suites under every variant, one in a new process

runner = CliRunner()
EXAMPLES = Path(__file__).parent.parent / "examples"


def tiny_suite(tmp_path: Path, tiny_gguf: Path) -> Path:
    doc = {
        "model": str(tiny_gguf),
        "defaults": {"temperature": 0, "max_tokens": 5},
        "cases": [
            {"name": "plain", "kind": "plain", "prompt": "abc abc abc abc"},
            {"name": "talk", "kind": "chat", "turns": ["hello", "again"], "repeat_last": True},
            {
                "name": "sampled",
                "kind": "plain",
                "prompt": "abc abc xyz",
                "temperature": 1.0,
                "seed": 4,
            },
            {
                "name": "two-json",
                "kind": "json",
                "schema": {"type": "string", "maxLength": 3},
                "prompts": ["abc abc q", "abc abc r"],
            },
        ],
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def regress(*args: str) -> object:
    return runner.invoke(app, ["regress", *args, "--block-size", "4"])


def test_record_then_check_passes_and_every_variant_resumes(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    path = tiny_suite(tmp_path, tiny_gguf)
    out = tmp_path / "golden.json"
    rec = regress("record", str(path), "-o", str(out))
    assert rec.exit_code == 0, rec.stderr  # type: ignore[attr-defined]
    doc = json.loads(out.read_text())
    assert list(doc["cases"]) == ["plain", "talk", "sampled", "two-json"]
    assert (
        len(doc["cases"]["talk"]["outputs"]) == 3 and len(doc["cases"]["two-json"]["outputs"]) == 2
    )
    talk = doc["cases"]["talk"]["outputs"]
    assert talk[2] == talk[1]  # turn repeated: same bytes
    assert set(doc["versions"]) == {"mlxcache", "mlx", "mlx_lm"}
    check = regress("check", str(path), str(out), "--json")
    assert check.exit_code == 0, check.stderr  # type: ignore[attr-defined]
    report = json.loads(check.stdout)  # type: ignore[attr-defined]
    assert report["ok"] and all(c["status"] == "ok" for c in report["cases"].values())
    variants = report["variants"]
    assert variants["cold"] == {"hits": 0, "cached_tokens": 0, "disk_hits": 0}  # no cache at all
    assert variants["warm"]["cached_tokens"] > 0  # later requests resumed from earlier ones
    assert variants["disk"]["disk_hits"] > 0  # a new process resumed from the disk tier
    assert variants["lanes"]["hits"] > 0


def test_tampered_golden_fails_with_the_first_difference(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    path = tiny_suite(tmp_path, tiny_gguf)
    out = tmp_path / "golden.json"
    assert regress("record", str(path), "-o", str(out), "--variants", "cold").exit_code == 0  # type: ignore[attr-defined]
    doc = json.loads(out.read_text())
    first = doc["cases"]["plain"]["outputs"][0]
    first["tokens"][2] += 1
    first["text"] = first["text"][:2] + "#" + first["text"][3:]
    doc["cases"]["talk"]["model_key"] = "0" * 32
    out.write_text(json.dumps(doc))
    check = regress("check", str(path), str(out), "--variants", "cold,lanes")
    assert check.exit_code == 1  # type: ignore[attr-defined]
    lines = check.stdout.splitlines()  # type: ignore[attr-defined]
    assert lines[0] == "mismatch               plain"
    assert lines[1].startswith(
        f"    golden vs run: output 0, first different token #2 ({first['tokens'][2]} -> "
    )
    assert "ok                     talk" in lines
    assert f"model key changed for 'talk': {'0' * 32} -> " in check.stderr  # type: ignore[attr-defined]
    last = check.stderr.strip().splitlines()[-1]  # type: ignore[attr-defined]
    assert last.startswith("4 cases under 2 variants: 3 passed, 1 failed (")
    # --case runs only the named cases; an unknown name is one line naming the cases.
    only = regress("check", str(path), str(out), "--variants", "cold", "--case", "talk")
    assert only.exit_code == 0, only.stderr  # type: ignore[attr-defined]
    assert only.stdout.splitlines()[0] == "ok                     talk"  # type: ignore[attr-defined]
    assert "1 case under 1 variant: 1 passed, 0 failed" in only.stderr  # type: ignore[attr-defined]
    assert only.stdout.splitlines()[1].startswith("1 case under 1 variant: 1 passed, 0 failed")  # type: ignore[attr-defined]
    unknown = regress("check", str(path), str(out), "--case", "nope")
    assert unknown.exit_code == 2  # type: ignore[attr-defined]
    assert "no case 'nope' in" in unknown.stderr and "(its cases: plain, talk" in unknown.stderr  # type: ignore[attr-defined]


def test_variant_disagreement_is_reported_as_a_bug(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    class Skewed(LocalRunner):
        """A lanes variant that drifts by one token, as a broken schedule would."""

        def run(self, variant: str) -> dict:
            out = super().run(variant)
            if variant == "lanes":
                first = out["plain"][0]
                out["plain"][0] = {
                    **first,
                    "tokens": [*first["tokens"][:-1], first["tokens"][-1] + 1],
                }
            return out

    cases = suite.load(tiny_suite(tmp_path, tiny_gguf))
    out = tmp_path / "golden.json"
    report = golden.record(Skewed(cases, tmp_path / "work", 4), out, ("cold", "lanes"))
    assert not report.ok and not out.exists()
    entry = report.cases["plain"]
    assert entry["status"] == "variant-disagreement"
    diff = entry["disagreements"]["cold vs lanes"]
    assert diff["output"] == 0 and diff["actual_token"] == diff["expected_token"] + 1
    assert report.notes == [
        "execution variants disagree: this is a bug in mlxcache, not in the model"
    ]
    assert all(report.cases[n]["status"] == "ok" for n in ("talk", "sampled", "two-json"))


def test_bad_suites_and_goldens(cache_root: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("cases:\n  - {name: a, kind: poem, prompt: x}\n")
    result = regress("check", str(bad), str(tmp_path / "g.json"))
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert (
        result.stderr
        == "error: case 'a': kind must be one of plain, chat, json, tools, got 'poem'\n"
    )  # type: ignore[attr-defined]
    with pytest.raises(UserInputError, match="case names must be unique"):
        suite.parse({"cases": [{"name": "a", "kind": "plain", "prompt": "x"}] * 2})
    with pytest.raises(UserInputError, match="case 'a': max_tokens must be >= 1"):
        suite.parse({"cases": [{"name": "a", "kind": "plain", "prompt": "x", "max_tokens": 0}]})
    good = tmp_path / "good.yaml"
    good.write_text("cases:\n  - {name: a, kind: plain, prompt: x}\n")
    (tmp_path / "g.json").write_text("{}")
    result = regress("check", str(good), str(tmp_path / "g.json"))
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert result.stderr.startswith("error: ") and "is not a golden file" in result.stderr  # type: ignore[attr-defined]
    result = regress("record", str(good), "-o", str(tmp_path / "x.json"), "--variants", "hot")
    assert (
        result.stderr
        == "error: unknown variant hot: choose from cold, warm, disk, lanes, drafted\n"
    )  # type: ignore[attr-defined]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.model
def test_smoke_suite_matches_its_golden(cache_root: Path) -> None:
    """CI's regression run: the shipped smoke suite, every variant, against the committed golden."""
    check = regress_default(
        "check", str(EXAMPLES / "smoke.yaml"), str(EXAMPLES / "smoke.golden.json")
    )
    assert check.exit_code == 0, check.stdout + check.stderr  # type: ignore[attr-defined]


def regress_default(*args: str) -> object:
    return runner.invoke(app, ["regress", *args])


def test_more_bad_input(cache_root: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("cases:\n  - {name: a, kind: plain, prompt: x}\n")
    result = regress("check", str(good), str(tmp_path / "g.json"), "--variants", "cold,disk")
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert (
        result.stderr
        == "error: the disk variant reads the cache the warm variant fills: list warm before disk\n"
    )  # type: ignore[attr-defined]
    (tmp_path / "g.json").write_text(
        json.dumps({"format": golden.FORMAT, "cases": {"a": {"outputs": [{"text": 1}]}}})
    )
    result = regress("check", str(good), str(tmp_path / "g.json"))
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert "case 'a' has no valid 'outputs'" in result.stderr  # type: ignore[attr-defined]
    bad_schema = {
        "cases": [{"name": "j", "kind": "json", "schema": {"type": "nope"}, "prompt": "x"}]
    }
    with pytest.raises(UserInputError, match="case 'j' schema is not valid JSON Schema"):
        suite.parse(bad_schema)
    with pytest.raises(UserInputError, match="case 'j': needs 'prompt' or a non-empty 'prompts'"):
        suite.parse(
            {"cases": [{"name": "j", "kind": "json", "schema": {"type": "string"}, "prompts": []}]}
        )
    with pytest.raises(UserInputError, match="unknown tool 'nope'"):
        suite.parse(
            {
                "cases": [
                    {
                        "name": "t",
                        "kind": "tools",
                        "prompt": "x",
                        "tool_choice": "nope",
                        "tools": [{"name": "f", "parameters": {"type": "object"}}],
                    }
                ]
            }
        )


def test_size_options_are_checked(cache_root: Path) -> None:
    for args, message in [
        (
            ["regress", "check", "s.yaml", "g.json", "--block-size", "0"],
            "error: --block-size must be >= 1, got 0\n",
        ),
        (["bench", "decode", "--rounds", "0"], "error: --rounds must be >= 1, got 0\n"),
        (["bench", "index", "--slots", "0"], "error: --slots must be >= 1, got 0\n"),
    ]:
        result = runner.invoke(app, args)
        assert (result.exit_code, result.stdout, result.stderr) == (2, "", message)


def _out(tokens: list[int], text: str = "ab", finish: str = "stop") -> dict[str, Any]:
    return {"text": text, "tokens": tokens, "finish_reason": finish}


def test_regress_progress_reaches_a_pipe_and_the_disk_variant_reports_its_cases(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    doc = {
        "model": str(tiny_gguf),
        "defaults": {"max_tokens": 2},
        "cases": [{"name": "one", "kind": "plain", "prompt": "abc abc abc"}],
    }
    (tmp_path / "suite.yaml").write_text(yaml.safe_dump(doc))
    args = ["regress", "record", str(tmp_path / "suite.yaml"), "-o", str(tmp_path / "g.json")]
    result = runner.invoke(app, [*args, "--variants", "cold,warm,disk", "--block-size", "4"])
    assert result.exit_code == 0, result.stderr
    timed = r"\(\d+\.\ds\)|\(\d+\.\d+ s\)"
    lines = [re.sub(timed, "(T)", line) for line in result.stderr.splitlines()]
    progress = [
        line
        for v in ("cold", "warm", "disk")  # disk: the new process's cases, relayed
        for line in (f"{v} ...", f"{v}: one ...", f"{v}: one done (T)", f"{v} done (T)")
    ]
    assert lines == [*progress, f"recorded 1 case to {tmp_path / 'g.json'} (T)"]
    quiet = runner.invoke(app, [*args, "--variants", "cold", "--block-size", "4", "-q", "--force"])
    assert re.sub(timed, "(T)", quiet.stderr) == f"recorded 1 case to {tmp_path / 'g.json'} (T)\n"


def test_a_difference_says_what_differs() -> None:
    same_tokens = first_difference([_out([1, 2])], [_out([1, 2], finish="length")])
    assert same_tokens is not None and same_tokens["token"] is None
    assert _describe("golden vs run", same_tokens).splitlines()[0] == (
        "    golden vs run: output 0, same tokens, different finish reason"
    )
    text = first_difference([_out([1, 2], "ab")], [_out([1, 2], "aX")])
    assert text is not None
    assert _describe("g", text).splitlines()[0] == "    g: output 0, same tokens, different text"
    longer = first_difference([_out([1, 2])], [_out([1, 2, 3], "abc")])
    assert longer is not None
    assert _describe("g", longer).splitlines()[0] == (
        "    g: output 0, first different token #2 (end -> 3)"
    )
    changed = first_difference([_out([1, 2])], [_out([1, 5])])
    assert changed is not None
    assert _describe("g", changed).splitlines()[0] == (
        "    g: output 0, first different token #1 (2 -> 5)"
    )


def test_the_drafted_variant_measures_this_device_once(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drafted variant's verify probe is recorded in the user's cache directory (not
    the run's scratch one), so a second run reads it instead of measuring again."""
    from mlxcache import invariance

    monkeypatch.setenv("MLXCACHE_CACHE_DIR", str(tmp_path / "cache"))
    measured: list[int] = []
    width = invariance.verify_width

    def counted(*args: Any, **kwargs: Any) -> Any:
        measured.append(1)
        return width(*args, **kwargs)

    monkeypatch.setattr(invariance, "verify_width", counted)
    cases = suite.load(tiny_suite(tmp_path, tiny_gguf))
    for run in range(2):
        work = tmp_path / f"work{run}"
        work.mkdir()
        LocalRunner(cases, work, block_size=4).run("drafted")
        assert len(measured) == 1, run  # measured by the first run alone
    assert (tmp_path / "cache" / invariance.PROBES).is_file()

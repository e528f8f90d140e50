"""What users of `llm`, Ollama and mlx-lm expect of the CLI (issue 54): piped stdin joined
with an argument prompt, -q printing the reply alone, probes saying what they measure as
they go, drafting that cannot pay said once, regress goldens that record their settings."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml
from cli_run import run
from typer.testing import CliRunner

from mlxcache import invariance
from mlxcache.config import DraftConfig
from mlxcache.drafting import Drafting, choose
from mlxcache.events import Probing
from mlxcache.invariance import PROBES, VERIFY_WIDTHS
from mlxcache.model import LoadedModel
from mlxcache.regress import golden, suite
from mlxcache.regress.golden import first_difference
from mlxcache.regress.suite import Output
from mlxcache.sampling import SamplingParams
from mlxcache_cli import ui
from mlxcache_cli.main import app
from mlxcache_cli.regress_cmd import _show as show


def _generate(tiny_gguf: Path, tmp_path: Path, *args: str, stdin: str | None) -> dict[str, object]:
    code, out, err = run(
        "generate", "--raw", "--json", "-n", "1", "-m", str(tiny_gguf), "--no-cache",
        "--cache-dir", str(tmp_path), *args, stdin=stdin,
    )  # fmt: skip
    assert code == 0, err
    doc: dict[str, object] = json.loads(out)
    return doc


def test_piped_stdin_comes_before_the_argument_prompt(tiny_gguf: Path, tmp_path: Path) -> None:
    """`cat notes.txt | mlxcache generate "Summarize:"` prompts with the notes, a space, then
    the argument: the same prompt as the joined text given whole on stdin."""
    both = _generate(tiny_gguf, tmp_path, "Summarize:", stdin="notes line\n")
    whole = _generate(tiny_gguf, tmp_path, "-", stdin="notes line\n Summarize:")
    alone = _generate(tiny_gguf, tmp_path, "Summarize:", stdin=None)
    blank = _generate(tiny_gguf, tmp_path, "Summarize:", stdin=" \n")  # adds nothing
    stats = [d["stats"] for d in (both, whole, alone, blank)]
    assert [s["prompt_tokens"] for s in stats] == [  # type: ignore[index]
        len(b"notes line\n Summarize:"),
        len(b"notes line\n Summarize:"),
        len(b"Summarize:"),
        len(b"Summarize:"),
    ]
    assert both["tokens"] == whole["tokens"]


def test_quiet_prints_the_reply_alone(tiny_gguf: Path, tmp_path: Path) -> None:
    """-q: the reply on stdout, nothing on stderr (no stats line, no note on the token
    limit the reply ran into); the same reply as without it."""
    args = [
        "generate",
        "--raw",
        "abc",
        "-n",
        "3",
        "-m",
        str(tiny_gguf),
        "--cache-dir",
        str(tmp_path),
    ]
    code, out, err = run(*args)
    assert code == 0 and "prompt tokens cached" in err and "token limit" in err
    assert run(*args, "-q") == (0, out, "")
    code, doc, err = run(*args, "-q", "--json")
    assert (code, err) == (0, "") and json.loads(doc)["tokens"]


def test_quiet_batch_prints_nothing_but_writes_every_line(tiny_gguf: Path, tmp_path: Path) -> None:
    """json --input -q: no progress bar, no summary line; the output file as without -q."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    args = ["json", "--schema", '{"type": "string", "maxLength": 6}', "-m", str(tiny_gguf)]
    args += ["--input", str(tmp_path / "in.jsonl"), "--cache-dir", str(tmp_path)]
    code, out, err = run(*args, "-o", str(tmp_path / "loud.jsonl"))
    assert (code, out) == (0, "") and "2 lines run, 0 already in" in err
    assert run(*args, "-o", str(tmp_path / "quiet.jsonl"), "-q") == (0, "", "")
    outputs = [
        [json.loads(line)["output"] for line in (tmp_path / f).read_text().splitlines()]
        for f in ("loud.jsonl", "quiet.jsonl")
    ]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 2


def test_drafting_that_cannot_pay_here_is_said_once(tiny: LoadedModel, tmp_path: Path) -> None:
    """Asked for (--draft lookup) where this device's measured verify costs make a drafted
    token dearer than a plain one: it drafts, as asked, and says so once."""
    said: list[str] = []
    config = DraftConfig(mode="lookup")
    assert Drafting(tiny, config, 4, tmp_path).plan() is not None  # measured and recorded
    records = json.loads((tmp_path / PROBES).read_text())
    for slow, costs in ((True, {w: float(w) for w in VERIFY_WIDTHS}), (False, CHEAP)):
        recorded = {
            k: {**v, "verify_costs": {str(w): c for w, c in costs.items()}}
            for k, v in records.items()
        }
        (tmp_path / PROBES).write_text(json.dumps(recorded))
        drafting = Drafting(tiny, config, 4, tmp_path, on_warning=said.append)
        assert drafting.plan() is not None and drafting.plan() is not None
        width = drafting.verify().width
        ratio = choose(costs, width)[2]
        assert said == (
            [
                f"drafting cannot pay on this device: its measured verify forwards make lookup "
                f"drafting ~{ratio:.2f}x plain decoding's time per token (--draft auto leaves "
                "it off where so)"
            ]
            if slow
            else []
        ), ratio
        said.clear()


CHEAP = {w: 1.0 + 0.01 * w for w in VERIFY_WIDTHS}
"""Verify forwards as cheap as one row: drafting pays."""


def test_a_probe_tells_what_it_measures_step_by_step(tiny: LoadedModel, tmp_path: Path) -> None:
    """The one-time probes say what they measure and why, each step as it ends (with the
    time spent), and their end once; a recorded answer is read, not measured: nothing told."""
    told: list[Probing] = []
    invariance.probe(tiny, 4, tmp_path, told.append)
    invariance.verify_probe(tiny, 4, tmp_path, told.append)
    invariance.probe(tiny, 4, tmp_path, told.append)
    steps = [(e.what, e.model, e.done, e.total) for e in told]
    exact, verify = "what this device computes exactly", "how exactly this device verifies drafts"
    assert steps == [
        *((exact, tiny.name, done, 2) for done in (0, 1, 2)),
        *((verify, tiny.name, done, 5) for done in (0, 1, 2, 3, 4, 5)),
    ]
    elapsed = [e.elapsed_s for e in told]
    assert elapsed[:3] == sorted(elapsed[:3]) and elapsed[3:] == sorted(elapsed[3:])
    assert told[0].why.startswith("decode steps against prefill chunks")
    assert told[3].why.startswith("forwards of 2, 3, 5, 9 rows against one-row decode steps")
    assert [e.finished for e in told] == [False, False, True, *[False] * 5, True]


def test_probe_notes_on_stderr_start_and_end_in_one_line_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    notes = ui.ProbeNotes()
    for done, elapsed in ((0, 0.0), (1, 40.0), (2, 95.5)):
        notes(Probing("what this device computes exactly", "why", "m", done, 2, elapsed))
    assert capsys.readouterr().err.splitlines() == [
        "measuring what this device computes exactly for m (once): why",
        "measured what this device computes exactly for m in 95.5 s",
    ]


# -- regress ------------------------------------------------------------------------------


def _suite(tmp_path: Path, temperature: float) -> Path:
    doc = {
        "model": "m",
        "defaults": {"max_tokens": 3},
        "cases": [
            {"name": "edited", "kind": "plain", "prompt": "p", "temperature": temperature},
            {"name": "same", "kind": "plain", "prompt": "q"},
        ],
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


class _Runner:
    """Runs a suite without a model: every case replies `reply`."""

    def __init__(self, path: Path, reply: Output) -> None:
        self.suite = suite.load(path)
        self.cache_stats: dict[str, dict[str, int]] = {}
        self.reply = reply

    def run(self, variant: str) -> dict[str, list[Output]]:
        return {c.name: [dict(self.reply)] for c in self.suite.cases}

    def models(self) -> dict[str, str]:
        return {c.name: "key" for c in self.suite.cases}

    def versions(self) -> dict[str, str]:
        return {"mlxcache": "1"}

    def adapters(self) -> dict[str, dict[str, str] | None]:
        return {c.name: None for c in self.suite.cases}


def test_a_golden_records_each_cases_settings_and_check_names_a_changed_one(
    tmp_path: Path,
) -> None:
    """Temperature 0 -> 0.7 in the suite: the case fails as settings-changed, the setting
    named before the token difference it explains; the unedited case passes."""
    reply = {"text": "a b c", "tokens": [1, 2, 3], "finish_reason": "length"}
    out = tmp_path / "g.json"
    assert golden.record(_Runner(_suite(tmp_path, 0.0), reply), out, ("cold",)).ok
    recorded = json.loads(out.read_text())["cases"]["edited"]["sampling"]
    assert recorded == {**dataclasses.asdict(SamplingParams(max_tokens=3)), "temperature": 0.0}
    other = {"text": "a x c", "tokens": [1, 9, 3], "finish_reason": "length"}
    report = golden.check(_Runner(_suite(tmp_path, 0.7), other), out, ("cold",))
    edited, same = report.cases["edited"], report.cases["same"]
    assert edited["status"] == "settings-changed" and same["status"] == "mismatch"
    assert edited["settings_changed"] == {"temperature": {"golden": 0.0, "now": 0.7}}
    assert "settings_changed" not in same


def test_check_prints_the_setting_before_the_difference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reply = {"text": "a b c", "tokens": [1, 2, 3], "finish_reason": "length"}
    out = tmp_path / "g.json"
    golden.record(_Runner(_suite(tmp_path, 0.0), reply), out, ("cold",))
    other = {"text": "a x c", "tokens": [1, 9, 3], "finish_reason": "length"}
    report = golden.check(_Runner(_suite(tmp_path, 0.7), other), out, ("cold",))
    with pytest.raises(typer.Exit):
        show(report, False)
    assert capsys.readouterr().out.splitlines() == [
        "settings-changed       edited",
        "    temperature changed: 0.0 in the golden, 0.7 in the suite (record it again)",
        "    golden vs run: output 0, first different token #1 (2 -> 9)",
        "      expected: 'a b c' [length]",
        "      actual:   'a x c' [length]",
        "mismatch               same",
        "    golden vs run: output 0, first different token #1 (2 -> 9)",
        "      expected: 'a b c' [length]",
        "      actual:   'a x c' [length]",
    ]


def test_a_clipped_excerpt_is_marked_where_it_is_cut() -> None:
    long = "x" * 50 + "A" + "y" * 50
    other = "x" * 50 + "B" + "y" * 50
    diff = first_difference(
        [{"text": long, "tokens": [1], "finish_reason": "stop"}],
        [{"text": other, "tokens": [2], "finish_reason": "stop"}],
    )
    assert diff is not None
    assert diff["expected_text"] == "…" + "x" * 30 + "A" + "y" * 29 + "…"
    assert diff["actual_text"] == "…" + "x" * 30 + "B" + "y" * 29 + "…"
    short = first_difference(
        [{"text": "abc", "tokens": [1], "finish_reason": "stop"}],
        [{"text": "abd", "tokens": [2], "finish_reason": "stop"}],
    )
    assert short is not None and (short["expected_text"], short["actual_text"]) == ("abc", "abd")


def test_record_refuses_to_overwrite_a_golden_without_force(tmp_path: Path) -> None:
    """Before any model loads: the golden is left as it was."""
    path = _suite(tmp_path, 0.0)
    out = tmp_path / "g.json"
    out.write_text("{}")
    assert run("regress", "record", str(path), "-o", str(out)) == (
        2,
        "",
        f"error: {out} exists: --force overwrites it, or write a new file with -o\n",
    )
    assert out.read_text() == "{}"


# -- cache clear ----------------------------------------------------------------------------


def _converted(cache: Path) -> Path:
    """A converted model's folder as `models ls` lists it (8 bytes of weights)."""
    folder = cache / "models" / "some-model-0123456789abcdef-v2"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"12345678")
    return folder


def test_cache_clear_keeps_converted_models_unless_asked(tmp_path: Path) -> None:
    folder = _converted(tmp_path)
    kept = run("cache", "clear", "--cache-dir", str(tmp_path))
    assert kept == (0, f"removed 0 entries ({ui.human_bytes(0)} freed)\n", "")
    assert folder.is_dir()
    code, out, err = run("cache", "clear", "--models", "--cache-dir", str(tmp_path), "--json")
    assert (code, json.loads(out), err) == (
        0,
        {"removed": 0, "bytes_freed": 0, "models_removed": 1, "models_bytes_freed": 10},
        "",
    )
    assert not folder.exists()


def test_cache_clear_asks_on_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a terminal it asks (no: nothing deleted, exit 0); --yes does not ask; without a
    terminal nothing is asked (as above)."""
    monkeypatch.setattr(ui, "stdin_is_terminal", lambda: True)
    folder = _converted(tmp_path)
    question = (
        f"Delete every cached prompt in {tmp_path / 'kv'} and every converted model in "
        f"{tmp_path / 'models'}? [y/N]:"  # then the answer
    )
    code, out, err = run("cache", "clear", "--models", "--cache-dir", str(tmp_path), stdin="n\n")
    assert (code, err) == (0, f"{question}nothing deleted\n") and folder.is_dir()
    code, out, err = run("cache", "clear", "--models", "--cache-dir", str(tmp_path), stdin="y\n")
    assert (code, err) == (0, question) and not folder.exists()
    assert out.endswith(f"removed 1 converted model ({ui.human_bytes(10)} freed)\n")
    folder = _converted(tmp_path)
    assert run("cache", "clear", "--models", "-y", "--cache-dir", str(tmp_path))[2] == ""
    assert not folder.exists()


# -- help ---------------------------------------------------------------------------------


def _commands() -> list[list[str]]:
    """Every command's path ([] is the top level)."""
    import typer.main

    paths: list[list[str]] = []

    def walk(command: Any, path: list[str]) -> None:
        paths.append(path)
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return paths


def _help(path: list[str]) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.stdout


def test_help_names_values_alike_in_every_command() -> None:
    """Values by a metavar in capitals (N, SIZE, FILE), never a type (<str>, <int>); a
    required argument bare in the usage line (not {SUITE}); no help text cut by markup
    (a bracketed default read as a style: "follows .")."""
    seen = []
    for path in _commands():
        text = _help(path)
        usage = next(line for line in text.splitlines() if "Usage:" in line)
        seen.append(len(text))
        assert not re.findall(r"<(?:str|int|float|path|bool)>", text), (path, text)
        assert "{" not in usage and not re.search(r"\[[a-z]+\]", usage), (path, usage)
        prose = [line for line in text.splitlines() if not line.strip().startswith("mlxcache")]
        assert not [line for line in prose if re.search(r"[a-z] \.(?:\s|$)", line)], path
    assert len(seen) > 30


def test_help_says_how_stdin_and_a_prompt_join() -> None:
    for command in ("generate", "json", "tools"):
        flat = " ".join(_help([command]).replace("│", " ").split())
        assert "Piped stdin and PROMPT together make one" in flat, command
        assert "stdin, a space, then PROMPT" in flat, command
    assert "Usage: mlxcache regress check [OPTIONS] SUITE GOLDEN" in _help(["regress", "check"])
    assert "Usage: mlxcache tools [OPTIONS] [PROMPT]" in _help(["tools"])


def test_quiet_hides_a_conversions_progress(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GGUF converted on first use: its progress on stderr (one line per stage in a log),
    nothing with -q."""
    from mlxcache import runtime
    from mlxcache.config import CacheConfig
    from mlxcache_cli import options

    def open_engine(spec: str, config: CacheConfig, **kwargs: Any) -> str:
        progress = kwargs["progress"]
        for done in range(0, 301, 100):
            if progress is not None:
                progress("weights", done, 300)
        return spec

    monkeypatch.setattr(runtime, "open_engine", open_engine)
    assert options.engine("m.gguf", CacheConfig(), quiet=True) == "m.gguf"  # type: ignore[comparison-overlap]
    assert capsys.readouterr().err == ""
    options.engine("m.gguf", CacheConfig())
    assert capsys.readouterr().err == "converting the model (once): weights, 300 steps...\n"


def test_a_setting_added_since_a_golden_ran_at_its_default(tmp_path: Path) -> None:
    """A golden recorded before a sampling setting existed ran at that setting's default:
    it is not a changed setting (every old golden would fail otherwise)."""
    reply = {"text": "a b c", "tokens": [1, 2, 3], "finish_reason": "length"}
    out = tmp_path / "g.json"
    golden.record(_Runner(_suite(tmp_path, 0.0), reply), out, ("cold",))
    doc = json.loads(out.read_text())
    for case in doc["cases"].values():
        del case["sampling"]["min_p"]  # as if min_p came later
    out.write_text(json.dumps(doc))
    report = golden.check(_Runner(_suite(tmp_path, 0.0), reply), out, ("cold",))
    assert {c["status"] for c in report.cases.values()} == {"ok"}

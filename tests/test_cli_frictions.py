"""What users of `llm`, Ollama and mlx-lm expect of the CLI (issue 54): piped stdin joined
with an argument prompt, ..."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_run import run

from mlxcache import invariance
from mlxcache.config import DraftConfig
from mlxcache.drafting import Drafting, choose
from mlxcache.events import Probing
from mlxcache.invariance import PROBES, VERIFY_WIDTHS
from mlxcache.model import LoadedModel
from mlxcache_cli import ui


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
    stats = [d["stats"] for d in (both, whole, alone)]
    assert [s["prompt_tokens"] for s in stats] == [  # type: ignore[index]
        len(b"notes line\n Summarize:"),
        len(b"notes line\n Summarize:"),
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

"""What users of `llm`, Ollama and mlx-lm expect of the CLI (issue 54): piped stdin joined
with an argument prompt, ..."""

from __future__ import annotations

import json
from pathlib import Path

from cli_run import run


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

"""A JSONL batch's output file: one run writes it at a time, a rerun adds nothing, and a run that fails before writing leaves no file."""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

from cli_run import run


def test_a_second_batch_on_one_output_is_refused_and_nothing_is_written_twice(
    tmp_path: Path, tiny_gguf: Path, cache_root: Path
) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    out = tmp_path / "out.jsonl"
    batch = ["json", "--schema", '{"type": "boolean"}', "--input", str(lines), "-o", str(out)]
    batch += ["-m", str(tiny_gguf), "-n", "8", "--cache-disk", "0"]
    with out.open("ab") as running:  # another run is appending to the file
        fcntl.flock(running, fcntl.LOCK_EX)
        assert run(*batch) == (
            1,
            "",
            f"error: output file {out} is being written by another run; wait for it to end, "
            "or write to another file\n",
        )
    assert out.read_bytes() == b""
    code, _, err = run(*batch)
    assert code == 0, err
    written = out.read_bytes()
    assert [json.loads(x)["line"] for x in written.splitlines()] == [1, 2]
    assert run(*batch)[0] == 0 and out.read_bytes() == written  # a rerun adds nothing


def test_a_batch_that_fails_before_writing_leaves_no_output(tmp_path: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "a"}\n')
    out = tmp_path / "out.jsonl"
    code, _, _ = run("json", "--input", str(lines), "-o", str(out), "-m", "missing.gguf")
    assert code == 2 and not out.exists()

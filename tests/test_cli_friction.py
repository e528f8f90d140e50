"""Issue 22's everyday friction, each fixed and checked: what the cache saved, Ctrl-C in a
prefill, --stop escapes, /retry at temperature 0, Markdown and Ctrl-C, regress progress and
diffs, models rm / default, cache ls / clear, sessions in the data directory, the tools
length note."""

from __future__ import annotations

import json
import os
import pty
import re
import termios
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from mlxcache.config import CacheConfig
from mlxcache.events import Prefill, Stats, Token
from mlxcache.model import LoadedModel
from mlxcache.modes import chat
from mlxcache.regress.golden import first_difference
from mlxcache.runtime import make_cache
from mlxcache_cli import options as o
from mlxcache_cli import ui
from mlxcache_cli.main import app
from mlxcache_cli.regress_cmd import _describe

runner = CliRunner()


def _stats(**values: Any) -> dict[str, Any]:
    base = Stats(prompt_tokens=37, generated_tokens=7, decode_s=0.6).as_dict()
    return {**base, **values}


# -- the stats line says where the prefix came from and what it saved ---------------------


def test_stats_line_names_the_tier_and_the_time_saved(capsys: pytest.CaptureFixture[str]) -> None:
    # 5 tokens prefilled in 0.5 s (TTFT less restore): 0.1 s a token; 32 cached save 3.2 s,
    # less the 0.04 s their restore took.
    hit = _stats(cached_tokens=32, prefilled_tokens=5, restore_s=0.04, ttft_s=0.54)
    ui.stats_line({**hit, "cached_from": "disk"})
    miss = _stats(prefilled_tokens=37, ttft_s=3.7, miss_reason="no cached prefix")
    ui.stats_line(miss)
    assert capsys.readouterr().err.splitlines() == [
        "32/37 prompt tokens cached (disk), 5 prefilled · saved ~3.2 s · TTFT 0.54s · "
        "7 tokens at 10.0 tok/s",
        "0/37 prompt tokens cached (no cached prefix), 37 prefilled · TTFT 3.70s · "
        "7 tokens at 10.0 tok/s",
    ]


def test_a_session_measures_its_prefill_speed_across_turns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A retry prefills nothing: the speed measured on the first turn prices its prefix."""
    rate = ui.PrefillRate()
    ui.stats_line(_stats(prefilled_tokens=37, ttft_s=3.7, miss_reason="no cached prefix"), rate)
    again = _stats(cached_tokens=37, restore_s=0.01, ttft_s=0.02, cached_from="memory")
    ui.stats_line(again, rate)
    ui.stats_line(again)  # no speed measured in this run: no estimate
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].startswith("37/37 prompt tokens cached (memory), 0 prefilled · saved ~3.7 s")
    assert lines[2].startswith("37/37 prompt tokens cached (memory), 0 prefilled · TTFT 0.02s")


def test_stats_tell_memory_from_disk(tiny: LoadedModel, tmp_path: Path) -> None:
    """The cache says which tier a prefix came from: none, memory, then disk (a new cache
    on the same directory, as a new process)."""
    from mlxcache.engine import Engine, Request
    from mlxcache.sampling import SamplingParams

    config = CacheConfig(block_size=4, directory=tmp_path)
    ids, params = list(range(5, 15)), SamplingParams(max_tokens=2)
    first = Engine(tiny, make_cache(tiny, config))
    assert first.complete(Request(ids, params)).stats.cached_from == ""
    assert first.complete(Request(ids, params)).stats.cached_from == "memory"
    reopened = Engine(tiny, make_cache(tiny, config))
    assert reopened.complete(Request(ids, params)).stats.cached_from == "disk"


def test_generate_says_disk_and_saved_in_a_new_process(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    args = ["generate", "--raw", "abcdefghijklmnopqrst", "-m", str(tiny_gguf), "-n", "2"]
    args += ["--block-size", "4", "--cache-dir", str(tmp_path)]
    assert runner.invoke(app, args).exit_code == 0
    again = runner.invoke(app, [*args, "--json"])
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["stats"]["cached_from"] == "disk"
    assert re.match(
        r"16/\d+ prompt tokens cached \(disk\), \d+ prefilled · saved ~\d+\.\d+ s · TTFT ",
        again.stderr,
    )


# -- Ctrl-C in a prefill says what the cache kept -------------------------------------------


class _Bar:
    replying = False


def test_keep_note_on_an_interrupted_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    bar = _Bar()
    with pytest.raises(KeyboardInterrupt), o.keep_note(bar, 37, lambda: 32):
        raise KeyboardInterrupt
    bar.replying = True  # past the prefill: the whole prompt is kept, nothing to say
    with pytest.raises(KeyboardInterrupt), o.keep_note(bar, 37, lambda: 37):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt), o.keep_note(_Bar(), 37, lambda: 1 // 0):
        raise KeyboardInterrupt  # a failed lookup says nothing: the interrupt goes on
    assert capsys.readouterr().err == "prefill stopped: 32 of 37 prompt tokens kept for next time\n"


def test_ctrl_c_in_a_prefill_keeps_its_full_blocks(
    tiny: LoadedModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped after its second chunk, a 20-token prompt keeps 8 tokens; the note says so."""
    from mlxcache.engine import Engine, Request

    config = CacheConfig(block_size=4, directory=tmp_path, disk_bytes=0)
    engine = Engine(tiny, make_cache(tiny, config))
    ids = list(range(40, 60))
    events = engine.generate(Request(ids))
    with pytest.raises(KeyboardInterrupt), o.watch(engine, ids, True, events) as seen:
        for event in events:
            seen(event)
            if isinstance(event, Prefill) and event.done == 8:
                raise KeyboardInterrupt  # between two chunks, as a key press may land
    assert capsys.readouterr().err == "prefill stopped: 8 of 20 prompt tokens kept for next time\n"
    assert engine.cache.cached_length(np.asarray(ids)) == 8


# -- --stop escapes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("\\n\\n", "\n\n"),
        ("a\\tb\\r", "a\tb\r"),
        ("\\\\n", "\\n"),  # an escaped backslash, then a plain n
        ("C:\\x", "C:\\x"),  # other backslashes stay
        ("END", "END"),
    ],
)
def test_stop_reads_escapes(given: str, read: str) -> None:
    run = dataclass_run(stop=[given])
    assert run.stop_strings() == (read,)


def dataclass_run(**values: Any) -> o.RunOptions:
    fields = {name: default for name, _, default in o._RUN_OPTIONS}
    return o.RunOptions(**{**fields, **values})


def test_the_generate_help_example_of_stop_works() -> None:
    help_text = runner.invoke(app, ["generate", "--help"]).stdout
    assert '--stop "\\n\\n"' in help_text
    assert dataclass_run(stop=["\\n\\n"]).stop_strings() == ("\n\n",)


# -- chat: /retry at temperature 0, Markdown and Ctrl-C, sessions in the data directory -----


def _chat(tmp_path: Path, tiny_gguf: Path, stdin: str, *args: str) -> tuple[int, str, str]:
    extra = ["-m", str(tiny_gguf), "--cache-dir", str(tmp_path / "cache"), "--block-size", "4"]
    result = runner.invoke(app, ["chat", "-n", "2", *args, *extra], input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_retry_at_temperature_0_says_it_is_the_same_reply(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    code, out, err = _chat(tmp_path, tiny_gguf, "hi\n/retry\n/retry -t 0.7\n/retry -t x\n")
    assert code == 2  # the bad /retry
    notes = [line for line in err.splitlines() if "temperature" in line or "/retry" in line]
    assert notes == [
        "temperature 0 picks the most likely reply, the same each time: /retry -t 0.7 "
        "samples another",
        "temperature 0.0 -> 0.7 for this session",
        "error: usage: /retry or /retry -t TEMPERATURE",
    ]
    first, second, _third = out.splitlines()
    assert first == second  # greedy: the same reply, as said


def test_no_echo_while_a_reply_renders(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C's ^C, echoed after a full-width line, would push Rich's live display down a
    line and its last redraw would repeat the reply's first line: no echo meanwhile."""
    leader, follower = pty.openpty()
    try:
        echo = termios.ECHO | termios.ECHOCTL
        assert termios.tcgetattr(follower)[3] & echo == echo
        with ui.no_echo(follower):
            assert termios.tcgetattr(follower)[3] & echo == 0
        assert termios.tcgetattr(follower)[3] & echo == echo
        with ui.no_echo(leader + 1000):  # not a terminal: nothing to do
            pass
    finally:
        os.close(leader)
        os.close(follower)


def test_markdown_replies_render_without_echo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mlxcache_cli import chat_cmd

    seen: list[bool] = []
    leader, follower = pty.openpty()

    def events() -> Iterator[Token]:
        seen.append(termios.tcgetattr(follower)[3] & termios.ECHOCTL == 0)
        yield Token(0, 1, "# hi")

    class Backend:  # what Repl.reply asks of the backend
        def prompt_kept(self) -> str:
            return ""

    stdin = os.fdopen(os.dup(follower))
    try:
        monkeypatch.setattr("sys.stdin", stdin)
        repl = chat_cmd.Repl(Backend(), chat.ChatSession(), [tmp_path], markdown=True)
        repl.reply(events())
    finally:
        stdin.close()
        os.close(leader)
        os.close(follower)
    assert seen == [True]


def test_sessions_live_in_the_data_directory_and_old_ones_still_load(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, old = tmp_path / "data", tmp_path / "cache" / "sessions"
    monkeypatch.setenv("MLXCACHE_DATA_DIR", str(data))
    chat.save(chat.ChatSession(turns=[chat.Turn("from before", "yes")]), old, "before")
    code, out, _ = _chat(tmp_path, tiny_gguf, "", "--list")
    assert code == 0 and out.split()[:3] == ["before", "1", "turns"]
    stdin = "/save before\n/load before\n/save fresh\n/load nope\n"
    code, _, err = _chat(tmp_path, tiny_gguf, stdin)
    assert code == 2
    assert err.splitlines() == [
        "error: a session 'before' exists already: pick another name, or /load it",
        "session before: 1 turns",
        "  last: you> from before",
        "        yes",
        f"saved {data / 'sessions' / 'fresh.json'}",
        f"error: no saved session 'nope' in {data / 'sessions'} or {old}",
    ]
    assert chat.load(data / "sessions", "fresh").turns[0].user == "from before"
    assert sorted(p.name for p in old.iterdir()) == ["before.json"]  # never written


def test_data_dir_follows_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    from platformdirs import user_data_dir

    from mlxcache.paths import data_dir

    monkeypatch.delenv("MLXCACHE_DATA_DIR")
    assert data_dir() == Path(user_data_dir("mlxcache", appauthor=False))


# -- regress: progress on stderr, piped or not; differences that say what differs ---------


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
    lines = [re.sub(r"\(\d+\.\ds\)", "(T)", line) for line in result.stderr.splitlines()]
    progress = [
        line
        for v in ("cold", "warm", "disk")  # disk: the new process's cases, relayed
        for line in (f"{v} ...", f"{v}: one ...", f"{v}: one done (T)", f"{v} done (T)")
    ]
    assert lines == [*progress, f"recorded 1 cases to {tmp_path / 'g.json'}"]
    quiet = runner.invoke(app, [*args, "--variants", "cold", "--block-size", "4", "-q"])
    assert quiet.stderr == f"recorded 1 cases to {tmp_path / 'g.json'}\n"


def _out(tokens: list[int], text: str = "ab", finish: str = "stop") -> dict[str, Any]:
    return {"text": text, "tokens": tokens, "finish_reason": finish}


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


# -- models: ls, rm, default ----------------------------------------------------------------


def _models(*args: str) -> Any:
    return runner.invoke(app, ["models", *args])


def test_models_ls_rm_and_default(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = ["--cache-dir", str(tmp_path)]
    assert _models("info", "-m", str(tiny_gguf), *d).exit_code == 0  # converts it
    (row,) = json.loads(_models("ls", "--json", *d).stdout)
    assert row["gguf"] == str(tiny_gguf) and row["current"] and row["name"].startswith("tiny-")
    listing = _models("ls", *d).stdout.splitlines()
    assert row["name"] in listing[3] and str(tiny_gguf) in listing[3]  # names are never cut
    assert listing[-1].startswith("1 converted, ") and listing[-1].endswith(
        " · default model: smollm2-135m"
    )
    # The default model: used without -m, kept by its absolute path.
    assert _models("default").stdout == "smollm2-135m\n"
    monkeypatch.chdir(tiny_gguf.parent)
    chosen = _models("default", tiny_gguf.name)
    assert chosen.stdout == f"default model: {tiny_gguf}\n"
    info = _models("info", "--json", *d)
    assert json.loads(info.stdout)["name"] == "tiny.gguf"
    assert _models("default", "--reset").stdout == "default model: smollm2-135m\n"
    bad = _models("default", str(tmp_path / "none.gguf"))
    assert (bad.exit_code, bad.stderr) == (
        2,
        f"error: model file not found: {tmp_path / 'none.gguf'}\n",
    )
    # rm by name, then by the GGUF file (all of its conversions).
    removed = _models("rm", row["name"], *d)
    assert removed.stdout == f"removed {row['name']} ({ui.human_bytes(row['bytes'])})\n"
    assert not Path(row["folder"]).exists()
    missing = _models("rm", row["name"], *d)
    assert (missing.exit_code, missing.stderr) == (
        2,
        f"error: no converted model {row['name']!r} in {tmp_path / 'models'} "
        "(names: mlxcache models ls)\n",
    )
    assert _models("info", "-m", str(tiny_gguf), *d).exit_code == 0
    assert json.loads(_models("rm", str(tiny_gguf), "--json", *d).stdout)[0]["name"] == row["name"]
    assert json.loads(_models("ls", "--json", *d).stdout) == []


# -- cache ls and clear ---------------------------------------------------------------------


def test_cache_ls_explains_its_sizes_and_clear_says_what_it_freed(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    d = ["--cache-dir", str(tmp_path)]
    base = ["generate", "--raw", "-m", str(tiny_gguf), "-n", "2", "--block-size", "4", *d]
    for text in ("abcdefghijklmnop", "abcdefghijklmnopqrstuvwx"):  # share 3 blocks
        assert runner.invoke(app, [*base, text]).exit_code == 0
    stats = json.loads(runner.invoke(app, ["cache", "stats", "--json", *d]).stdout)
    rows = json.loads(runner.invoke(app, ["cache", "ls", "--json", *d]).stdout)
    assert sum(r["bytes"] for r in rows) > stats["bytes"]  # shared blocks count twice
    listing = runner.invoke(app, ["cache", "ls", *d]).stdout.splitlines()
    header = [cell.strip() for cell in listing[1].strip("┃").split("┃")]
    assert header == ["model", "block", "tokens", "size", "used", "prompt ends with"]  # no id
    assert listing[-1] == (
        f"2 entries, {ui.human_bytes(stats['bytes'])} on disk (an entry's size counts every "
        "block it resumes; entries that share a prefix share its blocks)"
    )
    cleared = runner.invoke(app, ["cache", "clear", *d])
    assert cleared.stdout == f"removed 2 entries ({ui.human_bytes(stats['bytes'])} freed)\n"


# -- tools: the token limit note ------------------------------------------------------------


def test_a_tools_text_reply_cut_at_the_limit_says_so(
    cache_root: Path, wide_gguf: Path, tmp_path: Path
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f"}}]))
    args = ["tools", "--tools", str(tools), "--tool-choice", "none", "-n", "2", "hi"]
    result = runner.invoke(app, [*args, "-m", str(wide_gguf), "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[-1] == "stopped at the token limit (2 tokens; -n for more)"

"""`mlxcache chat` sessions from the command line (tiny model, piped stdin)."""

from __future__ import annotations

import json
import os
import pty
import re
import termios
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine
from mlxcache.events import Token
from mlxcache.model import LoadedModel
from mlxcache.modes import chat
from mlxcache.sampling import SamplingParams
from mlxcache_cli import ui
from mlxcache_cli.main import app

runner = CliRunner()


def invoke(tmp_path: Path, tiny_gguf: Path, *args: str, stdin: str = "") -> tuple[int, str, str]:
    extra = ["-m", str(tiny_gguf), "--cache-dir", str(tmp_path), "--cache-disk", "0"]
    result = runner.invoke(app, ["chat", *args, *extra], input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_list_sessions(tmp_path: Path, tiny_gguf: Path) -> None:
    code, out, _ = invoke(tmp_path, tiny_gguf, "--list")
    assert (code, out) == (0, f"no saved sessions in {tmp_path / 'sessions'}\n")
    chat.save(
        chat.ChatSession(turns=[chat.Turn("the first  question", "a")]),
        tmp_path / "sessions",
        "one",
    )
    (tmp_path / "sessions" / "junk.json").write_text("{}")  # not a session: not listed
    code, out, _ = invoke(tmp_path, tiny_gguf, "--list")
    assert code == 0 and out.split() == [
        "one",
        "1",
        "turns",
        "0s",
        "ago",
        "the",
        "first",
        "question",
    ]


def test_resume_shows_the_session_and_applies_given_options(
    cache_root: Path, tmp_path: Path, tiny_gguf: Path
) -> None:
    saved = chat.ChatSession(
        system="be brief",
        turns=[chat.Turn("hello", "world")],
        sampling=SamplingParams(max_tokens=2, temperature=0.5, seed=4),
    )
    chat.save(saved, tmp_path / "sessions", "s")
    code, out, err = invoke(
        tmp_path, tiny_gguf, "--resume", "s", "-n", "3", "--seed", "4", "--top-k", "5",
        "--frequency-penalty", "1.5", stdin="/stats --json\n",
    )  # fmt: skip
    assert code == 0, err
    assert err.splitlines() == [
        "session s: 1 turns, system: be brief",
        "  last: you> hello",
        "        world",
        # --seed 4 is no change; -t not given; every request setting is a session's
        "changed: max_tokens 2 -> 3, top_k 0 -> 5, frequency_penalty 0.0 -> 1.5",
    ]
    stats = json.loads(out)
    assert stats["sampling"] == {
        **json.loads((tmp_path / "sessions" / "s.json").read_text())["sampling"],
        "max_tokens": 3,
        "top_k": 5,
        "frequency_penalty": 1.5,
    }
    assert stats["session"] == "s" and stats["turns"] == 1


def test_repl_commands_confirm(cache_root: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    stdin = "/system Answer in French.\n/system\n/history\nhello\n/history\n/save mine\n/sessions\n/stats\n"
    # No warm-ahead: its entry, kept in idle time, would race /stats' count.
    args = ["-n", "2", "--block-size", "4", "--no-warm-ahead"]
    code, out, err = invoke(tmp_path, tiny_gguf, *args, stdin=stdin)
    assert code == 0, err
    lines = err.splitlines()
    assert lines[:3] == [
        "system message set (17 characters), used from the next reply",
        "system message cleared",
        "no turns yet",
    ]
    assert "stopped at the token limit (2 tokens; -n for more)" in lines  # after the reply
    reply = out.removesuffix("\n")
    rest = lines[lines.index("1 you> hello") :]  # after the reply's stats line
    assert rest[1] == f"  {' '.join(reply.split())}"
    assert rest[2] == f"saved {tmp_path / 'sessions' / 'mine.json'}"
    assert rest[3].split()[:3] == ["mine", "1", "turns"]
    assert rest[4] == f"session mine · 1 turns · model {rest[4].split('model ')[1]}"
    assert rest[5].startswith("sampling: temp 0.0 · top-p 1.0 · top-k 0 ")
    cache = r"cache: \d+ hits, \d+ misses · \d+ prompt tokens reused · memory 1 entry, "
    assert re.fullmatch(cache + r"[\d.]+ KiB · disk 0 entries, 0 B · blocks of 4 tokens", rest[6])


def test_a_turn_stopped_before_its_first_token_is_not_kept(tiny: LoadedModel) -> None:
    engine = Engine(
        tiny, PromptCache(tiny.model, tiny.key, CacheConfig(block_size=4, disk_bytes=0))
    )
    s = chat.ChatSession(sampling=SamplingParams(max_tokens=5))
    events = s.ask(engine, "hello")
    first = next(events)
    assert not isinstance(first, Token)
    events.close()  # type: ignore[attr-defined]
    assert s.turns == []
    events = s.ask(engine, "hello")
    assert isinstance(next(e for e in events if isinstance(e, Token)), Token)
    events.close()  # type: ignore[attr-defined]
    assert [(t.user, t.interrupted) for t in s.turns] == [("hello", True)]


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

"""Chat sessions (library, tiny model) and `mlxcache chat` transcripts (piped stdin)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine
from mlxcache.errors import UserInputError
from mlxcache.events import Token
from mlxcache.model import LoadedModel
from mlxcache.modes import chat
from mlxcache.sampling import SamplingParams
from mlxcache_cli.main import app

runner = CliRunner()


@pytest.fixture
def engine(tiny: LoadedModel) -> Engine:
    config = CacheConfig(block_size=4, disk_bytes=0)
    return Engine(tiny, PromptCache(tiny.model, tiny.key, config))


def drain(events: object) -> None:
    for _ in events:  # type: ignore[attr-defined]
        pass


def test_turns_retry_edit_undo(engine: Engine) -> None:
    s = chat.ChatSession(sampling=SamplingParams(max_tokens=3))
    drain(s.ask(engine, "hello"))
    drain(s.ask(engine, "more"))
    assert [t.user for t in s.turns] == ["hello", "more"]
    first_reply = s.turns[1].reply
    drain(s.retry(engine))
    assert [t.user for t in s.turns] == ["hello", "more"] and s.turns[1].reply == first_reply
    drain(s.edit(engine, 1, "changed"))
    assert [t.user for t in s.turns] == ["changed"]
    assert s.undo().user == "changed" and s.turns == []
    with pytest.raises(UserInputError, match="nothing to undo"):
        s.undo()
    with pytest.raises(UserInputError, match="no turn 3: the conversation has 0 turns"):
        drain(s.edit(engine, 3, "x"))
    assert s.messages() == []


def test_sampled_retry_gets_a_new_seed(engine: Engine) -> None:
    s = chat.ChatSession(sampling=SamplingParams(temperature=1.5, seed=1, max_tokens=8))
    drain(s.ask(engine, "hello"))
    replies = {s.turns[0].reply}
    for _ in range(3):
        drain(s.retry(engine))
        replies.add(s.turns[0].reply)
    assert len(replies) > 1 and s.generations == 4


def test_interrupted_reply_is_kept_and_pin_released(engine: Engine) -> None:
    s = chat.ChatSession(sampling=SamplingParams(max_tokens=20))
    drain(s.ask(engine, "hello there"))
    events = s.ask(engine, "and again")
    tokens = 0
    for event in events:
        tokens += isinstance(event, Token)
        if tokens == 2:
            break
    events.close()  # type: ignore[attr-defined]
    assert s.turns[-1].interrupted and s.turns[-1].user == "and again"
    report = engine.cache.report()
    assert (report["pinned_entries"], report["open_leases"]) == (0, 0)
    assert engine.lanes() == []


def test_save_load_round_trip_and_bad_files(tmp_path: Path) -> None:
    s = chat.ChatSession(
        system="be brief", turns=[chat.Turn("a", "b"), chat.Turn("c", "d", True)], generations=2
    )
    chat.save(s, tmp_path, "mine")
    assert [p.name for p in tmp_path.iterdir()] == ["mine.json"]  # no temp file left
    assert chat.load(tmp_path, "mine") == s
    with pytest.raises(UserInputError, match=r"bad session name '\.\./x'"):
        chat.save(s, tmp_path, "../x")
    with pytest.raises(UserInputError, match="no saved session 'nope'"):
        chat.load(tmp_path, "nope")
    (tmp_path / "broken.json").write_text('{"format": "mlxcache-chat-v1", "turns": 3}')
    with pytest.raises(UserInputError, match="not a saved chat session"):
        chat.load(tmp_path, "broken")


def invoke(args: list[str], stdin: str, cache: Path, model: str | None = None) -> object:
    extra = ["-m", model] if model else []
    return runner.invoke(app, ["chat", *args, *extra, "--cache-dir", str(cache)], input=stdin)


@pytest.mark.model
def test_transcript_resume_and_retry(cache_root: Path, tmp_path: Path) -> None:
    stdin = "What is the capital of France?\n/save trip\n/retry\n"
    # The default block (16 on CPU); no warm-ahead, whose progress depends on timing here.
    result = invoke(["-n", "12", "--no-warm-ahead"], stdin, tmp_path)
    assert result.exit_code == 0, result.stderr  # type: ignore[attr-defined]
    reply = "The capital of France is Paris.\n"
    assert result.stdout == reply * 2  # type: ignore[attr-defined]
    # A fresh --cache-dir converts the model and measures the device first: each says so
    # once, in a line before these.
    lines = [
        x
        for x in result.stderr.splitlines()  # type: ignore[attr-defined]
        if "(once)" not in x and not x.startswith("measured ")  # a probe's start and end
    ]
    assert lines[0].startswith("0/37 prompt tokens cached (no cached prefix), 37 prefilled")
    assert lines[1].startswith("saved ")
    # The retry sends the same prompt again: it resumes whole, nothing to prefill; at
    # temperature 0 the reply is the same, and the retry says so first.
    assert lines[2].startswith("temperature 0 picks the most likely reply, the same each time")
    assert lines[3].startswith("37/37 prompt tokens cached (memory), 0 prefilled · saved ~")
    # A new process reopens the session; its next turn resumes from the disk tier.
    again = invoke(["--resume", "trip"], "And of Spain?\n", tmp_path)
    assert again.exit_code == 0, again.stderr  # type: ignore[attr-defined]
    assert again.stdout == "The capital of Spain is Madrid.\n"  # type: ignore[attr-defined]
    assert again.stderr.splitlines()[:3] == [  # type: ignore[attr-defined]
        "session trip: 1 turns",
        "  last: you> What is the capital of France?",
        "        The capital of France is Paris.",
    ]
    assert again.stderr.splitlines()[3].startswith("32/59 prompt tokens cached")  # type: ignore[attr-defined]
    saved = json.loads((tmp_path / "sessions" / "trip.json").read_text())
    assert [t["user"] for t in saved["turns"]] == [
        "What is the capital of France?",
        "And of Spain?",
    ]


def test_bad_commands_exit_2_and_keep_the_session(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    stdin = "/bogus\n/edit 9 hi\n/undo\n/load nope\n/save ok\n"
    result = invoke(["-n", "2", "--block-size", "4"], stdin, tmp_path, str(tiny_gguf))
    assert result.exit_code == 2 and result.stdout == ""  # type: ignore[attr-defined]
    assert result.stderr.splitlines()[:4] == [  # type: ignore[attr-defined]
        "error: unknown command /bogus (try /help)",
        "error: no turn 9: the conversation has 0 turns",
        "error: nothing to undo: the conversation is empty",
        f"error: no saved session 'nope' in {tmp_path / 'sessions'}",
    ]
    before = (tmp_path / "sessions" / "ok.json").read_bytes()
    (tmp_path / "sessions" / "bad.json").write_text("{not json")
    bad = invoke(["--resume", "bad"], "hi\n", tmp_path, str(tiny_gguf))
    assert bad.exit_code == 2 and bad.stdout == ""  # type: ignore[attr-defined]
    assert bad.stderr.startswith("error: cannot read session 'bad'")  # type: ignore[attr-defined]
    assert (tmp_path / "sessions" / "ok.json").read_bytes() == before
    assert (tmp_path / "sessions" / "bad.json").read_text() == "{not json"


def test_a_failed_retry_or_edit_keeps_the_conversation(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlxcache.errors import ContextLengthError

    s = chat.ChatSession(sampling=SamplingParams(max_tokens=3))
    drain(s.ask(engine, "hello"))
    drain(s.ask(engine, "again"))
    before = [chat.Turn(t.user, t.reply, t.interrupted) for t in s.turns]

    def full(ids: object, where: str = "the prompt") -> None:
        raise ContextLengthError(f"{where} has 999 tokens; the model's context is 256")

    monkeypatch.setattr(engine.encoder, "check_fits", full)
    with pytest.raises(ContextLengthError):
        drain(s.retry(engine))
    with pytest.raises(ContextLengthError):
        drain(s.edit(engine, 1, "changed"))
    with pytest.raises(ContextLengthError):
        drain(s.ask(engine, "a third"))
    assert s.turns == before


def test_save_errors_are_one_line(tmp_path: Path) -> None:
    from mlxcache.errors import OutputFileError

    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(OutputFileError, match=r"cannot write .*/file/sessions/x\.json"):
        chat.save(chat.ChatSession(), tmp_path / "file" / "sessions", "x")


def test_save_refuses_to_overwrite_another_session(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    chat.save(chat.ChatSession(system="keep me"), tmp_path / "sessions", "other")
    result = invoke(["-n", "2"], "/save other\n", tmp_path, str(tiny_gguf))
    assert result.exit_code == 2  # type: ignore[attr-defined]
    assert (
        result.stderr == "error: a session 'other' exists already: pick another name, or /load it\n"
    )  # type: ignore[attr-defined]
    assert chat.load(tmp_path / "sessions", "other").system == "keep me"

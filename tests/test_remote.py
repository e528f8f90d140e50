"""`--server URL`: generate and json sent to a running `mlxcache serve` print the bytes they
print in-process; a server that would reply otherwise (another block size or model) or
that cannot be reached is one error line, never a silent fallback."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tinymodel import write_tiny_gguf

from mlxcache.server.process import MlxcacheServer, free_port, running

pytestmark = pytest.mark.slow  # a server in a child process

BLOCK = 16
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
}


@pytest.fixture(scope="module")
def model(wide_gguf: Path) -> Path:
    """The tiny model with room for a schema in its prompt."""
    return wide_gguf


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("remote-cache")


@pytest.fixture(scope="module")
def server(model: Path, cache: Path) -> Iterator[MlxcacheServer]:
    args = ["--block-size", str(BLOCK), "--cache-dir", str(cache), "--no-warm-ahead"]
    with running(model, *args) as srv:
        yield srv


def cli(
    model: Path, cache: Path, *args: str, server: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`mlxcache ARGS -m MODEL` in a new process (as a user runs it), through `server`."""
    env = {k: v for k, v in os.environ.items() if k != "MLXCACHE_SERVER"}
    if server is not None:
        env["MLXCACHE_SERVER"] = server
    argv = [sys.executable, "-m", "mlxcache_cli", *args, "-m", str(model)]
    argv += ["--cache-dir", str(cache), "--block-size", str(BLOCK)]
    return subprocess.run(argv, capture_output=True, env=env, check=False, timeout=600)


def notes(stderr: bytes) -> list[str]:
    """Every stderr line but the stats line (whose timings differ run to run) and the note
    of a probe measured in this process (its start and end, once; a server measures in its
    own)."""
    return [
        line
        for line in stderr.decode().splitlines()
        if "prompt tokens cached" not in line and not line.startswith(("measuring ", "measured "))
    ]


def stats_line(stderr: bytes) -> str:
    return next(line for line in stderr.decode().splitlines() if "prompt tokens cached" in line)


@pytest.mark.check  # the fast tier's --server smoke
@pytest.mark.parametrize(
    "args",
    [
        ["generate", "-n", "12", "hello there"],
        ["generate", "-n", "12", "--raw", "--stop", "P", "once upon"],
        ["generate", "-n", "12", "-t", "0.8", "--seed", "3", "--top-k", "20", "hi"],
        ["json", "-n", "40", "--schema", json.dumps(SCHEMA), "Paris?"],
        ["json", "-n", "4", "--schema", json.dumps(SCHEMA), "Paris?"],  # cut off: exit 1
        # Drafted: the request carries --draft; the reply is the plain one either way.
        ["generate", "-n", "12", "--draft", "lookup", "-t", "0.7", "--seed", "2", "ab ab ab"],
        ["json", "-n", "40", "--draft", "lookup", "--schema", json.dumps(SCHEMA), "Paris?"],
    ],
)
def test_same_bytes_as_in_process(
    server: MlxcacheServer, model: Path, cache: Path, args: list[str]
) -> None:
    local = cli(model, cache, *args)
    through = cli(model, cache, *args, server=server.url)
    assert through.returncode == local.returncode
    assert through.stdout == local.stdout and (local.stdout or local.returncode)
    assert notes(through.stderr) == notes(local.stderr)  # errors and the token limit note
    # The server's stats: its memory tier holds the prompt the first call kept.
    assert "/" in stats_line(through.stderr)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        },
    },
}
CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
    },
]


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("tools")
    (where / "tools.json").write_text(json.dumps([WEATHER]))
    (where / "conv.json").write_text(json.dumps(CONV))
    return where


@pytest.mark.parametrize(
    "args",
    [
        ["--tool-choice", "required", "-n", "100", "x"],  # a call (81 tokens)
        ["--tool-choice", "required", "-n", "100", "--json", "x"],
        ["--tool-choice", "required", "-n", "12", "x"],  # cut off: exit 1, the flag named
        ["--tool-choice", "required", "-n", "12", "--json", "x"],  # the library's words
        # Cut off inside the arguments: the stream began the call, the reply has none.
        ["--tool-choice", "required", "-n", "60", "--json", "x"],
        ["--tool-choice", "none", "-n", "6", "x"],  # text and the token limit note
        ["--tool-choice", "get_weather", "-n", "100", "--system", "Be brief.", "x"],
        ["--messages", "conv.json", "--tool-result", "get_weather=sunny", "-n", "6", "--json"],
    ],
)
def test_tools_same_bytes_as_in_process(
    server: MlxcacheServer, model: Path, cache: Path, tool_files: Path, args: list[str]
) -> None:
    args = ["tools", "--tools", str(tool_files / "tools.json"), *args]
    args = [str(tool_files / a) if a == "conv.json" else a for a in args]
    local = cli(model, cache, *args)
    through = cli(model, cache, *args, server=server.url)
    assert through.returncode == local.returncode
    assert notes(through.stderr) == notes(local.stderr)
    if "--json" not in args:
        assert through.stdout == local.stdout and (local.stdout or local.returncode)
        return
    # The same document but the stats (timings; the server's cache hits).
    mine, theirs = json.loads(local.stdout), json.loads(through.stdout)
    assert theirs.pop("stats")["prompt_tokens"] == mine.pop("stats")["prompt_tokens"]
    assert theirs == mine


def regress_suite(model: Path, where: Path) -> Path:
    """A suite of every case kind (a repeated chat turn, a sampled reply, two JSON prompts
    at once, a tool call), on the server's model."""
    doc = {
        "model": str(model),
        "defaults": {"temperature": 0, "max_tokens": 6},
        "cases": [
            {"name": "plain", "kind": "plain", "prompt": "abc abc abc", "system": "Be brief."},
            {"name": "talk", "kind": "chat", "turns": ["hello", "again"], "repeat_last": True},
            {"name": "sampled", "kind": "plain", "prompt": "abc xyz", "temperature": 1.0},
            {
                "name": "two-json",
                "kind": "json",
                "schema": {"type": "string", "maxLength": 3},
                "prompts": ["abc q", "abc r"],
                "instructions": "A code.",
            },
            {
                "name": "call",
                "kind": "tools",
                "tools": [WEATHER],
                "tool_choice": "get_weather",
                "prompt": "Paris?",
                "max_tokens": 100,
            },
        ],
    }
    path = where / "suite.json"
    path.write_text(json.dumps(doc))
    return path


def regress_cli(*args: str, server: str | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "MLXCACHE_SERVER"}
    if server is not None:
        env["MLXCACHE_SERVER"] = server
    argv = [sys.executable, "-m", "mlxcache_cli", "regress", *args, "--quiet"]
    return subprocess.run(argv, capture_output=True, env=env, check=False, timeout=600)


def test_regress_through_a_server_gives_the_in_process_golden(
    server: MlxcacheServer, model: Path, tmp_path: Path
) -> None:
    suite = str(regress_suite(model, tmp_path))
    local, through = tmp_path / "local.json", tmp_path / "through.json"
    recorded = regress_cli("record", suite, "-o", str(local), "--block-size", str(BLOCK))
    assert recorded.returncode == 0, recorded.stderr
    # Recorded through the server (its block size: the golden does not depend on it).
    again = regress_cli("record", suite, "-o", str(through), server=server.url)
    assert (again.returncode, again.stdout) == (0, recorded.stdout)
    assert re.fullmatch(
        rf"recorded 5 cases to {re.escape(str(through))} \(\d+\.\d+ s\)\n", again.stderr.decode()
    )
    assert through.read_bytes() == local.read_bytes()  # versions and model keys included
    checked = regress_cli("check", suite, str(local), "--json", server=server.url)
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout)
    assert report["ok"] and report["notes"] == [] and list(report["variants"]) == ["warm"]
    assert report["variants"]["warm"]["hits"] > 0  # the server's memory tier
    mine = regress_cli("check", suite, str(local), "--variants", "warm", "--block-size", "16")
    theirs = regress_cli("check", suite, str(local), server=server.url)
    # The same report, but for the verdict's duration (its last line).
    assert theirs.returncode == 0
    assert theirs.stdout.splitlines()[:-1] == mine.stdout.splitlines()[:-1]
    assert theirs.stdout.decode().splitlines()[-1].startswith("5 cases under 1 variant: 5 passed")
    assert mine.stdout.decode().splitlines()[0] == "ok                     plain"
    args = ["regress", "check", suite, str(local), "--quiet", "--server", server.url]
    assert model_code_imported(*args) == "[]"


def test_regress_variants_a_server_cannot_run_are_refused(
    server: MlxcacheServer, model: Path, tmp_path: Path
) -> None:
    suite = str(regress_suite(model, tmp_path))
    args = ["record", suite, "-o", str(tmp_path / "g.json"), "--variants", "cold,warm,lanes"]
    out = regress_cli(*args, server=server.url)
    assert (out.returncode, out.stdout) == (2, b"")
    assert out.stderr.decode() == (
        "error: --variants cold,lanes run in-process only: drop --server (or unset "
        "$MLXCACHE_SERVER), or run --variants warm\n"
    )
    assert not (tmp_path / "g.json").exists()
    other = regress_cli("record", suite, "-o", "g.json", "--block-size", "32", server=server.url)
    assert other.returncode == 2
    assert "block size: 16 (server) vs 32 (this command)" in other.stderr.decode()


def test_json_output_carries_the_servers_tokens_and_stats(
    server: MlxcacheServer, model: Path, cache: Path
) -> None:
    args = ["generate", "-n", "8", "--json", "a json line"]
    local = json.loads(cli(model, cache, *args).stdout)
    first = json.loads(cli(model, cache, *args, server=server.url).stdout)
    again = json.loads(cli(model, cache, *args, server=server.url).stdout)
    for doc in (first, again):
        assert (doc["text"], doc["tokens"], doc["finish_reason"]) == (
            local["text"],
            local["tokens"],
            local["finish_reason"],
        )
    assert again["stats"]["cached_from"] == "memory"
    assert again["stats"]["prefilled_tokens"] == 0  # the same prompt resumes whole


def test_another_block_size_is_refused_in_one_line(
    server: MlxcacheServer, model: Path, cache: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if k != "MLXCACHE_SERVER"}
    argv = [sys.executable, "-m", "mlxcache_cli", "generate", "-n", "4", "hi", "-m", str(model)]
    argv += ["--cache-dir", str(cache), "--block-size", "32", "--server", server.url]
    out = subprocess.run(argv, capture_output=True, env=env, check=False, timeout=600)
    assert out.returncode == 2 and out.stdout == b""
    assert out.stderr.decode() == (
        f"error: the server at {server.url} does not reply as this command would: "
        "block size: 16 (server) vs 32 (this command)\n"
    )


def test_another_model_is_refused(server: MlxcacheServer, cache: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, context=4096, seed=1)
    out = cli(other, cache, "generate", "-n", "4", "hi", server=server.url)
    assert out.returncode == 2 and out.stdout == b""
    lines = out.stderr.decode().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"error: the server at {server.url} does not reply as this")
    # The server's model by its name (it publishes no path), this command's by its path.
    assert f"model: {server.model} (server) vs {other.resolve()} (this command)" in lines[0]


def test_a_changed_model_file_is_refused(model: Path, cache: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model.read_bytes())
    with running(copy, "--block-size", str(BLOCK), "--cache-dir", str(cache)) as srv:
        os.utime(copy, ns=(0, 0))  # the same path, other files: what it loaded is gone
        out = cli(copy, cache, "generate", "-n", "4", "hi", server=srv.url)
    assert out.returncode == 2
    assert "model files (changed since the server loaded them)" in out.stderr.decode()


def test_unreachable_server_is_one_line_exit_1(model: Path, cache: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    out = cli(model, cache, "generate", "-n", "4", "hi", server=url)
    assert out.returncode == 1 and out.stdout == b""
    assert out.stderr.decode() == f"error: cannot reach the server at {url}: Connection refused\n"


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["json", "--strict", "x"], "--strict"),
        (["json", "--think", "x"], "--think"),
        (["json", "--input", "in.jsonl", "-o", "out.jsonl"], "--input"),
        (["tools", "--tools", json.dumps([WEATHER]), "--think", "x"], "--think"),
        (["generate", "--draft-model", "small.gguf", "x"], "--draft-model"),
        (["json", "--draft-inexact", "x"], "--draft-inexact"),
    ],
)
def test_options_a_server_cannot_honour_are_refused(
    model: Path, cache: Path, args: list[str], flag: str
) -> None:
    out = cli(model, cache, *args, server="http://127.0.0.1:9")  # refused before connecting
    assert out.returncode == 2
    assert out.stderr.decode() == (
        f"error: {flag} runs in-process only: drop --server (or unset $MLXCACHE_SERVER)\n"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "-n", "4", "hi"],
        ["tools", "--tools", json.dumps([WEATHER]), "-n", "4", "x"],
        ["chat", "-n", "4"],  # one turn: the line on stdin
    ],
)
def test_remote_path_imports_no_model_code(
    server: MlxcacheServer, model: Path, cache: Path, args: list[str]
) -> None:
    args = [*args, "-m", str(model), "--cache-dir", str(cache), "--block-size", str(BLOCK)]
    assert model_code_imported(*args, "--server", server.url) == "[]"


def model_code_imported(*args: str) -> str:
    """`mlxcache ARGS` run in a new process (a line on its stdin, for chat): the
    model-code modules it imported."""
    code = (
        "import sys, runpy; sys.argv = ['mlxcache'] + sys.argv[1:]\n"
        "try:\n    runpy.run_module('mlxcache_cli', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('mlx_lm', 'transformers', 'mlxcache')  and (m.startswith(('mlx_lm', 'transformers')) "
        "or m in ('mlxcache.engine', 'mlxcache.runtime'))), file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        input=b"hi\n",
        capture_output=True,
        check=False,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return out.stderr.decode().splitlines()[-1]


def test_identity_is_on_the_model_card(server: MlxcacheServer, model: Path) -> None:
    import urllib.request

    import mlx.core as mx
    import mlx_lm

    from mlxcache import __version__
    from mlxcache.wire import model_source

    with urllib.request.urlopen(server.url + "/v1/models") as reply:
        found = json.loads(reply.read())["data"][0]["mlxcache"]
    source = model_source(str(model))["source"]
    assert {k: v for k, v in found.items() if k != "key"} == {
        "model": model.name,
        "digest": hashlib.sha256(source.encode()).hexdigest()[:16],
        "stamp": model_source(str(model))["stamp"],
        "family": "llama",
        "block_size": BLOCK,
        "cache": True,
        "kv": "full precision",
        "tailoring": "",
        "adapter": None,
        "exact": True,
        "version": __version__,
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_lm": mlx_lm.__version__,
    }
    assert len(found["key"]) == 32


def chat_cli(
    model: Path, where: Path, stdin: str, *args: str, server: str | None = None
) -> subprocess.CompletedProcess[bytes]:
    """`mlxcache chat ARGS` with piped stdin, its sessions saved under `where`."""
    env = {k: v for k, v in os.environ.items() if k != "MLXCACHE_SERVER"}
    env["MLXCACHE_DATA_DIR"] = str(where)
    if server is not None:
        env["MLXCACHE_SERVER"] = server
    argv = [sys.executable, "-m", "mlxcache_cli", "chat", *args, "-m", str(model)]
    argv += ["--cache-dir", str(where / "cache")]
    return subprocess.run(
        argv, input=stdin.encode(), capture_output=True, env=env, check=False, timeout=600
    )


CHAT = "hello there\n/retry -t 0.7\nand a second turn\n/history\n/save talk\n"


def test_chat_through_a_server_prints_the_in_process_bytes(
    server: MlxcacheServer, model: Path, tmp_path: Path
) -> None:
    """Three replies (one a sampled /retry), the history and a saved session: the same
    bytes as in-process on stdout, on stderr (but the stats lines and the save's path) and
    in the saved file (the model's name and key come from the server's identity)."""
    args = ["-n", "8", "--block-size", str(BLOCK)]
    local = chat_cli(model, tmp_path / "local", CHAT, *args)
    through = chat_cli(model, tmp_path / "through", CHAT, *args, server=server.url)
    assert (local.returncode, through.returncode) == (0, 0), through.stderr
    assert through.stdout == local.stdout
    first, retried, _second = local.stdout.splitlines()
    assert first != retried  # sampled at the session's seed + 1, on both sides
    mine, theirs = notes(local.stderr), notes(through.stderr)
    assert mine[1] == "temperature 0.0 -> 0.7 for this session"
    assert mine[-1] == f"saved {tmp_path / 'local' / 'sessions' / 'talk.json'}"
    assert theirs[:-1] == mine[:-1]
    assert theirs[-1] == f"saved {tmp_path / 'through' / 'sessions' / 'talk.json'}"
    saved = (tmp_path / "local" / "sessions" / "talk.json").read_bytes()
    assert (tmp_path / "through" / "sessions" / "talk.json").read_bytes() == saved
    # Resumed through the server, the session goes on from its file; /stats reads the
    # server's cache.
    resumed = chat_cli(model, tmp_path / "through", "/stats\n", "-r", "talk", server=server.url)
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stderr.decode().splitlines()
    assert lines[-3] == f"session talk · 2 turns · model {server.model}"
    assert lines[-1].endswith(f"blocks of {BLOCK} tokens")


def test_chat_refuses_in_one_line_what_a_server_cannot_honour(
    server: MlxcacheServer, model: Path, tmp_path: Path
) -> None:
    from mlxcache.modes import chat
    from mlxcache.sampling import SamplingParams

    session = chat.ChatSession(sampling=SamplingParams(repetition_context=5))
    chat.save(session, tmp_path / "sessions", "old")
    out = chat_cli(model, tmp_path, "hi\n", "-r", "old", server="http://127.0.0.1:9")
    assert (out.returncode, out.stdout) == (2, b"")  # refused before connecting
    assert out.stderr.decode() == (
        "error: repetition_context runs in-process only (no request sets it)\n"
    )
    other = chat_cli(model, tmp_path, "hi\n", "--block-size", "32", server=server.url)
    assert (other.returncode, other.stdout) == (2, b"")
    assert other.stderr.decode() == (
        f"error: the server at {server.url} does not reply as this command would: "
        "block size: 16 (server) vs 32 (this command)\n"
    )


def test_a_chat_reply_left_early_is_cancelled_on_the_server(server: MlxcacheServer) -> None:
    """Ctrl-C in a chat closes the reply's stream: the server cancels the request."""
    from mlxcache.bench.serve_bench import idle_report
    from mlxcache.events import Token
    from mlxcache.remote import ChatRunner, Server
    from mlxcache.request_spec import RequestSpec
    from mlxcache.sampling import SamplingParams

    with Server(server.url) as client:
        asked = [{"role": "user", "content": "a long one, left early"}]
        request = RequestSpec(tuple(asked), sampling=SamplingParams(max_tokens=2000))
        events = ChatRunner(client, server.model).reply(request)
        assert isinstance(next(e for e in events if isinstance(e, Token)), Token)
        events.close()  # type: ignore[attr-defined]
        # Logged once the handler is done, the lane cancelled (no other test leaves early).
        server.wait_for(re.compile(r"POST /v1/chat/completions 200 .* finish=disconnected$"))
    report = idle_report(server.url)
    assert (report["pinned_entries"], report["busy"]) == (0, False)

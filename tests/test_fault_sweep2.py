"""The second fault sweep (issue 20): each fault is one line or an HTTP 400, nothing is lost
or written twice, and no client's schema stalls another's reply.

Every case here failed before its fix: a traceback, a 500, a hang, garbage tokens, records
written twice, or files outside the cache deleted. Most fail before a model loads; the
rest use the tiny model (the server in-process, over its ASGI app).
"""

from __future__ import annotations

import asyncio
import fcntl
import io
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tinymodel import write_tiny_gguf
from typer.testing import CliRunner

from mlxcache import __version__
from mlxcache.cache.disk import DiskTier
from mlxcache.engine import Engine
from mlxcache.model import LoadedModel
from mlxcache.modes import chat, json_mode
from mlxcache.modes.schema import MAX_SCHEMA_OBJECTS
from mlxcache.sampling import SamplingParams
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.worker import EngineWorker
from mlxcache_cli.main import app as cli

runner = CliRunner()
LONG_WAIT_S = 300
"""How long a test waits for what must happen at once (only reached when it fails)."""


def run(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = runner.invoke(cli, list(args), input=stdin)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exc_info
    return result.exit_code, result.stdout, result.stderr


def refused(line: str) -> tuple[int, str, str]:
    """What a bad input gives: exit 2, nothing on stdout, one error line."""
    return 2, "", f"error: {line}\n"


# -- environment --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "args", "expected"),
    [
        ("abc", ["--version"], (0, f"mlxcache {__version__}\n", "")),
        (
            "0",
            ["generate", "hi", "-m", "missing.gguf"],
            (2, "", "error: MLXCACHE_BLOCK_SIZE must be a whole number >= 1, got '0'\n"),
        ),
    ],
)
def test_a_bad_block_size_variable_is_one_line(
    value: str, args: list[str], expected: tuple[int, str, str], tmp_path: Path
) -> None:
    # A new process: the value used to break the import of the command itself.
    env = {**os.environ, "MLXCACHE_BLOCK_SIZE": value, "MLXCACHE_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "mlxcache_cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=LONG_WAIT_S,
    )
    assert (done.returncode, done.stdout, done.stderr) == expected


# -- schemas ------------------------------------------------------------------------------


def wide_schema(properties: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string"} for i in range(properties)},
    }


def test_a_schema_past_the_size_bound_is_refused_at_once(tmp_path: Path) -> None:
    schema = tmp_path / "wide.json"
    schema.write_text(json.dumps(wide_schema(MAX_SCHEMA_OBJECTS + 100)))
    assert run("json", "--check", "--schema", str(schema)) == refused(
        "schema is too large: more than 2,000 JSON objects (split or simplify it)"
    )


def test_tools_share_one_size_bound(tmp_path: Path) -> None:
    each = wide_schema(MAX_SCHEMA_OBJECTS // 2)  # each one alone is within the bound
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"name": f"f{i}", "parameters": each} for i in range(3)]))
    assert run("tools", "--tools", str(tools), "hi", "-m", "missing.gguf") == refused(
        f"tools {tools} is too large: more than 2,000 JSON objects (split or simplify it)"
    )


@pytest.mark.parametrize(
    ("schema", "line"),
    [
        (
            '{"type": "array", "minItems": 100000000000000000000}',
            "schema has a number constrained decoding cannot read at /minItems (integers "
            "must fit in 64 bits, numbers must be finite)",
        ),
        (
            '{"type": "integer", "minimum": -9223372036854775809}',
            "schema has a number constrained decoding cannot read at /minimum (integers "
            "must fit in 64 bits, numbers must be finite)",
        ),
        (
            '{"const": ' + "9" * 5000 + "}",
            "schema is not JSON: an integer longer than 4300 digits at line 1 column 11",
        ),
    ],
)
def test_a_huge_number_in_a_schema_is_one_line(schema: str, line: str) -> None:
    assert run("json", "--check", "--schema", schema) == refused(line)


# -- lone surrogates ----------------------------------------------------------------------

SURROGATE = "weather \\ud800 in Paris?"  # as JSON text: an escape of half a UTF-16 pair


def test_a_lone_surrogate_in_messages_is_refused(tmp_path: Path, tiny_gguf: Path) -> None:
    messages = tmp_path / "messages.json"
    text = '[{"role": "user", "content": "' + SURROGATE + '"}]'
    messages.write_text(text)
    tools = tmp_path / "tools.json"
    tools.write_text('[{"name": "f", "parameters": {"type": "object", "properties": {}}}]')
    got = run("tools", "--tools", str(tools), "--messages", str(messages), "-m", str(tiny_gguf))
    assert got == refused(
        f"messages file {messages} is not JSON: a lone surrogate in a string (not valid "
        f"text) at line 1 column {text.index(chr(92)) + 1}"
    )


def test_a_lone_surrogate_in_a_batch_line_is_refused(tmp_path: Path, tiny_gguf: Path) -> None:
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "fine"}\n{"prompt": "' + SURROGATE + '"}\n')
    out = tmp_path / "out.jsonl"
    got = run("json", "--input", str(lines), "-o", str(out), "-m", str(tiny_gguf))
    assert got == refused(
        f"{lines} line 2: not JSON: a lone surrogate in a string (not valid text) at column "
        f"{lines.read_text().splitlines()[1].index(chr(92)) + 1}"
    )
    assert not out.exists()


def test_a_lone_surrogate_in_a_session_is_refused(tmp_path: Path, tiny_gguf: Path) -> None:
    saved = chat.ChatSession(turns=[chat.Turn("PLACEHOLDER", "fine")]).to_json()
    text = json.dumps(saved).replace("PLACEHOLDER", SURROGATE)
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "s.json").write_text(text)
    got = run("chat", "--resume", "s", "--cache-dir", str(tmp_path), "-m", str(tiny_gguf))
    at = text.index("\\ud800") + 1
    assert got == refused(
        f"cannot read session 's': a lone surrogate in a string (not valid text): line 1 "
        f"column {at} (char {at - 1})"
    )


# -- sessions and goldens, checked on read ------------------------------------------------


def save_session(cache: Path, name: str, **fields: Any) -> None:
    doc = {**chat.ChatSession(turns=[chat.Turn("hi", "there")]).to_json(), **fields}
    (cache / "sessions").mkdir(parents=True, exist_ok=True)
    (cache / "sessions" / f"{name}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"sampling": {"seed": 1.5}}, "seed must be an integer, got 1.5"),
        ({"sampling": {"temperature": "hot"}}, "temperature must be a number, got 'hot'"),
        ({"generations": "3"}, "'generations' has the wrong type (str): '3'"),
        ({"turns": [{"user": "hi", "reply": 7}]}, "'reply' has the wrong type (int): 7"),
        ({"stop": [""]}, "'stop' must be a list of non-empty strings"),
    ],
)
def test_a_damaged_session_is_one_line_before_the_model_loads(
    fields: dict[str, Any], reason: str, tmp_path: Path
) -> None:
    save_session(tmp_path, "s", **fields)
    got = run("chat", "--resume", "s", "--cache-dir", str(tmp_path), "-m", "missing.gguf")
    assert got == refused(f"session 's': not a saved chat session: {reason}")


@pytest.fixture(scope="module")
def other_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny model (other weights)."""
    path = tmp_path_factory.mktemp("other") / "other.gguf"
    write_tiny_gguf(path, seed=9)
    return path


def test_a_session_resumes_on_its_own_model_unless_forced(
    tmp_path: Path, tiny_gguf: Path, other_gguf: Path, cache_root: Path
) -> None:
    common = ["--cache-dir", str(tmp_path), "--cache-disk", "0", "-n", "2"]
    code, _, err = run("chat", "-m", str(tiny_gguf), *common, stdin="/save s\nhi\n")
    assert code == 0, err
    recorded = json.loads((tmp_path / "sessions" / "s.json").read_text())
    assert recorded["model"] == "tiny.gguf" and len(recorded["model_key"]) == 32
    again = ["chat", "--resume", "s", *common]
    assert run(*again, "-m", str(other_gguf), stdin="next\n") == refused(
        "session 's' was made with model tiny.gguf, not other.gguf: pass --model for it, "
        "or --force to go on with other.gguf"
    )
    assert json.loads((tmp_path / "sessions" / "s.json").read_text()) == recorded
    code, _, err = run("chat", *common, "-m", str(other_gguf), stdin="/load s\n")
    assert code == 2 and err.splitlines()[-1] == (
        "error: session 's' was made with model tiny.gguf, not other.gguf: pass --model for "
        "it, or --force to go on with other.gguf"
    )
    code, _, err = run(*again, "-m", str(other_gguf), "--force", stdin="next\n")
    assert (
        code == 0
        and (
            "warning: session 's' was made with model tiny.gguf, not other.gguf: going on with "
            "other.gguf (--force)"
        )
        in err.splitlines()
    )
    assert json.loads((tmp_path / "sessions" / "s.json").read_text())["model"] == "other.gguf"


def test_a_session_without_a_model_still_resumes(
    tmp_path: Path, tiny_gguf: Path, cache_root: Path
) -> None:
    old = chat.ChatSession(turns=[chat.Turn("hi", "there")]).to_json()
    del old["model"], old["model_key"]  # written before sessions recorded their model
    (tmp_path / "sessions").mkdir()
    (tmp_path / "sessions" / "s.json").write_text(json.dumps(old))
    args = ["chat", "--resume", "s", "--cache-dir", str(tmp_path), "--cache-disk", "0"]
    code, _, err = run(*args, "-m", str(tiny_gguf), "-n", "2", stdin="next\n")
    assert code == 0, err
    assert json.loads((tmp_path / "sessions" / "s.json").read_text())["model"] == "tiny.gguf"


def test_a_damaged_golden_is_refused_before_any_model_loads(tmp_path: Path) -> None:
    suite = tmp_path / "suite.yaml"
    # A model that does not exist: reaching it would be a different error.
    suite.write_text("cases:\n  - {name: p, kind: plain, prompt: hi, model: missing.gguf}\n")
    golden = tmp_path / "golden.json"
    golden.write_text(
        json.dumps(
            {"format": "mlxcache-golden-v1", "versions": "x", "cases": {"p": {"outputs": []}}}
        )
    )
    assert run("regress", "check", str(suite), str(golden)) == refused(
        f"{golden}: 'versions' must be an object of version strings"
    )


# -- batch output -------------------------------------------------------------------------


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


# -- cache clear --------------------------------------------------------------------------


def cache_with_index(root: Path) -> Path:
    DiskTier(root / "kv").close()
    return root / "kv" / "files"


def test_cache_clear_leaves_a_stray_directory_with_a_warning(tmp_path: Path) -> None:
    files = cache_with_index(tmp_path)
    (files / "x").mkdir()
    (files / "ours.safetensors").write_bytes(b"block")
    assert run("cache", "clear", "--cache-dir", str(tmp_path)) == (
        0,
        "removed 0 entries (5 B freed)\n",  # ours.safetensors
        f"warning: left {files / 'x'} as it is: not a file mlxcache wrote (links are not "
        "followed)\n",
    )
    assert [p.name for p in files.iterdir()] == ["x"]


@pytest.mark.parametrize("index", [True, False])
def test_cache_clear_never_follows_a_link_out_of_the_cache(tmp_path: Path, index: bool) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    cache = tmp_path / "cache"
    files = cache_with_index(cache) if index else cache / "kv" / "files"
    if index:
        files.rmdir()
    files.parent.mkdir(parents=True, exist_ok=True)
    files.symlink_to(outside)
    assert run("cache", "clear", "--cache-dir", str(cache)) == (
        0,
        "removed 0 entries (0 B freed)\n",
        f"warning: left {files} as it is: not a file mlxcache wrote (links are not followed)\n",
    )
    assert (outside / "precious.txt").read_text() == "keep me"


# -- sampling edges -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "edge",
    [
        ["--temp", "1e-39", "--seed", "1"],  # 1/T overflows float32
        ["--temp", "1e-310", "--seed", "2"],  # 1/T overflows float64
        ["--temp", "1", "--top-p", "1e-300", "--seed", "3"],  # top-p rounds to 0
    ],
)
def test_sampling_at_its_edges_is_greedy(
    edge: list[str], tiny_gguf: Path, cache_root: Path
) -> None:
    base = ["generate", "--raw", "Once upon a time", "-m", str(tiny_gguf), "-n", "12"]
    greedy = run(*base, "--cache-disk", "0")
    assert greedy[0] == 0 and greedy[1]
    assert run(*base, "--cache-disk", "0", *edge)[:2] == greedy[:2]


# -- the server ---------------------------------------------------------------------------


class Client:
    """Requests to the ASGI app in this process (several may run at once in one loop)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def call(
        self, path: str, doc: Any = None, headers: dict[str, bytes] | None = None
    ) -> tuple[int, Any]:
        body = b"" if doc is None else json.dumps(doc).encode()
        sent: list[dict[str, Any]] = []
        answered = asyncio.Event()
        read = False

        async def receive() -> dict[str, Any]:
            nonlocal read
            if not read:
                read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await answered.wait()  # the client stays until its reply is complete
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered.set()

        scope = {
            "type": "http",
            "method": "GET" if doc is None else "POST",
            "path": path,
            "headers": [(k.lower().encode(), v) for k, v in (headers or {}).items()],
            "query_string": b"",
        }
        await self.app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        return start["status"], json.loads(data)

    def __call__(self, path: str, doc: Any = None, **headers: bytes) -> tuple[int, Any]:
        return asyncio.run(self.call(path, doc, headers))


@pytest.fixture
def engine(tiny: LoadedModel) -> Iterator[tuple[Engine, EngineWorker]]:
    engine = Engine(tiny)
    with EngineWorker(engine) as worker:
        yield engine, worker


def serve(tiny: LoadedModel, engine: tuple[Engine, EngineWorker], **settings: Any) -> Client:
    log = RequestLog(stream=io.StringIO())
    return Client(create_app(*engine, Settings(tiny.name, **settings), log))


def chat_body(tiny: LoadedModel, content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {
        "model": tiny.name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        **fields,
    }


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> Any:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return 400, {"error": error}


def test_a_schema_being_prepared_does_not_stall_another_client(
    tiny: LoadedModel, engine: tuple[Engine, EngineWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    client = serve(tiny, engine)
    entered, release = threading.Event(), threading.Event()
    check = json_mode.check_schema

    def held(*args: Any, **kwargs: Any) -> Any:
        """The schema check of the first client, held until the second has its reply."""
        entered.set()
        release.wait(LONG_WAIT_S)
        return check(*args, **kwargs)

    monkeypatch.setattr(json_mode, "check_schema", held)
    schema = {"name": "s", "schema": {"type": "string", "maxLength": 3}}
    slow_body = chat_body(tiny, response_format={"type": "json_schema", "json_schema": schema})

    async def two_clients() -> tuple[tuple[int, Any], tuple[int, Any]]:
        slow = asyncio.ensure_future(client.call("/v1/chat/completions", slow_body))
        assert await asyncio.to_thread(entered.wait, LONG_WAIT_S)
        try:
            quick = await asyncio.wait_for(
                client.call("/v1/chat/completions", chat_body(tiny)), LONG_WAIT_S
            )
        finally:
            release.set()
        return quick, await slow

    quick, slow = asyncio.run(two_clients())
    assert quick[0] == 200 and quick[1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert slow[0] == 200, slow


def test_a_tiny_temperature_in_the_server_is_greedy(
    tiny: LoadedModel, engine: tuple[Engine, EngineWorker]
) -> None:
    client = serve(tiny, engine)
    replies = [
        client("/v1/chat/completions", chat_body(tiny, temperature=t, seed=1, max_tokens=12))
        for t in (0, 1e-310, 1e-39)
    ]
    assert all(status == 200 for status, _ in replies)
    texts = {doc["choices"][0]["message"]["content"] for _, doc in replies}
    assert len(texts) == 1 and texts != {""}


def test_server_faults_are_400(tiny: LoadedModel, engine: tuple[Engine, EngineWorker]) -> None:
    client = serve(tiny, engine)
    path = "/v1/chat/completions"
    body = chat_body(tiny, content=SURROGATE.replace("\\ud800", "\ud800"))
    at = json.dumps(body).index("\\ud800") + 1
    assert client(path, body) == invalid(
        "the request body is not valid JSON: a lone surrogate in a string (not valid text) "
        f"at line 1 column {at}",
        code="invalid_json",
    )
    huge = {"type": "array", "minItems": 10**20}
    fmt = {"type": "json_schema", "json_schema": {"name": "h", "schema": huge}}
    assert client(path, chat_body(tiny, response_format=fmt)) == invalid(
        "schema has a number constrained decoding cannot read at /minItems (integers must "
        "fit in 64 bits, numbers must be finite)"
    )
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": wide_schema(2_100)}}
    assert client(path, chat_body(tiny, response_format=fmt)) == invalid(
        "schema is too large: more than 2,000 JSON objects (split or simplify it)"
    )
    for field, value, kind in [
        ("stream", "yes", "boolean"),
        ("max_tokens", "5", "integer"),
        ("seed", 1.5, "integer"),
        ("temperature", "0", "number"),
    ]:
        assert client(path, chat_body(tiny, **{field: value})) == invalid(
            f"{field}: Input should be a valid {kind}", param=field
        ), field


def test_an_api_key_with_non_ascii_characters_is_compared_as_utf8(
    tiny: LoadedModel, engine: tuple[Engine, EngineWorker]
) -> None:
    client = serve(tiny, engine, api_key="clé-ünïcode")
    status, doc = client("/v1/models", authorization="Bearer clé-ünïcode".encode())
    assert (status, doc["data"][0]["id"]) == (200, tiny.name)
    for wrong in ("Bearer clé-ünïcod".encode(), "Bearer clé-ünïcode".encode("latin-1")):
        assert client("/v1/models", authorization=wrong)[0] == 401


def test_sampling_settings_are_type_checked() -> None:
    with pytest.raises(ValueError, match=r"^seed must be an integer, got 1\.5$"):
        SamplingParams(seed=1.5)
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer, got True$"):
        SamplingParams(max_tokens=True)

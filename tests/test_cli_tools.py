"""`mlxcache tools` transcripts through Typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mlxcache_cli.main import app

runner = CliRunner()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER]))
    return path


@pytest.mark.model
def test_required_call_then_result_then_text(cache_root: Path, tools: Path, tmp_path: Path) -> None:
    base = ["tools", "--tools", str(tools), "--block-size", "32"]
    call = runner.invoke(
        app, [*base, "What is the weather in Paris?", "--tool-choice", "required", "-n", "40"]
    )
    assert call.exit_code == 0, call.stderr
    assert call.stdout == 'get_weather({"city": "Paris"})\n'
    first_prompt = int(call.stderr.split("/", 1)[1].split(" ", 1)[0])
    # What `--json` returns as "messages" for that reply: the conversation so far.
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        },
    ]
    (tmp_path / "conv.json").write_text(json.dumps(messages))
    # The script runs the function and feeds its result back; `auto` may answer in text.
    result = '{"temp_c": 21, "sky": "sunny"}'
    reply = runner.invoke(
        app,
        [
            *(*base, "--messages", str(tmp_path / "conv.json")),
            *("--tool-result", f"get_weather={result}", "-n", "30", "--json"),
        ],
    )
    assert reply.exit_code == 0, reply.stderr
    answer = json.loads(reply.stdout)
    assert answer["tool_calls"] == [] and answer["content"]
    assert answer["content"] == f"<tool_response>\n{result}\n</tool_response>"  # a 135M model
    assert answer["finish_reason"] == "stop"
    # Warm-ahead after the call kept the blocks of call + result header: the follow-up
    # resumes past the last block the first request kept.
    assert answer["stats"]["cached_tokens"] > first_prompt // 32 * 32
    assert answer["messages"] == [
        *messages,
        {"role": "tool", "name": "get_weather", "content": result},
        {"role": "assistant", "content": answer["content"]},
    ]


# -- bad input: exit 2, one line -----------------------------------------------------------

NO_PARAMS = [{"name": "f", "parameters": {"type": "string"}}]  # not an object schema
CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}],
    },
]
BAD = [
    (["hi"], "error: Missing option '--tools'. (see 'mlxcache tools --help')"),
    (
        ["hi", "--tools", "/no/tools.json"],
        "error: cannot read tools file /no/tools.json: No such file or directory",
    ),
    (
        ["hi", "--tools", "{dir}/notjson.json"],
        "error: tools file {dir}/notjson.json is not JSON: Expecting value at line 1 column 1",
    ),
    (
        ["hi", "--tools", "{dir}/noparams.json"],
        'error: tools {dir}/noparams.json entry 0: tool \'f\': parameters must be a JSON Schema with "type": "object"',
    ),
    (
        ["hi", "--tools", "{tools}", "--tool-choice", "get_time"],
        "error: unknown tool 'get_time' in --tool-choice (auto, required, none, or one of: get_weather)",
    ),
    (
        ["hi", "--tools", "{tools}", "--tool-result", "get_weather=1"],
        'error: a --tool-result answers a tool call, but the conversation does not end with one (pass --messages FILE: the "messages" of the previous --json output)',
    ),
    (
        ["--tools", "{tools}", "--messages", "{dir}/conv.json", "--tool-result", "oops"],
        "error: --tool-result expects NAME=VALUE, got 'oops'",
    ),
    (
        ["--tools", "{tools}", "--messages", "{dir}/conv.json", "--tool-result", "get_time=1"],
        "error: --tool-result get_time: the last assistant message made no call to get_time (it called: get_weather)",
    ),
    (
        ["--tools", "{tools}", "--messages", "{dir}/conv.json"],
        "error: the conversation ends with the assistant: add a prompt or --tool-result",
    ),
    (
        [
            "--tools",
            "{tools}",
            "--messages",
            "{dir}/conv.json",
            "-s",
            "x",
            "--tool-result",
            "get_weather=1",
        ],
        "error: --messages starts with a system message; drop --system",
    ),
    (
        ["--tools", "{tools}", "--messages", '[{"role": "bot"}]'],
        "error: messages message 0: expected an object with role system|user|assistant|tool",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD)
def test_bad_input(tmp_path: Path, tools: Path, args: list[str], message: str) -> None:
    (tmp_path / "notjson.json").write_text("name: f\n")
    (tmp_path / "noparams.json").write_text(json.dumps(NO_PARAMS))
    (tmp_path / "conv.json").write_text(json.dumps(CONV))

    def fill(text: str) -> str:
        return text.replace("{dir}", str(tmp_path)).replace("{tools}", str(tools))

    result = runner.invoke(app, ["tools", *map(fill, args)])
    assert result.exit_code == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.strip() == fill(message)


# -- a tiny model: results that are not JSON, calls cut by the token limit --------------------


def test_text_result_is_sent_as_a_json_string(
    cache_root: Path, wide_gguf: Path, tools: Path, tmp_path: Path
) -> None:
    (tmp_path / "conv.json").write_text(json.dumps(CONV))
    args = ["tools", "--tools", str(tools), "--messages", str(tmp_path / "conv.json")]
    args += ["--tool-result", 'get_weather=sunny, "warm"', "--tool-choice", "none"]
    result = runner.invoke(app, [*args, "-m", str(wide_gguf), "-n", "2", "--json"])
    assert result.exit_code == 0, result.stderr
    sent = '"sunny, \\"warm\\""'
    assert f"warning: --tool-result get_weather: not JSON, sent as the JSON string {sent}" in (
        result.stderr
    )
    tool_msg = json.loads(result.stdout)["messages"][3]
    assert tool_msg == {"role": "tool", "name": "get_weather", "content": sent}


def test_a_call_cut_by_the_token_limit_keeps_the_raw_text(
    cache_root: Path, wide_gguf: Path, tools: Path
) -> None:
    args = ["tools", "x", "--tools", str(tools), "--tool-choice", "required"]
    result = runner.invoke(app, [*args, "-m", str(wide_gguf), "-n", "16", "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    limit = (
        "the reply reached the token limit before the tool call was complete "
        '(finish_reason "length"); raise max_tokens'
    )
    assert doc["error"] == limit and doc["finish_reason"] == "length"  # the library's words
    assert doc["tool_calls"] == [] and doc["text"].startswith("<tool_call>")
    flags = limit.replace("max_tokens", "--max-tokens")  # the CLI's
    assert result.stderr.strip().endswith(f"error: {flags}")


def test_json_says_tool_calls_when_the_reply_calls(
    cache_root: Path, wide_gguf: Path, tools: Path
) -> None:
    args = ["tools", "--tools", str(tools), "-m", str(wide_gguf), "--tool-choice", "required"]
    result = runner.invoke(app, [*args, "Weather in Paris?", "-n", "120", "--json"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["tool_calls"] and doc["finish_reason"] == "tool_calls"


def test_a_tools_text_reply_cut_at_the_limit_says_so(
    cache_root: Path, wide_gguf: Path, tmp_path: Path
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f"}}]))
    args = ["tools", "--tools", str(tools), "--tool-choice", "none", "-n", "2", "hi"]
    result = runner.invoke(app, [*args, "-m", str(wide_gguf), "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    assert result.stderr.splitlines()[-1] == "stopped at the token limit (2 tokens; -n for more)"


def test_a_tools_text_reply_ends_at_a_stop_string(
    cache_root: Path, wide_gguf: Path, tmp_path: Path
) -> None:
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([{"type": "function", "function": {"name": "f"}}]))
    args = ["tools", "--tools", str(tools), "--tool-choice", "none", "-n", "8", "hi", "--json"]
    args += ["-m", str(wide_gguf), "--cache-dir", str(tmp_path)]
    whole = json.loads(runner.invoke(app, args).stdout)["content"]
    stop = whole[2:4]
    cut = whole.find(stop)  # the reply ends before the stop string's first occurrence
    assert len(stop) == 2 and len(whole) > cut + len(stop)
    result = runner.invoke(app, [*args, "--stop", stop])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["content"] == whole[:cut] and doc["finish_reason"] == "stop"

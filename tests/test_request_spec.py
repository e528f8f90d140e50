"""`RequestSpec` on the wire: `to_wire` and `spec_of` are inverses, through JSON too, and
the server reads a spec's body as the spec says (its sampling, stops, route)."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcache import request_settings
from mlxcache.config import DRAFTS, SamplingParams
from mlxcache.errors import UserInputError, settings_named
from mlxcache.request_settings import CHAT, Bounds, RequestSetting
from mlxcache.request_spec import CHAT_PATH, TEXT_PATH, RequestSpec, spec_of, to_wire
from mlxcache.wire import USAGE_FIELD


def values(row: RequestSetting, wire: bool) -> st.SearchStrategy[Any]:
    """Every value `row`'s bounds hold (from its table row: a new row is covered); `wire`:
    and the chat request's bounds too."""
    b = row.bounds
    if wire:
        b = narrowest(b, row.api_bounds(CHAT))
    if row.kind is int:
        low = None if b.low is None else int(b.low) + b.low_open
        high = None if b.high is None else int(b.high) - b.high_open
        return st.integers(low, high)
    return st.floats(
        b.low,
        b.high,
        exclude_min=b.low is not None and b.low_open,
        exclude_max=b.high is not None and b.high_open,
        allow_nan=False,
        allow_infinity=False,
    )


def narrowest(a: Bounds, b: Bounds) -> Bounds:
    """The values both `a` and `b` hold."""
    lows = [(x.low, x.low_open) for x in (a, b) if x.low is not None]
    highs = [(x.high, x.high_open) for x in (a, b) if x.high is not None]
    low, low_open = max(lows, key=lambda e: (e[0], e[1])) if lows else (None, False)
    high, high_open = min(highs, key=lambda e: (e[0], not e[1])) if highs else (None, False)
    return Bounds(low, high, low_open, high_open, a.finite or b.finite)


def samplings(wire: bool) -> st.SearchStrategy[SamplingParams]:
    rows = request_settings.SAMPLING
    given = st.fixed_dictionaries({row.name: values(row, wire) for row in rows})
    return given.map(lambda kw: SamplingParams(**kw))


texts = st.text(max_size=12)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}
    ),
    max_size=3,
).map(tuple)
named = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": texts})}
)


def requests(wire: bool) -> st.SearchStrategy[RequestSpec]:
    """Specs, of messages or a raw prompt; `wire`: with settings the API's ranges hold."""
    parts = st.builds(
        RequestSpec,
        sampling=samplings(wire),
        stops=st.lists(st.text(min_size=1, max_size=4), max_size=3).map(tuple),
        response_format=st.none() | st.just({"type": "json_object"}),
        tools=st.lists(named, max_size=2).map(tuple),
        tool_choice=st.none() | st.sampled_from(["auto", "none", "required"]) | named,
        parallel_tool_calls=st.none() | st.booleans(),
        reasoning_effort=st.none() | st.sampled_from(["none", "low", "high"]),
        draft=st.none() | st.sampled_from(DRAFTS),
        model=st.none() | texts,
    )
    return parts.flatmap(
        lambda spec: st.one_of(
            messages.map(lambda m: RequestSpec(m, None, *_rest(spec))),
            texts.map(lambda p: RequestSpec((), p, *_rest(spec))),
        )
    )


def _rest(spec: RequestSpec) -> tuple[Any, ...]:
    """`spec`'s fields after messages and prompt, in order."""
    return (
        spec.sampling,
        spec.stops,
        spec.response_format,
        spec.tools,
        spec.tool_choice,
        spec.parallel_tool_calls,
        spec.reasoning_effort,
        spec.draft,
        spec.model,
    )


@settings(max_examples=200, deadline=None)
@given(requests(wire=False))
def test_to_wire_and_spec_of_are_inverses_through_json(spec: RequestSpec) -> None:
    body = to_wire(spec)
    sent = json.loads(json.dumps(body, ensure_ascii=False))
    assert spec_of(body) == spec_of(sent) == spec
    assert to_wire(spec_of(sent)) == sent == body
    assert body[USAGE_FIELD] is True and body["stream_options"] == {"include_usage": True}
    assert spec.path == (TEXT_PATH if spec.prompt is not None else CHAT_PATH)


@settings(max_examples=100, deadline=None)
@given(requests(wire=True))
def test_the_server_reads_a_spec_s_body_as_the_spec_says(spec: RequestSpec) -> None:
    from mlxcache.server.prepare import spec_from
    from mlxcache.server.schemas import ChatRequest, CompletionRequest

    body = to_wire(spec)
    if spec.prompt is None:
        body["messages"] = body["messages"] or [{"role": "user", "content": ""}]
    read = (CompletionRequest if spec.prompt is not None else ChatRequest).model_validate(body)
    # The server's own settings, all unlike the spec's: none of them may show through.
    defaults = SamplingParams(temperature=7.0, seed=99, max_tokens=3, top_k=5, min_p=0.5)
    stated = spec if spec.prompt is not None else replace(spec, messages=tuple(body["messages"]))
    assert spec_from(read, defaults) == stated


def test_a_body_s_aliases_are_read_as_the_spec_s_fields() -> None:
    """OpenAI's newer `max_completion_tokens` wins over `max_tokens`, `top_p` 0 is the
    most likely token, empty stops are none; what a body leaves out is the defaults'."""
    defaults = SamplingParams(temperature=0.7, seed=5)
    body = {"max_tokens": 9, "max_completion_tokens": 4, "top_p": 0, "stop": ["", "x"]}
    read = spec_of(body, defaults)
    assert read.sampling == SamplingParams(max_tokens=4, top_p=1.0, temperature=0.0, seed=5)
    assert read.stops == ("x",) and spec_of({"stop": ""}).stops == ()
    assert spec_of({}, defaults).sampling == defaults


def test_a_setting_no_request_carries_is_refused_by_name() -> None:
    with pytest.raises(UserInputError) as caught:
        to_wire(RequestSpec(sampling=SamplingParams(repetition_context=5)))
    assert settings_named(caught.value) == ("repetition_context",)
    assert str(caught.value) == "repetition_context runs in-process only (no request sets it)"


def test_a_spec_is_messages_or_a_prompt() -> None:
    with pytest.raises(ValueError, match="not both"):
        RequestSpec(({"role": "user", "content": "hi"},), "hi")


# -- what a command's options become through a server ------------------------------------

SENT = {
    "prompt": "messages",
    "--prompt-file": "messages",
    "--system": "messages",
    "--instructions": "messages",
    "--messages": "messages",
    "--tool-result": "messages",
    "--raw": "prompt",
    "--schema": "response_format",
    "--tools": "tools",
    "--tool-choice": "tool_choice",
    "--parallel": "parallel_tool_calls",
    "--stop": "stops",
    "--draft": "draft",
}
"""Options a command puts in its spec -> the spec's field (the sampling table's flags too)."""
MATCHED = {"--model", "--adapter-path", "--chat-template", "--chat-template-args"}
MATCHED |= {"--block-size", "--no-cache", "--kv-bits", "--kv-group-size"}
"""Options the server must have as the command would (`cli/remote.connect`: else refused)."""
SERVERS = {"--cache-dir", "--cache-mem", "--cache-disk", "--state-stride", "--mem-limit"}
SERVERS |= {"--warm-ahead", "--split", "--draft-tokens", "--draft-ngram"}
"""Options whose server's own value is used: none changes a reply's tokens."""
LOCAL = {"--json", "--quiet", "--server", "--force", "--concurrency"}
LOCAL |= {"--resume", "--list", "--markdown"}
"""How the command shows the reply, or keeps a chat's session (on this machine)."""
SENDING = ("generate", "json", "tools", "chat", "cache stats")


def _flags(command: str) -> list[str]:
    import typer.main

    from mlxcache_cli.main import app

    found: Any = typer.main.get_command(app)
    for word in command.split():
        found = found.commands[word]
    return [max(p.opts, key=len) for p in found.params]


@pytest.mark.parametrize("command", SENDING)
def test_every_option_is_sent_matched_the_server_s_local_or_in_process_only(
    command: str,
) -> None:
    """A new option fails here until it is put in the spec or in `IN_PROCESS_ONLY` (or
    is shown to change no reply)."""
    from mlxcache.request_spec import IN_PROCESS_ONLY

    settings = {row.flag for row in request_settings.SAMPLING}
    for flag in _flags(command):
        homes = [
            name
            for name, home in [
                ("sampling", settings),
                ("sent", SENT),
                ("matched", MATCHED),
                ("server's", SERVERS),
                ("local", LOCAL),
                ("in-process only", IN_PROCESS_ONLY),
            ]
            if flag in home
        ]
        assert len(homes) == 1, (command, flag, homes)


def test_each_option_sent_reaches_the_body_and_each_in_process_only_one_is_used() -> None:
    from mlxcache.prepare import Local
    from mlxcache.request_spec import IN_PROCESS_ONLY

    values = {
        "messages": ({"role": "user", "content": "hi"},),
        "prompt": "hi",
        "response_format": {"type": "json_object"},
        "tools": ({"type": "function", "function": {"name": "f"}},),
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "stops": ("x",),
        "draft": "off",
    }
    plain = to_wire(RequestSpec())
    for field in set(SENT.values()):
        assert to_wire(RequestSpec(**{field: values[field]})) != plain, field
    every = {flag for command in SENDING for flag in _flags(command)}
    assert every >= IN_PROCESS_ONLY  # no stale entry
    local = {f"--{name.replace('_', '-')}" for name in Local.__dataclass_fields__}
    assert local <= IN_PROCESS_ONLY  # what only an in-process request takes is refused


TOOL = '[{"type": "function", "function": {"name": "f"}}]'


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["json", "x", "--input", "in.jsonl", "-o", "out.jsonl"], "--input"),
        (["json", "x", "-o", "out.jsonl"], "--output"),
        (["json", "x", "--strict"], "--strict"),
        (["json", "x", "--allow-extra-keys"], "--allow-extra-keys"),
        (["json", "x", "--think-budget", "5"], "--think-budget"),
        (["tools", "x", "--tools", TOOL, "--think"], "--think"),
        (["generate", "x", "--draft-model", "small.gguf"], "--draft-model"),
        (["chat", "--draft-inexact"], "--draft-inexact"),
        (["cache", "stats", "--check"], "--check"),
    ],
)
def test_each_in_process_only_option_is_refused_before_connecting(
    args: list[str], flag: str
) -> None:
    from typer.testing import CliRunner

    from mlxcache_cli.main import app

    out = CliRunner().invoke(app, [*args, "--server", "http://127.0.0.1:9"])
    assert (out.exit_code, out.stdout) == (2, "")
    assert (
        out.stderr
        == f"error: {flag} runs in-process only: drop --server (or unset $MLXCACHE_SERVER)\n"
    )

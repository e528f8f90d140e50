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

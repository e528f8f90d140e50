"""The server's pure pieces: streamed tool-reply content, OpenAI objects, error bodies, log lines."""

from __future__ import annotations

import json
import random

import pytest
from pydantic import ValidationError

from mlxcache.errors import (
    ContextLengthError,
    GrammarError,
    OutputError,
    Setting,
    SettingError,
    UserInputError,
    Worded,
)
from mlxcache.modes import reasoning as reasoning_module
from mlxcache.modes.call_stream import CallDelta, CallsSent
from mlxcache.modes.reasoning import Thinking, split_reply
from mlxcache.modes.tools import ToolCall
from mlxcache.sampling import SamplingParams
from mlxcache.server import errors
from mlxcache.server import text as text_module
from mlxcache.server.log import line
from mlxcache.server.openai_format import SSE_DONE, Envelope, Usage, sse
from mlxcache.server.schemas import ChatRequest
from mlxcache.server.text import ReplyText
from mlxcache.stops import partial_marker


def feed(reply: ReplyText, pieces: list[str]) -> list[str]:
    """What a stream would send after each piece."""
    sent, out = "", []
    for piece in pieces:
        reply.add(piece)
        safe = reply.safe()
        assert safe.startswith(sent)
        out.append(safe[len(sent) :])
        sent = safe
    return out


def test_tool_replies_stream_stripped_content_before_the_call_tag() -> None:
    reply = ReplyText("<tool_call>", strip=True)
    assert feed(reply, ["  Hi", " there ", "<tool", "_call>\n{", "}"]) == [
        "Hi",
        " there",
        "",
        "",
        "",
    ]
    assert reply.text == "  Hi there <tool_call>\n{}"


def test_sse_and_chat_objects() -> None:
    env = Envelope("chatcmpl-abc", "m", created=7)
    usage = Usage(10, 3, 8)
    calls = (ToolCall("f", {"x": 1}),)
    body = env.chat("", calls, "tool_calls", usage)
    assert body == {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_abc_0",
                            "type": "function",
                            "function": {"name": "f", "arguments": '{"x": 1}'},
                        }
                    ],
                },
                "logprobs": None,
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 8},
        },
    }
    # A call sent whole (one the reply's format cannot stream): its entry, as in the reply.
    [whole] = CallsSent().rest(calls)
    assert env.call_delta(whole) == {"index": 0, **body["choices"][0]["message"]["tool_calls"][0]}
    more = CallDelta(0, None, ', "y": 2}')
    assert env.call_delta(more) == {"index": 0, "function": {"arguments": ', "y": 2}'}}
    assert sse({"a": "é"}) == 'data: {"a": "é"}\n\n'
    assert SSE_DONE == "data: [DONE]\n\n"


def test_domain_errors_map_to_openai_errors() -> None:
    ctx = errors.from_domain(ContextLengthError("the prompt has 300 tokens; the context is 256"))
    assert (ctx.status, ctx.code, ctx.type) == (
        400,
        "context_length_exceeded",
        "invalid_request_error",
    )
    bad = errors.from_domain(GrammarError("schema is not valid\n  at /x"))
    assert (bad.status, bad.message) == (400, "schema is not valid at /x")
    assert errors.from_domain(OutputError("boom")).status == 500
    full = errors.queue_full("")
    assert full.status == 429 and full.headers == {"Retry-After": "1"}
    assert set(full.body()["error"]) == {"message", "type", "param", "code"}


def test_a_library_error_naming_a_setting_points_at_its_request_field() -> None:
    with pytest.raises(SettingError) as bad:
        SamplingParams(top_p=0.0)
    top_p = errors.from_domain(bad.value)
    assert (top_p.status, top_p.param, top_p.message) == (
        400,
        "top_p",
        "top_p must be in (0, 1], got 0.0",
    )
    strict = Worded("a schema (", Setting("strict", "leave strict mode"), ")")
    grammar = errors.from_domain(GrammarError(strict))
    assert (grammar.param, grammar.message) == ("response_format", "a schema (leave strict mode)")
    unnamed = errors.from_domain(UserInputError("raise max_tokens"))  # prose: no field
    assert unnamed.param is None


def _validation(body: object) -> errors.APIError:
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate(body)
    return errors.from_validation(info.value.errors())


def test_validation_errors_name_the_field() -> None:
    err = _validation(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}
    )
    assert (err.status, err.param) == (400, "max_tokens")
    assert err.message.startswith("max_tokens: ")
    err = _validation({"model": "m", "messages": [{"role": "pirate", "content": "x"}]})
    assert err.param == "messages.0.role"
    err = _validation({"model": "m", "messages": []})
    assert err.param == "messages"


def test_content_parts_join() -> None:
    req = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
            "stop": "x",
        }
    )
    assert req.messages[0].text() == "ab" and req.stops() == ("x",)


def test_log_line() -> None:
    record = {
        "id": "chatcmpl-1",
        "method": "POST",
        "path": "/v1/chat/completions",
        "status": 200,
        "prompt_tokens": 37,
        "cached_tokens": 32,
        "generated_tokens": 7,
        "ttft_s": 0.8213,
        "total_s": 1.9,
        "finish_reason": "stop",
    }
    assert line(record) == (
        "chatcmpl-1 POST /v1/chat/completions 200 prompt=37 cached=32 generated=7 "
        "ttft=0.821s total=1.900s finish=stop"
    )
    json.dumps(record)


def feed_both(reply: ReplyText, pieces: list[str]) -> tuple[str, str]:
    """The reasoning and content a stream sends, each checked to only ever grow."""
    sent = {"reasoning": "", "content": ""}
    for piece in pieces:
        reply.add(piece)
        for key, now in (("reasoning", reply.safe_reasoning()), ("content", reply.safe())):
            assert now.startswith(sent[key]), (key, reply.text)
            sent[key] = now
    return sent["reasoning"], sent["content"]


QWEN = Thinking("<think>", "</think>", enabled=True)
R1 = Thinking("<think>", "</think>", enabled=True, opened=True)


@pytest.mark.parametrize(
    ("thinking", "text", "final"),
    [
        (QWEN, "<think>\nplan it\n</think>\n\nHello there ", ("plan it", "Hello there ")),
        (QWEN, "<think>\n\n</think>\n\nHi", ("", "Hi")),  # an empty section
        (QWEN, "<think>cut off in </thi", ("cut off in </thi", "")),  # all reasoning
        (QWEN, "Hi <think>x</think>", (None, "Hi <think>x</think>")),  # not at the start
        (QWEN, "<b>bold</b>", (None, "<b>bold</b>")),
        (QWEN, "", (None, "")),
        (R1, "plan</think>answer", ("plan", "answer")),
        (R1, "<think>x</think>y", ("<think>x", "y")),
    ],
)
def test_reasoning_streams_apart_and_joins_to_the_final_split(
    thinking: Thinking, text: str, final: tuple[str | None, str]
) -> None:
    assert thinking.split(text) == final
    for size in (1, 2, 3, 7):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        reasoning, content = feed_both(ReplyText(thinking=thinking), pieces)
        # The rest goes in the last chunk, once the reply is done.
        assert (final[0] or "").startswith(reasoning) and final[1].startswith(content)
    streamed = feed_both(ReplyText(thinking=QWEN), list("<think>\nplan it\n</think>\n\nHi "))
    assert streamed == ("plan it", "Hi ")  # decided as soon as the end tag is whole
    assert ReplyText().safe() == "" and ReplyText(thinking=QWEN).safe_reasoning() == ""
    opening = ReplyText(thinking=QWEN)
    opening.add("<thi")  # may still open the section: nothing is final
    assert (opening.safe_reasoning(), opening.safe()) == ("", "")


def test_a_chat_reply_carries_its_reasoning_only_when_there_is_some() -> None:
    env = Envelope("chatcmpl-abc", "m", created=7)
    usage = Usage(1, 1, 0)
    thought = env.chat("4", (), "stop", usage, "two and two")["choices"][0]["message"]
    assert thought == {"role": "assistant", "content": "4", "reasoning": "two and two"}
    for none in (None, ""):
        message = env.chat("4", (), "stop", usage, none)["choices"][0]["message"]
        assert message == {"role": "assistant", "content": "4"}


def settled(text: str, call_tag: str | None, strip: bool, thinking: Thinking | None) -> tuple:
    """What no later text can change, computed from the whole text at once (the definition
    the incremental `ReplyText` must match)."""
    reasoning, content = split_reply(thinking, text, final=False)
    if call_tag is not None:
        cut = content.find(call_tag)
        content = (
            content[:cut]
            if cut >= 0
            else content[: len(content) - partial_marker(content, call_tag)]
        )
    return reasoning or "", content.strip() if strip else content


SHAPES = [
    (None, False, None),
    ("<tool_call>", True, None),
    ("\n<tool_call>", False, QWEN),  # a tag starting with whitespace, after a section
    (None, False, QWEN),
    (None, True, R1),
    (None, False, Thinking("<think>", "</think>", enabled=False)),
]


@pytest.mark.parametrize(("call_tag", "strip", "thinking"), SHAPES)
def test_streamed_reply_text_equals_the_whole_text_split_after_every_piece(
    call_tag: str | None, strip: bool, thinking: Thinking | None
) -> None:
    rng = random.Random(7)
    alphabet = ["<think>", "</think>", "<tool_call>", "<", "</", "think", ">", " ", "\n", "a", "é"]
    for _ in range(150):
        pieces = [rng.choice(alphabet)[: rng.randint(1, 8)] for _ in range(rng.randint(0, 25))]
        reply = ReplyText(call_tag, strip, thinking)
        sent = ["", ""]
        for i, piece in enumerate(pieces):
            deltas = reply.add(piece)
            sent = [s + d for s, d in zip(sent, deltas, strict=True)]
            assert tuple(sent) == settled("".join(pieces[: i + 1]), call_tag, strip, thinking)
        assert reply.text == "".join(pieces)


@pytest.mark.parametrize(("call_tag", "strip", "thinking"), SHAPES)
def test_reply_text_work_per_piece_does_not_grow_with_the_reply(
    monkeypatch: pytest.MonkeyPatch,
    call_tag: str | None,
    strip: bool,
    thinking: Thinking | None,
) -> None:
    """Every character is scanned a bounded number of times: the text given to the tag
    and whitespace scans over a 3,000-piece reply stays linear in its length."""
    scanned = [0]

    def counting(text: str, marker: str) -> int:
        scanned[0] += len(text)
        return partial_marker(text, marker)

    monkeypatch.setattr(text_module, "partial_marker", counting)
    monkeypatch.setattr(reasoning_module, "partial_marker", counting)
    pieces = ["<think>", *(["word ", "<", "\n  "] * 1000)]
    reply = ReplyText(call_tag, strip, thinking)
    streamed = ["", ""]
    for piece in pieces:
        streamed = [s + d for s, d in zip(streamed, reply.add(piece), strict=True)]
    total = sum(map(len, pieces))
    assert tuple(streamed) == settled("".join(pieces), call_tag, strip, thinking)
    assert scanned[0] <= 4 * total  # the whole-text split scanned ~n²/2 (~2·10⁷ here)

"""Reasoning templates: json and tools think first (bounded) or not, reasoning kept apart."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from cli_run import unloadable
from grammar_accepts import accepts
from tinymodel import write_tiny_gguf
from typer.testing import CliRunner

from mlxcache.engine import Engine, Request
from mlxcache.errors import UserInputError
from mlxcache.events import Result, Stats
from mlxcache.model import LoadedModel
from mlxcache.modes.batch import read_input
from mlxcache.modes.json_mode import JsonTask, plan_batch, read_reply, request
from mlxcache.modes.reasoning import Thinking, ThinkingBudget, thinking_for
from mlxcache.modes.tool_chat import ToolsTask
from mlxcache.modes.tools import ToolCall, ToolChoice, parse_tools
from mlxcache.sampling import SamplingParams
from mlxcache.server import prepare
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.server.schemas import ChatRequest
from mlxcache.worker import EngineWorker
from mlxcache_cli import ui
from mlxcache_cli.main import app

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
)
# Qwen3 style: thinking is the reply's own; turned off, the prompt carries an empty section.
QWEN3 = CHATML + (
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# DeepSeek-R1 style: the prompt opens the section, the reply continues inside it.
OPENS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('</think>')[-1] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% endif %}{% endif %}"
)
# DeepSeek-R1 style, whatever `enable_thinking` says (the server leaves it to mlx-lm).
ALWAYS_OPENS = OPENS.replace("{% if enable_thinking %}<think>\n{% endif %}", "<think>\n")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = parse_tools([{"name": "ping", "parameters": {"type": "object", "properties": {}}}])


@pytest.fixture
def wearing(request: pytest.FixtureRequest, wide: LoadedModel) -> Iterator[LoadedModel]:
    """The wide tiny model with the template `request.param` (restored afterwards)."""
    hf = wide.tokenizer._tokenizer
    saved = hf.chat_template
    hf.chat_template = request.param
    try:
        yield wide
    finally:
        hf.chat_template = saved


def result(text: str, finish: str = "stop") -> Result:
    return Result(text, [], finish, Stats(generated_tokens=9))


def test_a_template_without_thinking(tiny: LoadedModel) -> None:
    assert thinking_for(tiny.tokenizer, False) is None
    assert thinking_for(tiny.tokenizer, None) is None
    with pytest.raises(UserInputError, match=r"^think: this model's chat template has no thinking"):
        thinking_for(tiny.tokenizer, True)


@pytest.mark.parametrize("wearing", [QWEN3], indirect=True)
def test_no_think_turns_it_off_through_the_template(wearing: LoadedModel) -> None:
    task = JsonTask.create(SCHEMA).for_model(wearing.tokenizer, False)
    assert task.thinking == Thinking("<think>", "</think>", enabled=False)
    assert task.grammar == task.compiled.grammar  # the answer comes first
    engine = Engine(wearing)
    ids = engine.encoder.encode_chat(task.messages("hi"), **task.template_kwargs)
    assert wearing.tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = read_reply(task, result('{"a": 1}'))
    assert plain.output == {"a": 1} and plain.reasoning is None
    assert "reasoning" not in plain.as_dict()


@pytest.mark.parametrize("wearing", [QWEN3], indirect=True)
def test_think_allows_a_bounded_section_before_the_answer(wearing: LoadedModel) -> None:
    task = JsonTask.create(SCHEMA).for_model(wearing.tokenizer, True)
    assert task.thinking == Thinking("<think>", "</think>", enabled=True)
    assert accepts(wearing, task.grammar, '<think>a is one</think>\n\n{"a": 1}')
    assert accepts(wearing, task.grammar, '{"a": 1}')  # thinking is allowed, not required
    assert not accepts(wearing, task.grammar, 'Sure: {"a": 1}')
    assert accepts(wearing, task.grammar, "<think>" + "hm " * 2000 + '</think>{"a": 1}')
    assert not accepts(wearing, task.grammar, '<think>a</think>{"a": 1}</think>')
    reply = read_reply(task, result('<think>a is one</think>\n\n{"a": 1}'))
    assert (reply.output, reply.reasoning, reply.text) == ({"a": 1}, "a is one", '{"a": 1}')
    assert reply.as_dict()["reasoning"] == "a is one"
    bad = read_reply(task, result('<think>hm</think>{"a": "x"}'))
    assert bad.error is not None and bad.text == '<think>hm</think>{"a": "x"}'  # raw text kept
    assert bad.reasoning == "hm"
    # A random model under the grammar: a valid answer, whatever it thinks first.
    engine = Engine(wearing)
    ids = engine.encoder.encode_chat(task.messages("hi"), **task.template_kwargs)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=120)
    done = read_reply(task, engine.complete(request(engine, ids, task, params)))
    assert done.error is None and isinstance(done.output, dict), done


@pytest.mark.parametrize("wearing", [OPENS], indirect=True)
def test_a_section_opened_by_the_prompt_is_closed_first(wearing: LoadedModel) -> None:
    task = JsonTask.create(SCHEMA).for_model(wearing.tokenizer, True)
    assert task.thinking == Thinking("<think>", "</think>", enabled=True, opened=True)
    assert accepts(wearing, task.grammar, 'plan</think>\n{"a": 2}')
    assert not accepts(wearing, task.grammar, '{"a": 2}')
    reply = read_reply(task, result('plan</think>\n{"a": 2}'))
    assert (reply.output, reply.reasoning) == ({"a": 2}, "plan")


@pytest.mark.parametrize("wearing", [QWEN3], indirect=True)
def test_tools_think_first_and_keep_reasoning_apart(wearing: LoadedModel) -> None:
    engine = Engine(wearing)
    task = ToolsTask(TOOLS, ToolChoice("required"), think=True)
    ids = task.encode(engine, [{"role": "user", "content": "ping?"}])
    assert task.style is not None and task.style.thinking is not None
    assert not wearing.tokenizer.decode(ids).endswith("</think>\n\n")  # thinking left on
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert accepts(wearing, task.style.grammar, "<think>ping it</think>\n" + call)
    assert not accepts(wearing, task.style.grammar, "<think>ping it</think>\nno call")
    reply = task.read(result("<think>ping it</think>\n" + call))
    assert reply.reasoning == "ping it" and reply.calls == (ToolCall("ping", {}),)
    assert reply.content == "" and reply.error is None
    budget = task.request(engine, ids, SamplingParams(max_tokens=50)).processors[-1]
    assert isinstance(budget, ThinkingBudget) and budget.budget == 25
    off = ToolsTask(TOOLS, ToolChoice("required"))  # the default: no thinking
    off_ids = off.encode(engine, [{"role": "user", "content": "ping?"}])
    assert wearing.tokenizer.decode(off_ids).endswith("</think>\n\n")


def test_cli_think_needs_a_thinking_section(cache_root: Path, tiny_gguf: Path) -> None:
    schema = json.dumps(SCHEMA)
    args = ["json", "hi", "--schema", schema, "-m", str(tiny_gguf), "--think"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        "error: --think: this model's chat template has no thinking section"
    )


def test_the_budget_closes_an_open_section_and_nothing_else(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    budget = ThinkingBudget(Thinking("<think>", "</think>", enabled=True), tok, 3)
    logits = mx.zeros((1, 262))
    prompt = [5, 6, 7]

    def allowed(reply: str, given: mx.array = logits) -> str | None:
        """The one token the budget forces after `reply` (decoded), None: all left alone."""
        ids = [*prompt, *tok.encode(reply, add_special_tokens=False)]
        out = np.asarray(budget(mx.array(ids), given))
        if np.array_equal(out, np.asarray(given)):
            return None
        kept = np.flatnonzero(np.isfinite(out.reshape(-1)))
        assert kept.size == 1
        return str(tok.decode([int(kept[0])]))

    assert allowed("") is None  # the first call sees the prompt
    assert allowed("<th") is None  # 3 tokens, but the section is not open yet
    assert allowed("<think>ab") == "<"  # open, over budget: the end tag, token by token
    assert allowed("<think>ab</thi") == "n"
    blocked = mx.where(mx.arange(262) == tok.encode("k", add_special_tokens=False)[0], -mx.inf, 0)
    assert allowed("<think>ab</thin", blocked[None]) is None  # the grammar has the last word
    assert budget.forced == 2
    assert allowed("<think>ab</think>") is None  # closed: nothing more, ever
    assert allowed("<think>ab</think>x <think>x") is None
    no_section = ThinkingBudget(Thinking("<think>", "</think>", enabled=True), tok, 0)
    no_section(mx.array(prompt), logits)
    assert np.isfinite(np.asarray(no_section(mx.array([*prompt, 123]), logits))).all()
    opened = ThinkingBudget(Thinking("<think>", "</think>", True, opened=True), tok, 1)
    opened(mx.array(prompt), logits)
    out = opened(mx.array([*prompt, *tok.encode("ab", add_special_tokens=False)]), logits)
    assert np.flatnonzero(np.isfinite(np.asarray(out).reshape(-1))).tolist() == tok.encode(
        "<", add_special_tokens=False
    )


@pytest.mark.parametrize("wearing", [OPENS], indirect=True)
def test_a_reply_thinks_for_its_budget_then_answers(wearing: LoadedModel) -> None:
    tok = wearing.tokenizer
    tag = tok.encode("</think>", add_special_tokens=False)
    engine = Engine(wearing)
    for think_budget, max_tokens, spent in ((6, 120, 6), (None, 40, 20)):  # default: half
        task = JsonTask.create(SCHEMA).for_model(tok, True, think_budget)
        ids = engine.encoder.encode_chat(task.messages("hi"), **task.template_kwargs)
        params = SamplingParams(temperature=1.0, seed=2, max_tokens=max_tokens)
        req = request(engine, ids, task, params)
        done = engine.complete(req)
        # The tag comes as soon as the character in progress is whole (the grammar's say).
        free = next(
            i
            for i in range(spent, max_tokens)
            if not tok.decode(done.tokens[:i]).endswith("\ufffd")
        )
        assert free > spent  # this seed leaves a character half-written at the budget
        assert "</think>" not in tok.decode(done.tokens[:free])
        assert done.tokens[free : free + len(tag)] == tag
        assert req.processors[-1].forced == len(tag)  # type: ignore[attr-defined]
        if think_budget is not None:
            reply = read_reply(task, done)
            assert reply.error is None and isinstance(reply.output["a"], int)
            assert reply.reasoning == tok.decode(done.tokens[:free]).strip()


def test_cli_think_budget_goes_with_think(cache_root: Path, tiny_gguf: Path) -> None:
    schema = json.dumps(SCHEMA)
    args = ["json", "hi", "--schema", schema, "-m", str(tiny_gguf), "--think-budget", "9"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == "error: --think-budget goes with --think"


def test_cli_plain_output_shows_the_thinking_on_stderr(cache_root: Path, tmp_path: Path) -> None:
    model = tmp_path / "thinker.gguf"
    write_tiny_gguf(model, context=1024, template=OPENS)
    args = ["json", "hi", "--schema", json.dumps(SCHEMA), "-m", str(model), "--think"]
    sampled = ["--temp", "1", "--seed", "2", "-n", "120", "--think-budget", "6"]
    plain = CliRunner().invoke(app, [*args, *sampled])
    as_json = CliRunner().invoke(app, [*args, *sampled, "--json"])
    assert plain.exit_code == 0 and as_json.exit_code == 0, plain.stderr
    doc = json.loads(as_json.stdout)
    assert plain.stdout == json.dumps(doc["output"]) + "\n"  # the answer alone
    assert plain.stderr.startswith(f"thinking: {doc['reasoning']}\n") and doc["reasoning"]


def post(app: Any, body: dict[str, Any]) -> bytes:
    """POST /v1/chat/completions straight to the ASGI app; the whole response body."""
    sent: list[dict[str, Any]] = []
    incoming = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop(0)
        await asyncio.Event().wait()  # the client stays until the reply is complete
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    asyncio.run(app({**scope, "query_string": b""}, receive, send))
    assert next(m for m in sent if m["type"] == "http.response.start")["status"] == 200
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize("wearing", [ALWAYS_OPENS], indirect=True)
def test_the_server_sends_the_thinking_apart(wearing: LoadedModel) -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"model": wearing.name, "messages": messages, "max_tokens": 12}
    engine = Engine(wearing, warm_ahead=False)
    with EngineWorker(engine) as worker:
        app = create_app(engine, worker, Settings(wearing.name), RequestLog(stream=io.StringIO()))
        plain = json.loads(post(app, body))["choices"][0]["message"]
        chunks = [
            json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
            for line in post(app, {**body, "stream": True}).decode().splitlines()
            if line.startswith("data: {")
        ]
    cold = engine.complete(
        Request(engine.encoder.encode_chat(messages), SamplingParams(max_tokens=12))
    )
    # The prompt opens the section and this random model never closes it: all reasoning.
    assert plain == {"role": "assistant", "content": "", "reasoning": cold.text.strip()}
    assert "".join(c.get("reasoning", "") for c in chunks) == cold.text.strip()
    assert "".join(c.get("content", "") for c in chunks) == ""


class OneTokenTag:
    """A tokenizer whose `</think>` is one token (300), as Qwen3's; other text: a token a
    character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        head, tag, tail = text.partition("</think>")
        return [*map(ord, head), *([300] if tag else []), *(self.encode(tail) if tail else [])]

    def decode(self, ids: list[int]) -> str:
        return "".join("</think>" if i == 300 else chr(i) for i in ids)


def test_a_one_token_tag_is_forced_whole_and_never_inside_a_character(tiny: LoadedModel) -> None:
    logits = mx.zeros((1, 400))
    tok = OneTokenTag()
    budget = ThinkingBudget(Thinking("<think>", "</think>", True, opened=True), tok, 2)
    budget(mx.array([1, 2]), logits)

    def forced(reply: list[int]) -> list[int]:
        out = np.asarray(budget(mx.array([1, 2, *reply]), logits)).reshape(-1)
        return np.flatnonzero(np.isfinite(out)).tolist()

    assert forced([ord("a"), 0xFFFD]) == list(range(400))  # a character half-written waits
    assert forced([ord("a"), ord("<")]) == [300]  # the tag's own token, even after a "<"
    assert budget.forced == 1
    # The tiny byte-level tokenizer: a character's first byte waits for the rest.
    byte_budget = ThinkingBudget(
        Thinking("<think>", "</think>", True, opened=True), tiny.tokenizer, 1
    )
    byte_budget(mx.array([5]), mx.zeros((1, 262)))
    first_byte = tiny.tokenizer.encode("é", add_special_tokens=False)[:1]
    out = byte_budget(mx.array([5, *first_byte]), mx.zeros((1, 262)))
    assert np.isfinite(np.asarray(out)).all() and byte_budget.forced == 0


def test_the_default_budget_is_half_of_what_the_context_leaves(tiny: LoadedModel) -> None:
    engine = Engine(tiny)  # context 256
    thinking = Thinking("<think>", "</think>", True, opened=True)
    task = replace(JsonTask.create(SCHEMA), thinking=thinking)
    assert engine.encoder.reply_room(list(range(250)), 50) == 6
    far = request(engine, list(range(3, 20)), task, SamplingParams(max_tokens=50))
    near = request(engine, list(range(250)), task, SamplingParams(max_tokens=50))
    assert [r.processors[-1].budget for r in (far, near)] == [25, 3]  # type: ignore[attr-defined]


def test_cli_think_budget_is_checked_before_the_model_loads(tmp_path: Path) -> None:
    model = unloadable(tmp_path)
    base = ["json", "hi", "--schema", json.dumps(SCHEMA), "-m", str(model)]
    for extra, message in (
        (["--think-budget", "9"], "--think-budget goes with --think"),
        (
            ["--think", "--think-budget", "9", "-n", "9"],
            "--think-budget 9 leaves no room for the answer in --max-tokens 9",
        ),
    ):
        result = CliRunner().invoke(app, [*base, *extra])
        assert (result.exit_code, result.stderr.strip()) == (2, f"error: {message}")


def test_a_batch_rerun_with_other_thinking_is_another_run(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n')
    lines = read_input(tmp_path / "in.jsonl")
    engine, task = Engine(tiny), JsonTask.create(SCHEMA)
    thinking = Thinking("<think>", "</think>", True, opened=True)
    runs = [
        plan_batch(
            engine, t, lines, tmp_path / "in.jsonl", tmp_path / "o.jsonl", SamplingParams()
        ).run
        for t in (
            task,
            replace(task, thinking=thinking),
            replace(task, thinking=replace(thinking, budget=5)),
        )
    ]
    assert runs[0]["thinking"] is None and len({json.dumps(r) for r in runs}) == 3


def test_long_thinking_goes_to_stderr_on_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    thought = " ".join(["a long thought"] * 20)  # wider than any terminal default
    ui.thought(thought)
    ui.thought("")  # nothing to show
    assert capsys.readouterr() == ("", f"thinking: {thought}\n")


@pytest.mark.parametrize("wearing", [QWEN3, ALWAYS_OPENS], indirect=True)
def test_server_json_thinks_as_json_mode_does_by_default(wearing: LoadedModel) -> None:
    engine = Engine(wearing)
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "hi"}]
    body = ChatRequest.model_validate({"model": "m", "messages": messages, "response_format": fmt})
    plan = prepare.chat(engine, body, SamplingParams(max_tokens=40))
    task = JsonTask.create(SCHEMA).for_model(wearing.tokenizer, False)  # `mlxcache json`
    ids = engine.encoder.encode_chat([task.messages("")[0], *messages], **task.template_kwargs)
    assert plan.ids == ids
    if wearing.tokenizer._tokenizer.chat_template == QWEN3:  # asked not to think: it does not
        assert wearing.tokenizer.decode(ids).endswith("<think>\n\n</think>\n\n")
        assert plan.thinking is None and len(plan.request.processors) == 1
    else:  # the template opens the section anyway: bounded, and apart in the answer
        assert plan.thinking is not None and plan.thinking.opened
        assert isinstance(plan.request.processors[-1], ThinkingBudget)
        answer = plan.answer('plan</think>\n{"a": 1}', "stop")
        assert (answer.reasoning, answer.content) == ("plan", '{"a": 1}')


@pytest.mark.parametrize("wearing", [QWEN3], indirect=True)
def test_reasoning_effort_turns_a_templates_thinking_off_or_on(wearing: LoadedModel) -> None:
    """On a template with a thinking section, `none`/`minimal` render the prompt as
    `enable_thinking=False` does and every other level as `True`, for plain chat, JSON and
    tools alike; nothing is named as ignored but `verbosity`."""
    engine = Engine(wearing)
    messages = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    ping = {"name": "ping", "parameters": {"type": "object", "properties": {}}}
    tools = [{"type": "function", "function": ping}]

    def plan(effort: str, **more: Any) -> prepare.Plan:
        fields = {"model": "m", "messages": messages, "reasoning_effort": effort, **more}
        return prepare.chat(engine, ChatRequest.model_validate(fields), SamplingParams())

    for effort, think in (("none", False), ("minimal", False), ("low", True), ("xhigh", True)):
        assert plan(effort).ids == engine.encoder.encode_chat(messages, enable_thinking=think)
        task = JsonTask.create(SCHEMA).for_model(wearing.tokenizer, think)
        rendered = [task.messages("")[0], *messages]
        assert plan(effort, response_format=fmt).ids == engine.encoder.encode_chat(
            rendered, **task.template_kwargs
        )
        tools_task = ToolsTask(TOOLS, ToolChoice("auto"), None, True, think)
        tools_task.style_for(engine)
        assert plan(effort, tools=tools).ids == tools_task.encode(engine, messages)
        assert plan(effort).ignored == ()
        assert plan(effort, verbosity="high").ignored == ("verbosity",)
    assert wearing.tokenizer.decode(plan("none").ids).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("wearing", [OPENS], indirect=True)
def test_a_tool_reply_s_thinking_is_its_reasoning_streamed_or_not(wearing: LoadedModel) -> None:
    """Tools with thinking on (`reasoning_effort`): the section is the reply's `reasoning`,
    streamed apart from the content, and the call streams after it; the streamed pieces
    join to the unstreamed reply."""
    ping = {
        "name": "ping",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    }
    # This random model pads with whitespace wherever the grammar lets it; where the grammar
    # asks for whitespace, it is the only token left and is written anyway.
    blank = [wearing.tokenizer.encode(c, add_special_tokens=False)[0] for c in " \t\n"]
    body = {
        "model": wearing.name,
        "messages": [{"role": "user", "content": "ping?"}],
        "tools": [{"type": "function", "function": ping}],
        "tool_choice": "required",
        "reasoning_effort": "high",
        "max_tokens": 160,  # the section's budget: 80 tokens; the call after it
        "logit_bias": {str(t): -100 for t in blank},
    }
    engine = Engine(wearing, warm_ahead=False)
    with EngineWorker(engine) as worker:
        app = create_app(engine, worker, Settings(wearing.name), RequestLog(stream=io.StringIO()))
        plain = json.loads(post(app, body))["choices"][0]
        deltas = [
            json.loads(line.removeprefix("data: "))["choices"][0]["delta"]
            for line in post(app, {**body, "stream": True}).decode().splitlines()
            if line.startswith("data: {")
        ]
    message = plain["message"]
    assert plain["finish_reason"] == "tool_calls" and message["reasoning"]
    assert "</think>" not in message["reasoning"] and message["content"] is None
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == ""
    [call] = message["tool_calls"]
    pieces = [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", ())]
    assert "".join(pieces) == call["function"]["arguments"] and len(pieces) > 2


@pytest.mark.parametrize("wearing", [ALWAYS_OPENS], indirect=True)
def test_messages_and_responses_carry_the_thinking_apart(wearing: LoadedModel) -> None:
    """A thinking section is Anthropic's `thinking` block and a Responses `reasoning` item,
    streamed or not: the same text as the chat completion's `reasoning`."""
    from asgi import call

    engine = Engine(wearing, warm_ahead=False)
    ask = [{"role": "user", "content": "hi"}]
    cold = engine.complete(Request(engine.encoder.encode_chat(ask), SamplingParams(max_tokens=12)))
    thought = cold.text.strip()
    with EngineWorker(engine) as worker:
        app = create_app(engine, worker, Settings(wearing.name), RequestLog(stream=io.StringIO()))
        body = {"model": wearing.name, "messages": ask, "max_tokens": 12}
        message = call(app, "POST", "/v1/messages", body).json()
        assert message["content"][0] == {"type": "thinking", "thinking": thought, "signature": ""}
        events = call(app, "POST", "/v1/messages", {**body, "stream": True}).events()
        deltas = [json.loads(e)["delta"] for e in events if '"content_block_delta"' in e]
        assert "".join(d.get("thinking", "") for d in deltas) == thought
        asked = {"model": wearing.name, "input": "hi", "max_output_tokens": 12}
        response = call(app, "POST", "/v1/responses", asked).json()
        assert response["output"][0]["summary"] == [{"type": "summary_text", "text": thought}]
        streamed = call(app, "POST", "/v1/responses", {**asked, "stream": True}).events()
        final = json.loads(streamed[-1])["response"]

        def shown(doc: dict[str, Any]) -> list[Any]:
            return [{k: v for k, v in item.items() if k != "id"} for item in doc["output"]]

        assert shown(final) == shown(response) and final["status"] == "incomplete"
        added = [json.loads(e)["item"] for e in streamed if '"response.output_item.done"' in e]
        assert added[0]["summary"] == [{"type": "summary_text", "text": thought}]

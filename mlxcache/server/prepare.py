"""From a validated request body to token ids, an engine Request, and how to read the reply.

A body is read as the spec it states (`spec_from`: `request_spec.spec_of`, the inverse of
what the `--server` client sends); the plan is built from that spec, and from the fields
only the server takes (logprobs, logit bias, verbosity). Every route's request comes this
way: Messages and Responses convert theirs to a chat completion's first (`front.Converted`).

Plain chat, JSON mode (`response_format`) and tools reuse the library's modes, so a reply
over HTTP is bitwise what `mlxcache generate` / `json` / `tools` give on the same prompt.
Everything here is plain Python (templates, tokenizer, grammar compilation): it runs on
the handler's thread; only the returned Request goes to the engine worker. Grammar work
(checking a schema, compiling its grammar: seconds for a large one, bounded by
`schema.MAX_SCHEMA_OBJECTS`) runs outside `tokenizing` (the encoder's lock, which its own
calls take too), held only where the tokenizer is called: one client's schema never
stalls another's reply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from mlx_lm.sample_utils import make_logits_processors

from mlxcache.constrain import compile_for
from mlxcache.engine import Engine, Request
from mlxcache.events import Result, Stats
from mlxcache.modes import json_mode
from mlxcache.modes.json_mode import JsonTask
from mlxcache.modes.reasoning import Thinking, has_thinking, reply_thinking, split_reply
from mlxcache.modes.tool_chat import ToolsTask, next_turn, read_messages
from mlxcache.modes.tool_chat import finish_reason as tool_finish
from mlxcache.modes.tools import ToolCall, ToolChoice, ToolReply, parse_tools
from mlxcache.request_spec import RequestSpec, spec_of
from mlxcache.sampling import SamplingParams
from mlxcache.server.errors import APIError
from mlxcache.server.logprobs import token_bytes
from mlxcache.server.schemas import (
    NEUTRAL,
    UNSUPPORTED,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
)
from mlxcache.server.text import ReplyText

_PROMPT_END = 64
"""Prompt tokens read back for an opened thinking section (the template's last words)."""
_MEDIA = {"image_url": "images are", "input_audio": "audio is", "file": "files are"}
"""A content part's type -> what the message says this model does not take."""


@dataclass(frozen=True, slots=True)
class Answer:
    """The reply as the client gets it."""

    content: str
    calls: tuple[ToolCall, ...]
    finish_reason: str
    reasoning: str | None = None


@dataclass(slots=True)
class Plan:
    """A request ready to submit, and how to turn its text into the answer."""

    ids: list[int]
    request: Request
    tools: ToolsTask | None = None
    next_turn: Callable[[Answer], list[int]] | None = None
    """The token prefix the conversation's next prompt starts with (for warm-ahead)."""
    thinking: Thinking | None = None
    """A plain chat reply's thinking section (its reasoning, apart from the content)."""
    vocab: tuple[bytes, ...] | None = None
    """Each token's bytes, when the reply's logprobs are asked for (`logprobs.Formatter`)."""
    ignored: tuple[str, ...] = ()
    """Request fields accepted that change nothing for this model (`effort`): the reply
    names them in its `IGNORED_HEADER`."""
    warm_on: Callable[[list[int]], None] | None = None
    """Queues warm-ahead on the engine of the request's model (set once it is chosen)."""

    def reply_text(self) -> ReplyText:
        if self.tools is None or self.tools.choice.mode == "none":
            return ReplyText(strip=self.tools is not None, thinking=self.thinking)
        tools = self.tools
        return ReplyText(tools.call_start, True, tools.thinking, tools.call_stream())

    def answer(self, text: str, finish_reason: str) -> Answer:
        """The final content and calls of a reply whose text is `text`."""
        if self.tools is None:
            reasoning, content = split_reply(self.thinking, text)
            return Answer(content, (), finish_reason, reasoning)
        reply = self.tools.read(Result(text, [], finish_reason, Stats()))
        finish = tool_finish(reply, finish_reason)
        return Answer(reply.content, reply.calls, finish, reply.reasoning)


def spec_from(body: SamplingFields, defaults: SamplingParams) -> RequestSpec:
    """The spec a validated request states, read as every front end reads a body
    (`request_spec.spec_of`), the server's settings filling what it leaves out.

    Raises:
        APIError: more than one choice, or more than one prompt.
        SettingError: a setting out of its range (`errors.from_domain` names its field).
    """
    if body.n != 1:
        raise APIError(400, "n must be 1 (one choice per request)", param="n", code="invalid_value")
    doc = body.model_dump(by_alias=True, exclude_none=True)
    prompt = doc.get("prompt")
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "prompt must be one string", param="prompt", code="invalid_value")
        doc["prompt"] = prompt[0]
    return spec_of(doc, defaults)


IGNORED_HEADER = "X-Mlxcache-Ignored"
"""A reply's header naming the request's fields that changed nothing (`Plan.ignored`)."""
_NO_EFFORT = ("none", "minimal")


@dataclass(frozen=True, slots=True)
class Effort:
    """What a chat request's `reasoning_effort` and `verbosity` do on this model."""

    think: bool | None
    """Ask the template to think (True) or not (False); None: the template's default."""
    ignored: tuple[str, ...]


def effort(reasoning_effort: str | None, verbosity: str | None, tokenizer: Any) -> Effort:
    """`reasoning_effort` on a template with a thinking section turns thinking off
    (`none`, `minimal`) or on (any other level: the section's length is not graded);
    without one it changes nothing, nor does `verbosity` on any model: those are named
    as ignored."""
    ignored = ["verbosity"] if verbosity is not None else []
    think = None
    if reasoning_effort is not None:
        if has_thinking(tokenizer):
            think = reasoning_effort not in _NO_EFFORT
        else:
            ignored.insert(0, "reasoning_effort")
    return Effort(think, tuple(ignored))


def _tool_names(messages: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Tool call id -> function name, from the assistant messages' calls."""
    return {
        c["id"]: c["function"]["name"]
        for m in messages
        for c in m.get("tool_calls") or ()
        if m["role"] == "assistant" and c.get("id")
    }


def _text(content: str | Sequence[Mapping[str, Any]] | None) -> str:
    """A message's content as one string (text parts joined, None as empty)."""
    if isinstance(content, str) or content is None:
        return content or ""
    return "".join(part["text"] for part in content if part["type"] == "text")


def _plain(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages (as validated: `schemas.Message`) as the library's dicts (developer
    is system; parts joined)."""
    names = _tool_names(messages)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content, role = m.get("content"), m["role"]
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part["type"] in _MEDIA:
                raise APIError(
                    400,
                    f"messages.{i}.content.{j}: {_MEDIA[part['type']]} not supported by this "
                    f"model ({part['type']})",
                    param=f"messages.{i}.content.{j}",
                    code="unsupported_value",
                )
        if content is None and role != "assistant":  # only a call may come without text
            raise APIError(
                400,
                f"messages.{i}.content: a {role} message needs content",
                param=f"messages.{i}.content",
                code="invalid_value",
            )
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        msg["content"] = _text(content)
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"function": c["function"]} for c in m["tool_calls"]]
        if role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            if name is not None:
                msg["name"] = name
        out.append(msg)
    return out


def _split_system(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def _refuse_tool_turns(messages: list[dict[str, Any]]) -> None:
    for i, m in enumerate(messages):
        if m["role"] == "tool" or m.get("tool_calls"):
            raise APIError(
                400,
                f"messages.{i}: tool calls and results need the request's tools",
                param=f"messages.{i}",
                code="invalid_value",
            )


def _choice(given: str | Mapping[str, Any] | None, names: list[str]) -> ToolChoice:
    choice = given or "auto"
    if isinstance(choice, str):
        return ToolChoice(choice)
    name = choice["function"]["name"]
    if name not in names:
        raise APIError(
            400,
            f"tool_choice names {name!r}, which is not in tools ({', '.join(names)})",
            param="tool_choice",
            code="invalid_value",
        )
    return ToolChoice("function", name)


Tokenizing = AbstractContextManager[Any]
"""Held around tokenizer calls (a fast tokenizer used from two threads at once can fail)."""
ALONE: Tokenizing = nullcontext()
"""No lock: for a caller preparing one request at a time."""


def chat(
    engine: Engine,
    body: ChatRequest,
    defaults: SamplingParams,
    tokenizing: Tokenizing = ALONE,
) -> Plan:
    """The plan of a chat completion.

    Raises:
        APIError, UserInputError, GrammarError, ContextLengthError: bad input (400).
    """
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(
            400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value"
        )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _adjusted(engine, body, logprobs, tokenizing, _chat, defaults)


def _chat(engine: Engine, spec: RequestSpec, body: ChatRequest, tokenizing: Tokenizing) -> Plan:
    wanted = effort(spec.reasoning_effort, body.verbosity, engine.loaded.tokenizer)
    plan = _chat_plan(engine, spec, tokenizing, wanted.think)
    plan.ignored = wanted.ignored
    return plan


def _chat_plan(
    engine: Engine, spec: RequestSpec, tokenizing: Tokenizing, think: bool | None
) -> Plan:
    params = spec.sampling
    messages = _plain(spec.messages)
    fmt = spec.response_format
    if spec.tools:
        if fmt is not None and fmt["type"] != "text":
            raise APIError(400, "response_format cannot be combined with tools", param="tools")
        return _tools_plan(engine, spec, messages, tokenizing, bool(think))
    if spec.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
    _refuse_tool_turns(messages)
    if fmt is None or fmt["type"] == "text":
        tokenizer = engine.loaded.tokenizer
        kwargs = {} if think is None else {"enable_thinking": think}
        with tokenizing:
            ids = engine.encoder.encode_chat(messages, **kwargs)
            thinking = reply_thinking(tokenizer, tokenizer.decode(ids[-_PROMPT_END:]))
        # A client may send the next turn as soon as this reply ends: follow it.
        request = Request(ids, params, stop_strings=spec.stops, follow=True)
        return Plan(ids, request, next_turn=_warm(engine, messages, **kwargs), thinking=thinking)
    form = fmt.get("json_schema")
    if fmt["type"] == "json_schema":
        if form is None:
            raise APIError(400, "response_format.json_schema is required", param="response_format")
        schema: dict[str, Any] = form.get("schema", {})
    else:
        schema = json_mode.ANY_OBJECT  # json_object: the prompt asks for an object, shows no schema
    system, rest = _split_system(messages)
    strict = bool(form and form.get("strict"))
    instructions = system if system and system.strip() else None
    # OpenAI's strict refuses what the grammar cannot enforce, as --strict, but keeps the
    # digit cap: the SDKs' parse() sets it on every request, and a reply must end.
    task = JsonTask.create(schema, instructions=instructions, strict=strict, cap_numbers=True)
    # As `mlxcache json` by default: a reasoning template is asked not to think unless a
    # reasoning effort says so (one that opens the section anyway gets it bounded and apart).
    task = task.for_model(engine.loaded.tokenizer, bool(think))  # a probe: no tokenizer call
    compile_for(engine.loaded, task.grammar)
    rendered = [task.messages("")[0], *rest]  # the schema's system message, then the chat
    with tokenizing:
        ids = json_mode.encode(engine, rendered, **task.template_kwargs)
        request = json_mode.request(engine, ids, task, params)
    request = replace(request, stop_strings=spec.stops, follow=True)
    thinking = task.thinking if task.thinking is not None and task.thinking.in_reply else None
    warm = _warm(engine, rendered, **task.template_kwargs)
    return Plan(ids, request, next_turn=warm, thinking=thinking)


def _warm(
    engine: Engine, rendered: list[dict[str, Any]], **template_kwargs: Any
) -> Callable[[Answer], list[int]] | None:
    if not engine.warm_ahead:
        return None
    return lambda answer: engine.encoder.encode_next_turn(
        [*rendered, {"role": "assistant", "content": answer.content}], **template_kwargs
    )


def _tools_plan(
    engine: Engine,
    spec: RequestSpec,
    messages: list[dict[str, Any]],
    tokenizing: Tokenizing,
    think: bool,
) -> Plan:
    tools = parse_tools([dict(t) for t in spec.tools])
    choice = _choice(spec.tool_choice, [t.name for t in tools])
    system, rest = _split_system(messages)
    conversation = read_messages(rest)
    parallel = spec.parallel_tool_calls is not False  # OpenAI's default: allowed
    task = ToolsTask(tools, choice, system, parallel, think)
    style = task.style_for(engine)  # renders probes and compiles the schemas: no tokenizer call
    if style.grammar is not None:
        compile_for(engine.loaded, style.grammar)
    with tokenizing:
        ids = task.encode(engine, conversation)
        request = task.request(engine, ids, spec.sampling)
    request = replace(request, stop_strings=spec.stops, follow=True)

    def warm(answer: Answer) -> list[int]:
        return next_turn(task, engine, conversation, ToolReply(answer.content, answer.calls))

    return Plan(ids, request, task, warm if engine.warm_ahead else None)


def completion(
    engine: Engine,
    body: CompletionRequest,
    defaults: SamplingParams,
    tokenizing: Tokenizing = ALONE,
) -> Plan:
    """The plan of a raw text completion (no chat template)."""
    return _adjusted(engine, body, body.logprobs, tokenizing, _completion, defaults)


def _completion(
    engine: Engine, spec: RequestSpec, body: CompletionRequest, tokenizing: Tokenizing
) -> Plan:
    with tokenizing:
        ids = engine.encoder.encode(spec.prompt or "")
    engine.encoder.check_fits(ids)
    return Plan(ids, Request(ids, spec.sampling, stop_strings=spec.stops))


def refuse_unsupported(body: SamplingFields) -> None:
    """A 400 naming the first field OpenAI defines that would change the reply and that
    is not implemented here (`schemas.UNSUPPORTED`), unless its value is neutral."""
    for name, value in (body.model_extra or {}).items():
        neutral = value is None or value is False or value in ("", [], {})
        if name in UNSUPPORTED and not neutral and value != NEUTRAL.get(name, ()):
            raise APIError(
                400, f"{name}: {UNSUPPORTED[name]}", param=name, code="unsupported_parameter"
            )


B = TypeVar("B", bound=SamplingFields)


def _adjusted(
    engine: Engine,
    body: B,
    logprobs: int | None,
    tokenizing: Tokenizing,
    plan_of: Callable[[Engine, RequestSpec, B, Tokenizing], Plan],
    defaults: SamplingParams,
) -> Plan:
    """`plan_of`'s plan with the request's logit bias (after the sampling's penalties,
    before the grammar's mask, which has the last word) and, when asked, its
    log-probabilities. Fields checked first, before any template or grammar work."""
    refuse_unsupported(body)
    if body.draft == "model" and engine.drafting.draft_model is None:
        why = "draft: 'model' needs a server started with --draft-model"
        raise APIError(400, why, param="draft", code="invalid_value")
    tokenizer = engine.loaded.tokenizer
    with tokenizing:
        size = len(tokenizer)
    bias = make_logits_processors(logit_bias=_logit_bias(body.logit_bias or {}, size))
    spec = spec_from(body, defaults)
    plan = plan_of(engine, spec, body, tokenizing)
    request = plan.request
    plan.request = replace(
        request, processors=[*bias, *request.processors], logprobs=logprobs, draft=spec.draft
    )
    if logprobs is not None:
        with tokenizing:  # built once per model (a plain tokenizer decodes every id)
            plan.vocab = token_bytes(tokenizer)
    return plan


def _logit_bias(given: dict[str, float], size: int) -> dict[int, float]:
    """Token id -> bias, every key a token id of the model (JSON keys are strings)."""
    bias: dict[int, float] = {}
    for key, value in given.items():
        if not (key.isascii() and key.isdigit() and int(key) < size):
            raise APIError(
                400,
                f"logit_bias: {key!r} is not a token id of this model (0 to {size - 1})",
                param="logit_bias",
                code="invalid_value",
            )
        bias[int(key)] = value
    return bias

"""From a `RequestSpec` to token ids and an engine Request: the one prepare path of every
front end (the server's routes through `server.prepare`, the in-process `generate`,
`json` and `tools`), so the same spec gives the same prompt tokens and grammar wherever
it runs.

Plain chat, JSON mode (`response_format`) and tools reuse the library's modes. Grammar
work (checking a schema, compiling its grammar: seconds for a large one, bounded by
`schema.MAX_SCHEMA_OBJECTS`) runs outside `tokenizing` (the encoder's lock on the server,
which its own calls take too), held only where the tokenizer is called: one client's
schema never stalls another's reply. No fastapi or pydantic here: a spec's messages,
format and tools are the request's JSON as validated (`server.schemas`) or as a command
built it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from mlxcache.constrain import compile_for
from mlxcache.engine import Engine, Request
from mlxcache.errors import FieldError
from mlxcache.modes import json_mode
from mlxcache.modes.json_mode import JsonTask
from mlxcache.modes.reasoning import Thinking, reply_thinking
from mlxcache.modes.tool_chat import ToolsTask, next_turn, read_messages
from mlxcache.modes.tools import ToolCall, ToolChoice, ToolReply, parse_tools
from mlxcache.request_spec import RequestSpec

_PROMPT_END = 64
"""Prompt tokens read back for an opened thinking section (the template's last words)."""
_MEDIA = {"image_url": "images are", "input_audio": "audio is", "file": "files are"}
"""A content part's type -> what the message says this model does not take."""

Tokenizing = AbstractContextManager[Any]
"""Held around tokenizer calls (a fast tokenizer used from two threads at once can fail)."""
ALONE: Tokenizing = nullcontext()
"""No lock: for a caller preparing one request at a time."""

NextTurn = Callable[[str, tuple[ToolCall, ...]], list[int]]
"""The token prefix a conversation's next prompt starts with, given the reply's content
and calls (for warm-ahead)."""


@dataclass(frozen=True, slots=True)
class Local:
    """What an in-process command sets that no request carries (each is refused with
    `--server`: `request_spec.IN_PROCESS_ONLY`)."""

    strict: bool | None = None
    """JSON mode: refuse what the grammar cannot enforce, numbers without the digit cap
    (`--strict`); None: the request's `json_schema.strict`, which keeps the cap."""
    allow_extra_keys: bool = False
    think_budget: int | None = None


WIRE = Local()
"""A request as the wire states it: nothing beyond the spec."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A spec ready to submit: its prompt's ids, the engine request, and how to read it."""

    ids: list[int]
    request: Request
    json: JsonTask | None = None
    tools: ToolsTask | None = None
    thinking: Thinking | None = None
    """A plain chat or JSON reply's thinking section (its reasoning, apart from the content)."""
    next_turn: NextTurn | None = None
    """None: the engine does no warm-ahead, or the spec is a raw prompt."""


def prepare(
    engine: Engine,
    spec: RequestSpec,
    tokenizing: Tokenizing = ALONE,
    think: bool | None = None,
    local: Local = WIRE,
) -> Prepared:
    """`spec` on `engine`'s model. `think`: ask the template to think (True) or not
    (False); None: its default (JSON and tools: not).

    Raises:
        FieldError, UserInputError, GrammarError, ContextLengthError: bad input.
    """
    if spec.prompt is not None:
        with tokenizing:
            ids = engine.encoder.encode(spec.prompt)
        engine.encoder.check_fits(ids)
        return Prepared(ids, _request(Request(ids, spec.sampling), spec))
    messages = plain(spec.messages)
    fmt = spec.response_format
    if spec.tools:
        if fmt is not None and fmt["type"] != "text":
            raise FieldError("response_format cannot be combined with tools", "tools", None)
        return _tools(engine, spec, messages, tokenizing, bool(think), local)
    if spec.tool_choice not in (None, "none", "auto"):
        raise FieldError("tool_choice needs tools", "tool_choice")
    _refuse_tool_turns(messages)
    if fmt is None or fmt["type"] == "text":
        tokenizer = engine.loaded.tokenizer
        kwargs = {} if think is None else {"enable_thinking": think}
        with tokenizing:
            ids = engine.encoder.encode_chat(messages, **kwargs)
            thinking = reply_thinking(tokenizer, tokenizer.decode(ids[-_PROMPT_END:]))
        request = _request(Request(ids, spec.sampling), spec)
        return Prepared(ids, request, thinking=thinking, next_turn=_warm(engine, messages, kwargs))
    return _json(engine, spec, messages, tokenizing, bool(think), local)


def _request(request: Request, spec: RequestSpec) -> Request:
    """`request` with the spec's stops and draft."""
    return replace(request, stop_strings=spec.stops, draft=spec.draft)


def _json(
    engine: Engine,
    spec: RequestSpec,
    messages: list[dict[str, Any]],
    tokenizing: Tokenizing,
    think: bool,
    local: Local,
) -> Prepared:
    fmt = spec.response_format or {}
    form = fmt.get("json_schema")
    if fmt["type"] == "json_schema":
        if form is None:
            raise FieldError("response_format.json_schema is required", "response_format", None)
        schema: dict[str, Any] = form.get("schema", {})
    else:
        schema = json_mode.ANY_OBJECT  # json_object: the prompt asks for an object, shows no schema
    system, rest = _split_system(messages)
    instructions = system if system and system.strip() else None
    # OpenAI's strict refuses what the grammar cannot enforce, as --strict, but keeps the
    # digit cap: the SDKs' parse() sets it on every request, and a reply must end.
    strict = bool(form and form.get("strict")) if local.strict is None else local.strict
    cap = True if local.strict is None else None
    task = JsonTask.create(schema, instructions, strict, local.allow_extra_keys, cap)
    # As `mlxcache json` by default: a reasoning template is asked not to think unless a
    # reasoning effort says so (one that opens the section anyway gets it bounded and apart).
    task = task.for_model(engine.loaded.tokenizer, think, local.think_budget)  # no tokenizer call
    compile_for(engine.loaded, task.grammar)
    rendered = [task.messages("")[0], *rest]  # the schema's system message, then the chat
    with tokenizing:
        ids = json_mode.encode(engine, rendered, **task.template_kwargs)
        request = json_mode.request(engine, ids, task, spec.sampling)
    thinking = task.thinking if task.thinking is not None and task.thinking.in_reply else None
    warm = _warm(engine, rendered, task.template_kwargs)
    return Prepared(ids, _request(request, spec), task, thinking=thinking, next_turn=warm)


def _tools(
    engine: Engine,
    spec: RequestSpec,
    messages: list[dict[str, Any]],
    tokenizing: Tokenizing,
    think: bool,
    local: Local,
) -> Prepared:
    tools = parse_tools([dict(t) for t in spec.tools])
    choice = _choice(spec.tool_choice, [t.name for t in tools])
    system, rest = _split_system(messages)
    conversation = read_messages(rest)
    parallel = spec.parallel_tool_calls is not False  # OpenAI's default: allowed
    task = ToolsTask(tools, choice, system, parallel, think, local.think_budget)
    style = task.style_for(engine)  # renders probes and compiles the schemas: no tokenizer call
    if style.grammar is not None:
        compile_for(engine.loaded, style.grammar)
    with tokenizing:
        ids = task.encode(engine, conversation)
        request = task.request(engine, ids, spec.sampling)

    def warm(content: str, calls: tuple[ToolCall, ...]) -> list[int]:
        return next_turn(task, engine, conversation, ToolReply(content, calls))

    prepared = Prepared(ids, _request(request, spec), tools=task)
    return replace(prepared, next_turn=warm if engine.warm_ahead else None)


def _warm(
    engine: Engine, rendered: list[dict[str, Any]], template_kwargs: Mapping[str, Any]
) -> NextTurn | None:
    if not engine.warm_ahead:
        return None
    return lambda content, _calls: engine.encoder.encode_next_turn(
        [*rendered, {"role": "assistant", "content": content}], **template_kwargs
    )


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


def plain(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages (as `server.schemas.Message` validates them) as the library's dicts
    (developer is system; parts joined).

    Raises:
        FieldError: a media part, or a message other than a call without content.
    """
    names = _tool_names(messages)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        content, role = m.get("content"), m["role"]
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if part["type"] in _MEDIA:
                where = f"messages.{i}.content.{j}"
                why = f"{_MEDIA[part['type']]} not supported by this model ({part['type']})"
                raise FieldError(f"{where}: {why}", where, "unsupported_value")
        if content is None and role != "assistant":  # only a call may come without text
            where = f"messages.{i}.content"
            raise FieldError(f"{where}: a {role} message needs content", where)
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
            where = f"messages.{i}"
            raise FieldError(f"{where}: tool calls and results need the request's tools", where)


def _choice(given: str | Mapping[str, Any] | None, names: list[str]) -> ToolChoice:
    choice = given or "auto"
    if isinstance(choice, str):
        return ToolChoice(choice)
    name = choice["function"]["name"]
    if name not in names:
        why = f"tool_choice names {name!r}, which is not in tools ({', '.join(names)})"
        raise FieldError(why, "tool_choice")
    return ToolChoice("function", name)

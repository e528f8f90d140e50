"""OpenAI's Responses API (`POST /v1/responses`) as a front end of chat completions: the
request becomes a `ChatRequest` (`to_chat`: `input` items as messages, `instructions` as the
system message, function tools, `text.format` as `response_format`), runs the one request
path, and its answer is written as a Response (output items: reasoning, message, function
calls), streamed as the Responses events.

`previous_response_id` continues a stored response: responses are kept in memory (the
most recent `STORED`, unless the request says `store: false`) with the conversation that
led to them, so a follow-up sends only its new items.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from threading import Lock
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mlxcache.modes.call_stream import CallDelta
from mlxcache.request_settings import RESPONSES
from mlxcache.server import errors
from mlxcache.server.errors import APIError
from mlxcache.server.front import Converted, Routes, ignored, parsed
from mlxcache.server.openai_format import Envelope, Usage
from mlxcache.server.prepare import Answer, Plan
from mlxcache.server.schemas import settings_given, tagged
from mlxcache.server.stream import Outcome, Stream
from mlxcache.wire import USAGE_FIELD

NAMES = {"reasoning_effort": "reasoning.effort", "verbosity": "text.verbosity"}
"""The chat completion fields this API names otherwise (`front.ignored`)."""
STORED = 256
"""Responses kept for `previous_response_id` (the oldest goes first)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextContent(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MediaContent(_Body):
    type: Literal["input_image", "input_file", "input_audio", "refusal"]


if TYPE_CHECKING:
    Content = TextContent | MediaContent
else:
    Content = tagged(TextContent, MediaContent)


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_Body):
    """An earlier turn's reasoning: dropped from the prompt, as chat templates drop it."""

    type: Literal["reasoning"]


if TYPE_CHECKING:
    Item = MessageItem | FunctionCallItem | FunctionOutputItem | ReasoningItem
else:
    Item = tagged(
        MessageItem, FunctionCallItem, FunctionOutputItem, ReasoningItem, default="message"
    )


class FunctionTool(_Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(_Body):
    type: Literal["function"]
    name: str


class Format(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(_Body):
    format: Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Reasoning(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    metadata: dict[str, str] | None = None


def _text(content: str | list[Content], where: str) -> str:
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if isinstance(part, MediaContent):
            at = f"{where}.content.{j}"
            raise APIError(400, f"{at}: {part.type} is not supported", param=at)
    return "".join(p.text for p in content if isinstance(p, TextContent))


def _messages(items: str | list[Item]) -> tuple[list[dict[str, Any]], list[str]]:
    """`input` as chat messages (function calls join the assistant message before them),
    and the item each came from."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    out: list[dict[str, Any]] = []
    origin: list[str] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            out.append({"role": item.role, "content": _text(item.content, f"input.{i}")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function"}
            call["function"] = {"name": item.name, "arguments": item.arguments}  # type: ignore[assignment]
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        origin += [f"input.{i}"] * (len(out) - len(origin))
    return out, origin


def to_chat(body: ResponsesRequest, history: list[dict[str, Any]]) -> ChatDoc:
    """The chat completion request `body` asks for, after the stored `history`."""
    given, origin = _messages(body.input)
    conversation = [*history, *given]
    if not conversation:
        why = "input: give at least one message, function call or function call output"
        raise APIError(400, why, param="input", code="invalid_value")
    # The instructions come first, the input's system and developer items stay where they
    # are (OpenAI's); they are this request's only, not stored with the conversation.
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    origin = ["instructions"] * len(system) + ["previous_response_id"] * len(history) + origin
    doc: dict[str, Any] = {"model": body.model, "messages": [*system, *conversation]}
    if body.tools:
        doc["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    choice = body.tool_choice
    if isinstance(choice, NamedTool):
        doc["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        doc["tool_choice"] = choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        fmt_doc: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:  # OpenAI's API refuses it too
                why = "text.format.schema: a json_schema format needs its schema"
                raise APIError(400, why, param="text.format.schema", code="invalid_value")
            schema = {"name": fmt.name or "response", "schema": fmt.schema_}
            fmt_doc["json_schema"] = {**schema, "strict": fmt.strict}
        doc["response_format"] = fmt_doc
    doc.update(settings_given(body, RESPONSES))
    doc["parallel_tool_calls"] = body.parallel_tool_calls
    if body.reasoning and body.reasoning.effort:
        doc["reasoning_effort"] = body.reasoning.effort
    if body.text and body.text.verbosity:
        doc["verbosity"] = body.text.verbosity
    extra = body.model_extra or {}
    for ours in ("draft", USAGE_FIELD):
        if ours in extra:
            doc[ours] = extra[ours]
    return ChatDoc(Converted(doc, tuple(origin), "input"), conversation)


@dataclass(frozen=True, slots=True)
class ChatDoc:
    """A chat completion request and the conversation it carries, without the request's
    instructions (kept with the reply: a follow-up gives its own)."""

    chat: Converted
    messages: list[dict[str, Any]]


class Store:
    """Recent responses' conversations (their last reply included), for
    `previous_response_id`; at most `size`, the oldest dropped first."""

    def __init__(self, size: int = STORED) -> None:
        self.size = size
        self._kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = Lock()

    def get(self, rid: str) -> list[dict[str, Any]]:
        with self._lock:
            found = self._kept.get(rid)
        if found is None:
            raise APIError(
                404,
                f"previous_response_id {rid!r} is not stored here (this server keeps the last "
                f"{self.size} responses, in memory, while it runs)",
                param="previous_response_id",
                code="not_found",
            )
        return found

    def put(self, rid: str, conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._kept[rid] = conversation
            while len(self._kept) > self.size:
                self._kept.popitem(last=False)


def _assistant(answer: Answer, env: Envelope) -> dict[str, Any]:
    """The reply as the next request's history holds it."""
    msg: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.calls:
        msg["tool_calls"] = [
            {
                "id": call_id(env, i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for i, c in enumerate(answer.calls)
        ]
    return msg


def call_id(env: Envelope, index: int) -> str:
    return f"call_{env.id.partition('-')[2]}_{index}"


def usage(u: Usage) -> dict[str, Any]:
    """The Responses API's usage (`cached_tokens`: what the prompt cache resumed)."""
    return u.tagged(
        {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }
    )


def _items(env: Envelope, answer: Answer) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if answer.reasoning:
        summary = [{"type": "summary_text", "text": answer.reasoning}]
        items.append({"type": "reasoning", "id": f"rs_{env.id}", "summary": summary})
    if answer.content or not answer.calls:
        items.append(_message_item(env, answer.content, "completed"))
    for i, c in enumerate(answer.calls):
        items.append(_call_item(env, i, c.name, json.dumps(c.arguments, ensure_ascii=False)))
    return items


def _message_item(env: Envelope, text: str, status: str) -> dict[str, Any]:
    content = [] if status != "completed" else [_text_part(text)]
    return {
        "type": "message",
        "id": f"msg_{env.id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _call_item(
    env: Envelope, i: int, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{env.id}_{i}",
        "call_id": call_id(env, i),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response(
    env: Envelope,
    body: ResponsesRequest,
    status: str,
    output: list[dict[str, Any]],
    u: Usage | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """A Response object (the fields the SDKs read)."""
    fmt = body.text.format if body.text and body.text.format else None
    choice = body.tool_choice
    return {
        "id": env.id,
        "object": "response",
        "created_at": env.created,
        "status": status,
        "model": env.model,
        "output": output,
        "usage": None if u is None else usage(u),
        "error": None,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort if body.reasoning else None, "summary": None},
        "store": body.store,
        "temperature": body.temperature,
        "text": {
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        "tool_choice": choice.model_dump() if isinstance(choice, NamedTool) else choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "top_p": body.top_p,
        "truncation": "disabled",
    }


def finished(answer: Answer) -> tuple[str, str | None]:
    """The Response's status and, when it is incomplete, why."""
    if answer.finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


class Events:
    """The Responses stream's events, numbered."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, data: dict[str, Any]) -> str:
        doc = {"type": kind, "sequence_number": self.n, **data}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(doc, ensure_ascii=False)}\n\n"


async def events(
    stream: Stream,
    plan: Plan,
    env: Envelope,
    body: ResponsesRequest,
    usage_of: Callable[[Outcome], Usage],
    done: Callable[[Answer], Awaitable[None]],
) -> AsyncIterator[str | Outcome]:
    """response.created, in_progress; a thinking section as a reasoning item (when the
    answer starts); the message item with its text deltas as they come; each function call
    as it is written, its arguments' deltas as they come; response.completed (or
    incomplete). Output indexes are the final Response's."""
    ev = Events()
    yield ev("response.created", {"response": response(env, body, "in_progress", [])})
    yield ev("response.in_progress", {"response": response(env, body, "in_progress", [])})
    index = msg_at = -1
    text = reasoning = ""
    thought = False
    message = "unopened"  # -> "open" -> "done"
    item_id = f"msg_{env.id}"
    calls = stream.calls
    call_at: dict[int, int] = {}  # a call's output index

    def reasoned(final: str) -> list[str]:
        """The reasoning item, once, when there is one."""
        nonlocal index, thought
        if thought or not final:
            return []
        index, thought = index + 1, True
        item = {"type": "reasoning", "id": f"rs_{env.id}", "summary": []}
        done_item = {**item, "summary": [{"type": "summary_text", "text": final}]}
        return [
            ev("response.output_item.added", {"output_index": index, "item": item}),
            ev("response.output_item.done", {"output_index": index, "item": done_item}),
        ]

    def where() -> dict[str, Any]:
        return {"item_id": item_id, "output_index": msg_at, "content_index": 0}

    def open_message() -> list[str]:
        nonlocal index, msg_at, message
        if message != "unopened":
            return []
        opening = reasoned(reasoning)
        index = msg_at = index + 1
        message = "open"
        added = {"output_index": index, "item": _message_item(env, "", "in_progress")}
        return [
            *opening,
            ev("response.output_item.added", added),
            ev("response.content_part.added", {**where(), "part": _text_part("")}),
        ]

    def close_message(final: str) -> list[str]:
        nonlocal message
        if message != "open":
            return []
        message = "done"
        done_item = _message_item(env, final, "completed")
        return [
            ev("response.output_text.done", {**where(), "text": final}),
            ev("response.content_part.done", {**where(), "part": _text_part(final)}),
            ev("response.output_item.done", {"output_index": msg_at, "item": done_item}),
        ]

    def called(call: CallDelta) -> list[str]:
        """A function call item added when the call begins (the message before it done),
        then its arguments' deltas."""
        nonlocal index
        out: list[str] = []
        if call.name is not None:
            out += close_message(text)
            index = call_at[call.index] = index + 1
            item = _call_item(env, call.index, call.name, "", "in_progress")
            out.append(ev("response.output_item.added", {"output_index": index, "item": item}))
        if call.arguments:
            at = {"item_id": f"fc_{env.id}_{call.index}", "output_index": call_at[call.index]}
            out.append(
                ev("response.function_call_arguments.delta", {**at, "delta": call.arguments})
            )
        return out

    async for piece in stream.deltas():
        if isinstance(piece, CallDelta):
            for line in called(piece):
                yield line
            continue
        kind, delta = piece
        if kind != "content":
            reasoning += delta  # its item comes whole, before the answer's
            continue
        for line in open_message():
            yield line
        text += delta
        yield ev("response.output_text.delta", {**where(), "delta": delta})
    end = stream.ending(plan.answer)
    outcome, answer = end.outcome, end.answer
    yield outcome
    if answer is None:
        failed = response(env, body, "failed", [])
        failed["error"] = {"code": "server_error", "message": errors.one_line(outcome.error or "")}
        yield ev("response.failed", {"response": failed})
        return
    for line in reasoned(answer.reasoning or ""):
        yield line
    if (answer.content or not answer.calls) and message != "done":
        for line in open_message():
            yield line
        if end.content:
            yield ev("response.output_text.delta", {**where(), "delta": end.content})
        for line in close_message(answer.content):
            yield line
    for call in end.calls:
        calls.add(call)
        for line in called(call):
            yield line
    for i in range(calls.begun):
        whole = i < len(answer.calls)  # else cut off, or unreadable
        name, arguments = calls.name(i), calls.arguments(i)
        at = {"item_id": f"fc_{env.id}_{i}", "output_index": call_at[i]}
        if whole:
            yield ev("response.function_call_arguments.done", {**at, "arguments": arguments})
        status = "completed" if whole else "incomplete"
        item = _call_item(env, i, name, arguments, status)
        yield ev("response.output_item.done", {"output_index": call_at[i], "item": item})
    status, why = finished(answer)
    final = response(env, body, status, _items(env, answer), usage_of(outcome), why)
    yield ev(
        "response.completed" if status == "completed" else "response.incomplete",
        {"response": final},
    )
    await done(answer)


def install(app: FastAPI, routes: Routes) -> None:
    """The Responses API's route on `app`, over the chat completion path `routes`."""
    store = Store()

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body: ResponsesRequest = await parsed(request, ResponsesRequest)
        history = [] if body.previous_response_id is None else store.get(body.previous_response_id)
        chat = to_chat(body, history)
        with chat.chat.named():
            plan, env, stream, usage_of = await routes.submit(request, chat.chat.request(), "resp")

        def kept(answer: Answer) -> None:
            if body.store:
                store.put(env.id, [*chat.messages, _assistant(answer, env)])

        async def done(answer: Answer) -> None:
            kept(answer)
            await routes.warm(plan, answer)

        headers = ignored(plan, NAMES)
        if body.stream:
            replies = events(stream, plan, env, body, usage_of, done)
            return routes.stream(replies, stream, request, env.id, headers)
        outcome, answer = await routes.answered(request, plan, stream, env)
        kept(answer)
        status, why = finished(answer)
        doc = response(env, body, status, _items(env, answer), usage_of(outcome), why)
        return JSONResponse(doc, headers=headers)

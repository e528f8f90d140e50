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
from collections.abc import Callable
from dataclasses import dataclass
from threading import Lock
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mlxcache.request_settings import RESPONSES
from mlxcache.server import errors
from mlxcache.server.blocks import Block, BlockEvent, Closed, Delta, End, Opened, rendered
from mlxcache.server.errors import APIError
from mlxcache.server.front import Converted, ignored, parsed
from mlxcache.server.openai_format import Envelope, Usage
from mlxcache.server.prepare import Answer
from mlxcache.server.schemas import settings_given, tagged
from mlxcache.server.service import Service
from mlxcache.server.stream import Outcome
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


class Renderer:
    """response.created, in_progress; a reasoning item, whole, once the thinking ends; the
    message item and its text deltas; each function call as it is written and its
    arguments' deltas, done at the end; response.completed (or incomplete, or failed)."""

    def __init__(
        self, env: Envelope, body: ResponsesRequest, usage_of: Callable[[Outcome], Usage]
    ) -> None:
        self.env, self.body, self.usage_of, self.ev = env, body, usage_of, Events()

    async def head(self) -> list[str]:
        now = {"response": response(self.env, self.body, "in_progress", [])}
        return [self.ev("response.created", now), self.ev("response.in_progress", now)]

    def _item(self, kind: str, block: Block, text: str, status: str) -> str:
        item = _item_of(self.env, block, text, status)
        return self.ev(f"response.output_item.{kind}", {"output_index": block.index, "item": item})

    def __call__(self, e: BlockEvent) -> list[str]:
        if isinstance(e, End):
            return self._end(e)
        b, at, ev = e.block, _at(self.env, e.block), self.ev
        if isinstance(e, Opened) and b.kind != "reasoning":  # a reasoning item comes whole
            added = [self._item("added", b, "", "in_progress")]
            part = {**at, "part": _text_part("")}
            return (
                [*added, ev("response.content_part.added", part)] if b.kind == "content" else added
            )
        if isinstance(e, Delta) and e.text and b.kind != "reasoning":
            kind = "output_text" if b.kind == "content" else "function_call_arguments"
            return [ev(f"response.{kind}.delta", {**at, "delta": e.text})]
        if isinstance(e, Closed) and b.kind == "reasoning":
            return [self._item("added", b, "", "in_progress"), self._item("done", b, e.text, "")]
        if isinstance(e, Closed) and b.kind == "content":
            return [
                ev("response.output_text.done", {**at, "text": e.text}),
                ev("response.content_part.done", {**at, "part": _text_part(e.text)}),
                self._item("done", b, e.text, "completed"),
            ]
        return []

    def _end(self, e: End) -> list[str]:
        outcome, answer = e.ending.outcome, e.ending.answer
        if answer is None:
            failed = response(self.env, self.body, "failed", [])
            error = errors.one_line(outcome.error or "")
            failed["error"] = {"code": "server_error", "message": error}
            return [self.ev("response.failed", {"response": failed})]
        out = []
        for c in e.calls:  # cut off or unreadable: incomplete, its arguments never done
            if c.whole:
                done = {**_at(self.env, c.block), "arguments": c.arguments}
                out.append(self.ev("response.function_call_arguments.done", done))
            status = "completed" if c.whole else "incomplete"
            out.append(self._item("done", c.block, c.arguments, status))
        status, why = finished(answer)
        items = _items(self.env, answer)
        final = response(self.env, self.body, status, items, self.usage_of(outcome), why)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*out, self.ev(kind, {"response": final})]


def _at(env: Envelope, block: Block) -> dict[str, Any]:
    """How an event about `block` names its item."""
    if block.kind == "call":
        return {"item_id": f"fc_{env.id}_{block.call}", "output_index": block.index}
    return {"item_id": f"msg_{env.id}", "output_index": block.index, "content_index": 0}


def _item_of(env: Envelope, block: Block, text: str, status: str) -> dict[str, Any]:
    """`block`'s output item with `text` (in progress: none yet)."""
    if block.kind == "call":
        return _call_item(env, block.call, block.name, text, status)
    if block.kind == "content":
        return _message_item(env, text, status)
    summary = [{"type": "summary_text", "text": text}] if text else []
    return {"type": "reasoning", "id": f"rs_{env.id}", "summary": summary}


def router(service: Service) -> APIRouter:
    """The Responses API's route, over the chat completion path of `service`."""
    routes = APIRouter()
    store = Store()

    @routes.post("/v1/responses")
    async def responses(request: Request) -> Any:
        body: ResponsesRequest = await parsed(request, ResponsesRequest)
        history = [] if body.previous_response_id is None else store.get(body.previous_response_id)
        chat = to_chat(body, history)
        with chat.chat.named():
            plan, env, stream, usage_of = await service.submit_chat(
                request, chat.chat.request(), "resp"
            )

        def kept(answer: Answer) -> None:
            if body.store:
                store.put(env.id, [*chat.messages, _assistant(answer, env)])

        async def done(answer: Answer) -> None:
            await service.warm(plan, answer)

        headers = ignored(plan, NAMES)
        if body.stream:  # stored before response.completed: a client may follow up at once
            render = Renderer(env, body, usage_of)
            replies = rendered(stream, plan.answer, render, done, kept)
            return service.stream(replies, stream, request, env.id, headers)
        outcome, answer = await service.answered(request, plan, stream, env)
        kept(answer)
        status, why = finished(answer)
        doc = response(env, body, status, _items(env, answer), usage_of(outcome), why)
        return JSONResponse(doc, headers=headers)

    return routes

"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a front
end of chat completions: a request becomes a `ChatRequest` (`to_chat`), runs the one
request path (`prepare.chat`: template, tools and their grammar), and its answer is written
in Anthropic's shapes, streamed as Anthropic's events. A reply is therefore byte for byte
the chat completion's (and `mlxcache generate/tools`'s) for the same conversation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mlxcache.modes.call_stream import CallDelta
from mlxcache.request_settings import MESSAGES
from mlxcache.server import errors
from mlxcache.server.errors import APIError
from mlxcache.server.front import Converted, Routes, ignored, parsed
from mlxcache.server.openai_format import Envelope, Usage
from mlxcache.server.prepare import Answer, Plan
from mlxcache.server.schemas import settings_given, tagged
from mlxcache.server.stream import Outcome, Stream
from mlxcache.wire import USAGE_FIELD


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(b.text for b in self.content)
        return self.content or ""


class ThinkingBlock(_Body):
    """An earlier turn's thinking: dropped from the prompt, as chat templates drop it."""

    type: Literal["thinking", "redacted_thinking"]


class MediaBlock(_Body):
    """What this server does not read: refused by name."""

    type: Literal[
        "image",
        "document",
        "search_result",
        "server_tool_use",
        "web_search_tool_result",
        "container_upload",
    ]


if TYPE_CHECKING:
    Block = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | MediaBlock
else:
    Block = tagged(TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, MediaBlock)


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Body):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1024)  # Anthropic's least


class JsonFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """Structured output (`format`) and effort (a thinking section on reasoning templates)."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonFormat | None = None


class CountRequest(_Body):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    stream: bool = False


def _system(system: str | list[TextBlock] | None) -> str | None:
    if isinstance(system, list):
        return "".join(b.text for b in system)
    return system


def _messages(body: CountRequest) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation as OpenAI chat messages (a user turn's tool results become tool
    messages, before its text; an assistant turn's tool uses its tool calls), and the
    field each came from."""
    system = _system(body.system)
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    origin = ["system"] * len(out)
    for i, m in enumerate(body.messages):
        origin += [f"messages.{i - 1}"] * (len(out) - len(origin))
        blocks = (
            [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        )
        for j, b in enumerate(blocks):
            if isinstance(b, MediaBlock):
                raise APIError(
                    400,
                    f"messages.{i}.content.{j}: {b.type} blocks are not supported by this server",
                    param=f"messages.{i}.content.{j}",
                )
        text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                for b in blocks
                if isinstance(b, ToolUseBlock)
            ]
            msg: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        for b in blocks:
            if isinstance(b, ToolResultBlock):
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            out.append({"role": "user", "content": text})
    origin += [f"messages.{len(body.messages) - 1}"] * (len(out) - len(origin))
    return out, origin


def _tools(body: CountRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if body.tools:
        for i, t in enumerate(body.tools):
            if t.type not in (None, "custom") or t.input_schema is None:
                raise APIError(
                    400,
                    f"tools.{i}: server tools ({t.type or t.name}) are not supported: "
                    "send custom tools with an input_schema",
                    param=f"tools.{i}",
                )
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    **({"description": t.description} if t.description else {}),
                    "parameters": t.input_schema,
                },
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice: type 'tool' needs a name", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            mode = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
            fields["tool_choice"] = mode if body.tools else None
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def _check_thinking(body: CountRequest) -> None:
    """Refuse enabled thinking as Anthropic's API does: without a budget, or with one that
    leaves no room under `max_tokens`."""
    if body.thinking is None or body.thinking.type != "enabled":
        return
    budget = body.thinking.budget_tokens
    if budget is None:
        raise APIError(400, "thinking.budget_tokens: Field required", param="thinking")
    if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
        why = "max_tokens: must be greater than thinking.budget_tokens"
        raise APIError(400, why, param="max_tokens")


def to_chat(body: CountRequest) -> Converted:
    """The chat completion request that `body` asks for.

    Raises:
        APIError: a block, tool or field this server does not take (400).
    """
    _check_thinking(body)
    messages, origin = _messages(body)
    doc: dict[str, Any] = {"model": body.model, "messages": messages, **_tools(body)}
    if isinstance(body, MessagesRequest):
        doc["stop"] = body.stop_sequences or None
        doc.update(settings_given(body, MESSAGES))
    # A thinking section on reasoning templates (elsewhere named as ignored, in a header).
    effort = body.output_config.effort if body.output_config else None
    if body.thinking is not None:
        doc["reasoning_effort"] = "none" if body.thinking.type == "disabled" else "high"
    elif effort is not None:
        doc["reasoning_effort"] = "xhigh" if effort == "max" else effort
    fmt = body.output_config.format if body.output_config else None
    if fmt is not None:  # structured output: the JSON mode's grammar
        doc["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": fmt.schema_, "strict": True},
        }
    extra = body.model_extra or {}
    for ours in ("draft", USAGE_FIELD):  # mlxcache's own fields, as in chat completions
        if ours in extra:
            doc[ours] = extra[ours]
    return Converted(doc, tuple(origin), "messages")


STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(answer: Answer, outcome: Outcome) -> str:
    if outcome.stop_sequence is not None and answer.finish_reason == "stop":
        return "stop_sequence"
    return STOP_REASONS.get(answer.finish_reason, "end_turn")


def usage(u: Usage) -> dict[str, Any]:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the cache."""
    return u.tagged(
        {
            "input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": u.completion_tokens,
        }
    )


def _blocks(env: Envelope, answer: Answer) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if answer.reasoning:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content or not answer.calls:
        blocks.append({"type": "text", "text": answer.content})
    for i, call in enumerate(answer.calls):
        use = {"type": "tool_use", "id": tool_use_id(env, i), "name": call.name}
        blocks.append({**use, "input": call.arguments})
    return blocks


def tool_use_id(env: Envelope, index: int) -> str:
    """A tool use's id: unique per reply, the same streamed or not."""
    return f"toolu_{env.id.partition('-')[2]}_{index}"


def message(env: Envelope, answer: Answer, outcome: Outcome, u: Usage) -> dict[str, Any]:
    return {
        "id": env.id,
        "type": "message",
        "role": "assistant",
        "model": env.model,
        "content": _blocks(env, answer),
        "stop_reason": stop_reason(answer, outcome),
        "stop_sequence": outcome.stop_sequence,
        "usage": usage(u),
    }


def event(kind: str, data: dict[str, Any]) -> str:
    """One of Anthropic's server-sent events: its type named twice, as theirs are."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


async def events(
    stream: Stream,
    plan: Plan,
    env: Envelope,
    usage_of: Callable[[Outcome], Usage],
    warm: Callable[[Plan, Answer], Awaitable[None]],
) -> AsyncIterator[str | Outcome]:
    """A streamed reply: message_start, a ping, a content block per part (thinking, text,
    each tool use) with its deltas, message_delta (stop reason, usage), message_stop.
    message_start waits for the prompt's lookup: its usage splits the cached tokens out
    as message_delta's does."""
    looked_up = Usage(len(plan.ids), 0, await stream.looked_up())
    start: dict[str, Any] = {
        "id": env.id,
        "type": "message",
        "role": "assistant",
        "model": env.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(looked_up),
    }
    yield event("message_start", {"message": start})
    yield event("ping", {})
    index, open_kind = -1, ""

    def opened(kind: str) -> list[str]:
        """Events that close the open block and open one of `kind`, if it is not open."""
        nonlocal index, open_kind
        if open_kind == kind:
            return []
        out = [event("content_block_stop", {"index": index})] if open_kind else []
        index, open_kind = index + 1, kind
        block = (
            {"type": "thinking", "thinking": ""}
            if kind == "reasoning"
            else {"type": "text", "text": ""}
        )
        return [*out, event("content_block_start", {"index": index, "content_block": block})]

    def delta(kind: str, text: str) -> str:
        body = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "reasoning"
            else {"type": "text_delta", "text": text}
        )
        return event("content_block_delta", {"index": index, "delta": body})

    def tool(call: CallDelta) -> list[str]:
        """A call's block opened when it begins (closing the open one), its arguments'
        deltas into it while it is open."""
        nonlocal index, open_kind
        out: list[str] = []
        if call.name is not None:
            if open_kind:
                out.append(event("content_block_stop", {"index": index}))
            index, open_kind = index + 1, f"tool {call.index}"
            use = {"type": "tool_use", "id": tool_use_id(env, call.index), "name": call.name}
            block = {"index": index, "content_block": {**use, "input": {}}}
            out.append(event("content_block_start", block))
        if call.arguments and open_kind == f"tool {call.index}":
            partial = {"type": "input_json_delta", "partial_json": call.arguments}
            out.append(event("content_block_delta", {"index": index, "delta": partial}))
        return out

    async for piece in stream.deltas():
        lines = tool(piece) if isinstance(piece, CallDelta) else [*opened(piece[0]), delta(*piece)]
        for line in lines:
            yield line
    end = stream.ending(plan.answer)
    outcome, answer = end.outcome, end.answer
    yield outcome
    if answer is None:
        failure = {"type": "api_error", "message": errors.one_line(outcome.error or "")}
        yield event("error", {"error": failure})
        return
    for kind, rest in (("reasoning", end.reasoning), ("content", end.content)):
        if rest or (kind == "content" and not answer.calls and index < 0):
            for item in opened(kind):
                yield item
            if rest:
                yield delta(kind, rest)
    for call in end.calls:
        for line in tool(call):
            yield line
    if open_kind:
        yield event("content_block_stop", {"index": index})
    reason = {"stop_reason": stop_reason(answer, outcome), "stop_sequence": outcome.stop_sequence}
    yield event("message_delta", {"delta": reason, "usage": usage(usage_of(outcome))})
    yield event("message_stop", {})
    await warm(plan, answer)


def install(app: FastAPI, routes: Routes) -> None:
    """The Messages API's routes on `app`, over the chat completion path `routes`."""

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body: MessagesRequest = await parsed(request, MessagesRequest)
        chat = to_chat(body)
        with chat.named():
            plan, env, stream, usage_of = await routes.submit(request, chat.request(), "msg")
        # Thinking asked for by `thinking` or by an effort: named as the request set it.
        effort = "thinking" if body.thinking is not None else "output_config.effort"
        headers = ignored(plan, {"reasoning_effort": effort})
        if body.stream:
            replies = events(stream, plan, env, usage_of, routes.warm)
            return routes.stream(replies, stream, request, env.id, headers)
        outcome, answer = await routes.answered(request, plan, stream, env)
        return JSONResponse(message(env, answer, outcome, usage_of(outcome)), headers=headers)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body: CountRequest = await parsed(request, CountRequest)
        chat = to_chat(body)
        with chat.named():
            return {"input_tokens": await routes.count(request, chat.request())}

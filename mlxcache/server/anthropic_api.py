"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) as a front
end of chat completions: a request becomes a `ChatRequest` (`to_chat`), runs the one
request path (`prepare.chat`: template, tools and their grammar), and its answer is written
in Anthropic's shapes, streamed as Anthropic's events. A reply is therefore byte for byte
the chat completion's (and `mlxcache generate/tools`'s) for the same conversation.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from mlxcache.request_settings import MESSAGES
from mlxcache.server import errors
from mlxcache.server.blocks import Block as Out
from mlxcache.server.blocks import BlockEvent, Closed, Delta, Opened, rendered
from mlxcache.server.errors import APIError
from mlxcache.server.front import Converted, ignored, parsed
from mlxcache.server.openai_format import Envelope, Usage
from mlxcache.server.prepare import Answer, Plan
from mlxcache.server.schemas import settings_given, tagged
from mlxcache.server.service import Service, UsageOf
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


class Renderer:
    """A streamed reply: message_start, a ping, a content block per block (thinking,
    text, each tool use) with its deltas, message_delta (stop reason, usage),
    message_stop. message_start waits for the prompt's lookup: its usage splits the cached
    tokens out as message_delta's does."""

    def __init__(self, stream: Stream, plan: Plan, env: Envelope, usage_of: UsageOf) -> None:
        self.stream, self.plan, self.env, self.usage_of = stream, plan, env, usage_of
        self.open: Out | None = None

    async def head(self) -> list[str]:
        looked_up = Usage(len(self.plan.ids), 0, await self.stream.looked_up())
        start: dict[str, Any] = {
            "id": self.env.id,
            "type": "message",
            "role": "assistant",
            "model": self.env.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(looked_up),
        }
        return [event("message_start", {"message": start}), event("ping", {})]

    def __call__(self, ev: BlockEvent) -> list[str]:
        if isinstance(ev, Opened):
            self.open = b = ev.block
            start = {"index": b.index, "content_block": _opened(self.env, b)}
            return [event("content_block_start", start)]
        if isinstance(ev, Delta):
            if not ev.text or ev.block != self.open:  # a call's rest once another opened
                return []
            delta = {"index": ev.block.index, "delta": _delta(ev.block, ev.text)}
            return [event("content_block_delta", delta)]
        if isinstance(ev, Closed):
            self.open = None
            return [event("content_block_stop", {"index": ev.block.index})]
        outcome, answer = ev.ending.outcome, ev.ending.answer
        if answer is None:
            failure = {"type": "api_error", "message": errors.one_line(outcome.error or "")}
            return [event("error", {"error": failure})]
        reason = {
            "stop_reason": stop_reason(answer, outcome),
            "stop_sequence": outcome.stop_sequence,
        }
        u = usage(self.usage_of(outcome))
        return [event("message_delta", {"delta": reason, "usage": u}), event("message_stop", {})]


def _opened(env: Envelope, block: Out) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": ""}
    if block.kind == "content":
        return {"type": "text", "text": ""}
    use = {"type": "tool_use", "id": tool_use_id(env, block.call), "name": block.name}
    return {**use, "input": {}}


def _delta(block: Out, text: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    if block.kind == "content":
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


def router(service: Service) -> APIRouter:
    """The Messages API's routes, over the chat completion path of `service`."""
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body: MessagesRequest = await parsed(request, MessagesRequest)
        chat = to_chat(body)
        with chat.named():
            plan, env, stream, usage_of = await service.submit_chat(request, chat.request(), "msg")
        # Thinking asked for by `thinking` or by an effort: named as the request set it.
        effort = "thinking" if body.thinking is not None else "output_config.effort"
        headers = ignored(plan, {"reasoning_effort": effort})
        if body.stream:

            async def done(answer: Answer) -> None:
                await service.warm(plan, answer)

            render = Renderer(stream, plan, env, usage_of)
            replies = rendered(stream, plan.answer, render, done)
            return service.stream(replies, stream, request, env.id, headers)
        outcome, answer = await service.answered(request, plan, stream, env)
        return JSONResponse(message(env, answer, outcome, usage_of(outcome)), headers=headers)

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict[str, Any]:
        body: CountRequest = await parsed(request, CountRequest)
        chat = to_chat(body)
        with chat.named():
            return {"input_tokens": await service.count(chat.request())}

    return routes

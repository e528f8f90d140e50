"""OpenAI response objects and server-sent-event chunks, built from plain values."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from mlxcache.modes.call_stream import CallDelta
from mlxcache.modes.tools import ToolCall


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    mlxcache: dict[str, Any] | None = field(default=None, compare=False)
    """The request's own stats and token ids, for a client that asked (`mlxcache.remote`)."""

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        return self.tagged(doc)

    def tagged(self, doc: dict[str, Any]) -> dict[str, Any]:
        """`doc` (a usage object of any API) with the request's own stats, when asked for."""
        return doc if self.mlxcache is None else {**doc, "mlxcache": self.mlxcache}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n"


SSE_DONE = sse("[DONE]")


def call_id(request_id: str, index: int) -> str:
    """A tool call's id: unique per reply and the same in streamed and plain replies."""
    return f"call_{request_id.removeprefix('chatcmpl-')}_{index}"


def _call(request_id: str, index: int, name: str, arguments: str) -> dict[str, Any]:
    """One call as a message and a call's first chunk carry it."""
    function = {"name": name, "arguments": arguments}
    return {"id": call_id(request_id, index), "type": "function", "function": function}


def tool_calls(request_id: str, calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [
        _call(request_id, i, c.name, json.dumps(c.arguments, ensure_ascii=False))
        for i, c in enumerate(calls)
    ]


class Envelope:
    """The fields every object of one reply shares (id, created, model)."""

    def __init__(self, request_id: str, model: str, created: int | None = None) -> None:
        self.id = request_id
        self.model = model
        self.created = int(time.time()) if created is None else created

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- /v1/chat/completions ---------------------------------------------------------------

    def chat(
        self,
        content: str,
        calls: tuple[ToolCall, ...],
        finish: str,
        usage: Usage,
        reasoning: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:  # a thinking section, apart (the field mlx_lm.server uses)
            message["reasoning"] = reasoning
        if calls:
            message["content"] = content or None
            message["tool_calls"] = tool_calls(self.id, calls)
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage.as_dict()}

    def chat_chunk(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def call_delta(self, delta: CallDelta) -> dict[str, Any]:
        """A `tool_calls` entry of a chunk, as OpenAI streams calls: the call's index, id,
        type and name first, then more of its arguments."""
        if delta.name is None:
            return {"index": delta.index, "function": {"arguments": delta.arguments}}
        return {"index": delta.index, **_call(self.id, delta.index, delta.name, delta.arguments)}

    def usage_chunk(self, usage: Usage, obj: str = "chat.completion.chunk") -> dict[str, Any]:
        return {**self._head(obj), "choices": [], "usage": usage.as_dict()}

    # -- /v1/completions ----------------------------------------------------------------------

    def completion(
        self, text: str, finish: str, usage: Usage, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage.as_dict()}

    def completion_chunk(
        self, text: str, finish: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}


def error_event(message: str) -> str:
    """A failure after the stream started: OpenAI's error object as the last event."""
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})

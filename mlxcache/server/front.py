"""What the routes of the other APIs (Anthropic's Messages, OpenAI's Responses) share with
chat completions: one request path, handed to them by `app.create_app`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from mlxcache.server import errors
from mlxcache.server.openai_format import Envelope, Usage
from mlxcache.server.prepare import IGNORED_HEADER, Answer, Plan
from mlxcache.server.schemas import ChatRequest
from mlxcache.server.stream import Outcome, Stream

UsageOf = Callable[[Outcome], Usage]


@dataclass(frozen=True, slots=True)
class Routes:
    """Submit a ChatRequest (its plan, envelope, stream and usage), end it (non-streamed),
    warm its next turn, count its prompt, and answer with a stream of server-sent events."""

    submit: Callable[[Request, ChatRequest, str], Awaitable[tuple[Plan, Envelope, Stream, UsageOf]]]
    end: Callable[[Request, Stream, Envelope], Awaitable[Outcome]]
    warm: Callable[[Plan, Answer], Awaitable[None]]
    count: Callable[[Request, ChatRequest], Awaitable[int]]
    stream: Callable[
        [AsyncIterator[str | Outcome], Stream, Request, str, dict[str, str]], StreamingResponse
    ]


async def parsed(request: Request, schema: type[Any]) -> Any:
    """The request's body checked against `schema` (400 naming the first bad field)."""
    doc = errors.parse_json(await request.body())
    try:
        return schema.model_validate(doc)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors()) from None


def chat_request(doc: dict[str, Any]) -> ChatRequest:
    """A chat completion request built from another API's (400 on what it does not take)."""
    try:
        return ChatRequest.model_validate(doc)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors()) from None


def ignored(plan: Plan, names: Mapping[str, str] | None = None) -> dict[str, str]:
    """The reply's header naming the request's fields that changed nothing for this model
    (`Plan.ignored`), each by the route's own name for it (`names`: chat field -> it)."""
    if not plan.ignored:
        return {}
    return {IGNORED_HEADER: ", ".join((names or {}).get(n, n) for n in plan.ignored)}

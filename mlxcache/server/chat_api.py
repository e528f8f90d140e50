"""OpenAI's chat and text completions (`POST /v1/chat/completions`, `/v1/completions`),
streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from mlxcache.modes.call_stream import CallDelta
from mlxcache.server import errors, prepare
from mlxcache.server.blocks import Block, BlockEvent, Closed, Delta, Opened, rendered
from mlxcache.server.front import ignored, parsed
from mlxcache.server.logprobs import Formatter, Scored
from mlxcache.server.openai_format import SSE_DONE, Envelope, error_event, sse
from mlxcache.server.schemas import ChatRequest, CompletionRequest
from mlxcache.server.service import Service, UsageOf
from mlxcache.server.stream import Outcome, Stream

LogprobsOf = Callable[[list[Scored]], dict[str, Any]] | None
"""A reply's `Formatter.chat` or `.completion` (None: no logprobs asked for)."""


def _new_logprobs(stream: Stream, logprobs_of: LogprobsOf) -> dict[str, Any] | None:
    """The logprobs of the tokens that came since the last chunk (a chunk whose tokens'
    text is held back carries none: a later chunk carries them)."""
    scores = stream.new_scores()
    return logprobs_of(scores) if logprobs_of is not None and scores else None


class ChatRenderer:
    """The chat completion chunks of a reply's block events."""

    def __init__(
        self, stream: Stream, env: Envelope, usage: UsageOf | None, logprobs_of: LogprobsOf
    ) -> None:
        self.stream, self.env, self.usage, self.logprobs_of = stream, env, usage, logprobs_of
        self.fresh: Block | None = None  # a call just opened: its first delta names it

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> str:
        logprobs = _new_logprobs(self.stream, self.logprobs_of)
        return sse(self.env.chat_chunk(delta, finish, logprobs))

    async def head(self) -> list[str]:
        return [self.chunk({"role": "assistant", "content": ""})]

    def __call__(self, event: BlockEvent) -> list[str]:
        if isinstance(event, Opened):
            self.fresh = event.block
            return []
        if isinstance(event, Delta):
            block = event.block
            if block.kind != "call":
                return [self.chunk({block.kind: event.text})]
            name = block.name if block == self.fresh else None
            self.fresh = None
            call = self.env.call_delta(CallDelta(block.call, name, event.text))
            return [self.chunk({"tool_calls": [call]})]
        if isinstance(event, Closed):
            return []
        outcome, answer = event.ending.outcome, event.ending.answer
        if answer is None:
            return [error_event(errors.one_line(outcome.error or "")), SSE_DONE]
        out = [self.chunk({}, answer.finish_reason)]
        if self.usage is not None:
            out.append(sse(self.env.usage_chunk(self.usage(outcome))))
        return [*out, SSE_DONE]


async def _completion_events(
    stream: Stream, env: Envelope, usage: UsageOf | None, logprobs_of: LogprobsOf
) -> AsyncIterator[str | Outcome]:
    def chunk(text: str, finish: str | None = None) -> str:
        return sse(env.completion_chunk(text, finish, _new_logprobs(stream, logprobs_of)))

    async for piece in stream.deltas():  # no chat template: all of it is content
        if not isinstance(piece, CallDelta):
            yield chunk(piece[1])
    outcome = stream.outcome()
    yield outcome
    if outcome.error is not None:
        yield error_event(errors.one_line(outcome.error))
        yield SSE_DONE
        return
    yield chunk("", outcome.finish_reason)
    if usage is not None:
        yield sse(env.usage_chunk(usage(outcome), "text_completion"))
    yield SSE_DONE


def router(service: Service) -> APIRouter:
    """The chat and text completion routes over `service`."""
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body: ChatRequest = await parsed(request, ChatRequest)
        plan, env, stream, usage = await service.submit(request, body, prepare.chat, "chatcmpl")
        chat_logprobs = None if plan.vocab is None else Formatter(plan.vocab).chat
        headers = ignored(plan)  # fields that changed nothing, said where a client reads it
        if body.stream:
            render = ChatRenderer(stream, env, usage if body.include_usage else None, chat_logprobs)

            async def done(answer: prepare.Answer) -> None:
                await service.warm(plan, answer)

            events = rendered(stream, plan.answer, render, done)
            return service.stream(events, stream, request, env.id, headers)
        outcome, answer = await service.answered(request, plan, stream, env)
        reply = env.chat(
            answer.content,
            answer.calls,
            answer.finish_reason,
            usage(outcome),
            answer.reasoning,
            None if chat_logprobs is None else chat_logprobs(stream.scored),
        )
        return JSONResponse(reply, headers=headers)

    @routes.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body: CompletionRequest = await parsed(request, CompletionRequest)
        plan, env, stream, usage = await service.submit(request, body, prepare.completion, "cmpl")
        text_logprobs = None if plan.vocab is None else Formatter(plan.vocab).completion
        if body.stream:
            usage_chunk = usage if body.include_usage else None
            events = _completion_events(stream, env, usage_chunk, text_logprobs)
            return service.stream(events, stream, request, env.id)
        outcome = await service.end(request, stream, env)
        logprobs = None if text_logprobs is None else text_logprobs(stream.scored)
        return JSONResponse(
            env.completion(outcome.text, outcome.finish_reason, usage(outcome), logprobs)
        )

    return routes

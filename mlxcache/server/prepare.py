"""From a validated request body to an engine Request, and how to read the reply.

A body is read as the spec it states (`spec_from`: `request_spec.spec_of`, the inverse of
what the `--server` client sends), and the spec goes the one prepare path of every front
end (`mlxcache.prepare`, which in-process commands take too): a reply over HTTP is bitwise
what `mlxcache generate` / `json` / `tools` give on the same spec. Here is only what the
server adds: the fields no spec carries (logprobs, logit bias, verbosity, `n`), a chat's
follow lane, and the answer as the client gets it. Every route's request comes this way:
Messages and Responses convert theirs to a chat completion's first (`front.Converted`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from mlx_lm.sample_utils import make_logits_processors

from mlxcache import prepare as library
from mlxcache.engine import Engine, Request
from mlxcache.events import Result, Stats
from mlxcache.modes.reasoning import Thinking, has_thinking, split_reply
from mlxcache.modes.tool_chat import ToolsTask
from mlxcache.modes.tool_chat import finish_reason as tool_finish
from mlxcache.modes.tools import ToolCall
from mlxcache.prepare import ALONE, NextTurn, Prepared, Tokenizing
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
    next_turn: NextTurn | None = None
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
    plan = _plan(library.prepare(engine, spec, tokenizing, wanted.think))
    # A client may send the next turn as soon as this reply ends: follow it.
    plan.request = replace(plan.request, follow=True)
    plan.ignored = wanted.ignored
    return plan


def _plan(p: Prepared) -> Plan:
    return Plan(p.ids, p.request, p.tools, p.next_turn, p.thinking)


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
    return _plan(library.prepare(engine, spec, tokenizing))


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
    plan.request = replace(request, processors=[*bias, *request.processors], logprobs=logprobs)
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

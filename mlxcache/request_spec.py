"""One request as every front end states it (`RequestSpec`), and as the wire carries it.

`to_wire` writes a spec as a chat (or text) completion's body; `spec_of` reads such a body
back: they are inverses (`tests/test_request_spec.py`). The `--server` client sends its
commands' specs with `to_wire`; the server reads every route's body with `spec_of`
(`server.prepare.spec_from`); what a spec cannot carry is refused in one place each: a
setting no request field takes by `sampling_fields`, an option no request has by its
flag in `IN_PROCESS_ONLY`.

Plain Python, no MLX: the client builds specs without loading a model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from mlxcache.config import SamplingParams
from mlxcache.errors import FieldError, Setting, UserInputError, Worded
from mlxcache.request_settings import CHAT, fields_of
from mlxcache.wire import USAGE_FIELD

if TYPE_CHECKING:
    from mlxcache.encoder import Encoder

CHAT_PATH, TEXT_PATH = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request: what to continue, how to sample, and how to read the reply.

    Attributes:
        messages: the conversation (OpenAI's chat messages), rendered by the chat template.
        prompt: raw text sent as is (no template); None: the request is `messages`'.
        sampling: every sampling setting (`request_settings`).
        stops: texts that end the reply before them.
        response_format: OpenAI's `response_format` (JSON mode), or None.
        tools: OpenAI's tool definitions; `tool_choice` and `parallel_tool_calls` with them.
        reasoning_effort: OpenAI's field: a thinking section on or off (`server.prepare.effort`).
        draft: speculative decoding's mode (None: the server's).
        model: the served model's name (None: the server's only one). It names the
            adapter too: a spec has no adapter field, because the server serves each
            adapter as a model of its own name (a models file's entry of a base and an
            adapter: docs/serving-models.md), so on the wire the adapter is the model
            name. In-process the adapter is the engine's (`--adapter-path`); the
            `--server` client sends the name of the server's one model once its adapter
            and template match the command's (`cli/remote.connect`).
    """

    messages: tuple[Mapping[str, Any], ...] = ()
    prompt: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stops: tuple[str, ...] = ()
    response_format: Mapping[str, Any] | None = None
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: str | Mapping[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    draft: str | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        if self.prompt is not None and self.messages:
            raise ValueError("a request continues messages or a raw prompt, not both")

    @property
    def path(self) -> str:
        """The route the spec is sent to."""
        return TEXT_PATH if self.prompt is not None else CHAT_PATH


IN_PROCESS_ONLY = frozenset(
    {
        "--input",  # json's JSONL batch, and its
        "--output",  # results file: the batch runs in-process
        "--strict",  # json: a schema compiled unlike a request's (`prepare.Local`)
        "--allow-extra-keys",
        "--think",  # a thinking section forced on (a request's reasoning_effort asks)
        "--think-budget",  # and bounded (the server bounds a request's as it chooses)
        "--draft-model",  # the server's to choose: a reply is the same drafted or not
        "--draft-inexact",
        "--check",  # cache stats: the checksums of this machine's cache files
    }
)
"""The options of the commands that send requests (`generate`, `json`, `tools`, `chat`,
`cache stats`) that no request carries: refused with `--server` when set
(`cli/remote.refuse_in_process_only`). Every other option of theirs is carried by the
spec (`to_wire`), checked to match the server's (its model, cache and block size), or
changes no reply (`tests/test_request_spec.py` checks that each is one of those)."""

_OPTIONAL = ("response_format", "tool_choice", "parallel_tool_calls", "reasoning_effort", "draft")
"""The spec's fields sent as the body's fields of the same name, when set."""


def to_wire(spec: RequestSpec) -> dict[str, Any]:
    """`spec` as the body of a completion request (`spec.path`), every sampling setting
    given (the server's defaults play no part) and the request's usage asked for.

    Raises:
        UserInputError: a setting no request carries (`sampling_fields`).
    """
    body: dict[str, Any] = {"model": spec.model, **sampling_fields(spec.sampling)}
    body["stream_options"] = {"include_usage": True}  # the client streams every reply
    if spec.prompt is not None:
        body["prompt"] = spec.prompt
    else:
        body["messages"] = [dict(m) for m in spec.messages]
    if spec.stops:
        body["stop"] = list(spec.stops)
    if spec.tools:
        body["tools"] = [dict(t) for t in spec.tools]
    for name in _OPTIONAL:
        value = getattr(spec, name)
        if value is not None:
            body[name] = dict(value) if isinstance(value, Mapping) else value
    return body


def spec_of(body: Mapping[str, Any], defaults: SamplingParams | None = None) -> RequestSpec:
    """The spec a completion request's body states (`to_wire`'s inverse): the one reading
    of a body, the server's too (`server.prepare.spec_from`). A sampling setting the body
    leaves out is `defaults`' (None: `SamplingParams`'); `max_completion_tokens` (OpenAI's
    newer name) wins over `max_tokens`; `top_p` 0 is OpenAI's "the most likely token";
    empty stops are none.

    Raises:
        SettingError: a setting out of its range (naming it).
        FieldError: both messages and a raw prompt.
    """
    if body.get("messages") and body.get("prompt") is not None:
        raise FieldError("a request continues messages or a raw prompt, not both", "prompt")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    given = {
        row.name: body[name] for name, row in fields_of(CHAT).items() if body.get(name) is not None
    }
    if body.get("max_completion_tokens") is not None:
        given["max_tokens"] = body["max_completion_tokens"]
    if given.get("top_p") == 0:  # a nucleus of no mass: the most likely token
        given.update(top_p=1.0, temperature=0.0)
    return RequestSpec(
        messages=tuple(body.get("messages") or ()),
        prompt=body.get("prompt"),
        sampling=replace(defaults or SamplingParams(), **given),
        stops=tuple(s for s in stops if s),
        tools=tuple(body.get("tools") or ()),
        model=body.get("model"),
        **{name: body.get(name) for name in _OPTIONAL},
    )


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """Every request setting of `params` as request fields, and the flag that asks for
    the request's usage.

    Raises:
        UserInputError: a setting no request field carries (`repetition_context`), not at
            its default.
    """
    carried = fields_of(CHAT)
    sent = {row.name for row in carried.values()}
    for f in fields(SamplingParams):
        if f.name not in sent and getattr(params, f.name) != f.default:
            why = " runs in-process only (no request sets it)"
            raise UserInputError(Worded(Setting(f.name), why))
    return {
        **{name: getattr(params, row.name) for name, row in carried.items()},
        USAGE_FIELD: True,
    }


def conversation(system: str | None, messages: Sequence[Mapping[str, Any]]) -> tuple[Any, ...]:
    """`messages` after a system message of `system` (none for None)."""
    head = [{"role": "system", "content": system}] if system is not None else []
    return (*head, *messages)


def prompt_ids(spec: RequestSpec, encoder: Encoder) -> list[int]:
    """The token ids `spec` continues in-process: its raw prompt as is, or its messages
    through the model's chat template (as the server's completions and chat routes)."""
    if spec.prompt is not None:
        return encoder.encode(spec.prompt)
    return encoder.encode_chat([dict(m) for m in spec.messages])

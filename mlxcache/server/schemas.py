"""Request bodies of the OpenAI endpoints, as pydantic models.

Unknown fields are ignored (clients send many we do not use), except OpenAI's that would
change the reply and are not implemented (`UNSUPPORTED`): those are a 400 naming them.
Known fields are checked strictly, in OpenAI's ranges: a wrong type is a 400 naming the
field, never a crash later, and nothing is coerced (`"stream": "yes"` or `"max_tokens":
"5"` are refused; an integer is a number).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, create_model

from mlxcache import request_settings
from mlxcache.request_settings import CHAT


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


def tagged(*models: type[BaseModel], default: str | None = None) -> Any:
    """The union of `models` told apart by their `type` field (`default`: the type of an
    object without one). A problem inside a member is reported at the member's fields
    (its tag is the model's name, which `errors.from_validation` leaves out of the path);
    an unknown type names the types there are."""
    member = {
        kind: m.__name__ for m in models for kind in get_args(m.model_fields["type"].annotation)
    }
    kinds = ", ".join(repr(k) for k in member)

    def tag(value: Any) -> str | None:
        kind = (
            value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        )
        return member.get(kind) if isinstance(kind, str) else None

    members = tuple(Annotated[m, Tag(m.__name__)] for m in models)
    why = f"Input should be an object whose type is one of {kinds}"
    pick = Discriminator(tag, custom_error_type="unknown_type", custom_error_message=why)
    return Annotated[Union[members], pick]  # noqa: UP007 (a union built at run time)


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MediaPart(_Body):
    """An image, audio or file part: parsed only to be refused by name (`prepare`)."""

    type: Literal["image_url", "input_audio", "file"]


if TYPE_CHECKING:
    ContentPart = TextPart | MediaPart
else:
    ContentPart = tagged(TextPart, MediaPart)


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined, None as empty)."""
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content if isinstance(part, TextPart))
        return self.content or ""


class JsonSchemaFormat(_Body):
    name: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Body):
    include_usage: bool = False


Bias = Annotated[float, Field(ge=-100, le=100)]


def setting_fields(route: str, base: type[_Body]) -> Any:
    """`base` with a field for each request setting `route` carries (`request_settings`):
    optional, of the setting's type, in the route's bounds."""
    derived: dict[str, Any] = {}
    for row in request_settings.SAMPLING:
        name = row.field(route)
        if name is not None:
            bounds = row.api_bounds(route).pydantic()
            derived[name] = (row.kind | None, Field(default=None, **bounds))  # type: ignore[call-overload]
    return create_model(base.__name__, __base__=base, __module__=__name__, **derived)


def settings_given(body: BaseModel, route: str) -> dict[str, Any]:
    """The request settings `body` of `route` carries, as chat completion fields: each
    field `body` declares (None when not sent), and each it does not declare but was sent
    (to be checked as a chat completion's)."""
    declared, extra = type(body).model_fields, body.model_extra or {}
    return {
        row.field(CHAT) or row.name: getattr(body, name) if name in declared else extra[name]
        for name, row in request_settings.fields_of(route).items()
        if name in declared or name in extra
    }


class _Model(_Body):
    model_config = ConfigDict(extra="allow", strict=True)  # `model_extra`: see UNSUPPORTED

    model: str | None = None


if TYPE_CHECKING:
    _Settings = _Model
else:
    _Settings = setting_fields(CHAT, _Model)


class SamplingFields(_Settings):
    if TYPE_CHECKING:  # the request settings' fields are `setting_fields`' (this one is read)
        max_tokens: int | None

    logit_bias: dict[str, Bias] | None = None
    """Token id (as a string, as JSON keys are) -> bias added to its logit."""
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)
    # Ours: speculative decoding for this request (the reply is the plain one either way).
    draft: Literal["auto", "lookup", "model", "off"] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        """A streamed reply ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def stops(self) -> tuple[str, ...]:
        """The stop strings, empty ones dropped."""
        items = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return tuple(s for s in items if s)


class ChatRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Sent by coding agents and SDK wrappers whatever the model (`prepare.effort`).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)


UNSUPPORTED = {
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "web_search_options": "web search is not supported",
    "functions": "functions is not supported (send tools)",
    "function_call": "function_call is not supported (send tool_choice)",
    "echo": "echo is not supported",
    "best_of": "best_of must be 1",
    "suffix": "suffix is not supported",
}
"""OpenAI's fields that would change the reply if honoured, and why they are refused when
set to anything but a neutral value (null, false, empty, or `NEUTRAL`'s): see
`prepare.refuse_unsupported`. Fields that change only bookkeeping or speed (`user`,
`metadata`, `store`, `service_tier`, `prediction`, ...) are accepted and ignored."""
NEUTRAL: dict[str, Any] = {"modalities": ["text"], "best_of": 1}

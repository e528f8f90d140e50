"""What the routes of the other APIs (Anthropic's Messages, OpenAI's Responses) share with
chat completions: a body parsed, a converted request whose errors name the route's own
fields, the ignored-fields header."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from mlxcache.errors import MlxcacheError
from mlxcache.server import errors
from mlxcache.server.errors import APIError
from mlxcache.server.prepare import IGNORED_HEADER, Plan
from mlxcache.server.schemas import ChatRequest


async def parsed(request: Request, schema: type[Any]) -> Any:
    """The request's body checked against `schema` (400 naming the first bad field)."""
    doc = errors.parse_json(await request.body())
    try:
        return schema.model_validate(doc)
    except ValidationError as exc:
        raise errors.from_validation(exc.errors()) from None


@dataclass(frozen=True, slots=True)
class Converted:
    """A chat completion request (`doc`) made from another API's, and where each of its
    messages came from in that request (`origin`: the route's own path of it; `whole`:
    the route's name for the conversation), so that an error about a message names the
    field the client sent."""

    doc: dict[str, Any]
    origin: tuple[str, ...]
    whole: str

    def request(self) -> ChatRequest:
        """The chat completion request (400 on what it does not take)."""
        with self.named():
            try:
                return ChatRequest.model_validate(self.doc)
            except ValidationError as exc:
                raise errors.from_validation(exc.errors()) from None

    @contextlib.contextmanager
    def named(self) -> Iterator[None]:
        """Errors raised inside, as the route's own fields name them."""
        try:
            yield
        except APIError as exc:
            raise self._renamed(exc) from None
        except MlxcacheError as exc:
            raise self._renamed(errors.from_domain(exc)) from None

    def _renamed(self, exc: APIError) -> APIError:
        found = re.fullmatch(r"messages(?:\.(\d+))?(.*)", exc.param or "")
        if found is None or exc.param is None:
            return exc
        at, rest = found.groups()
        own = self.whole if at is None or int(at) >= len(self.origin) else self.origin[int(at)]
        message = exc.message
        if message.startswith(exc.param):
            message = own + rest + message[len(exc.param) :]
        return APIError(exc.status, message, exc.type, own + rest, exc.code, exc.headers)


def ignored(plan: Plan, names: Mapping[str, str] | None = None) -> dict[str, str]:
    """The reply's header naming the request's fields that changed nothing for this model
    (`Plan.ignored`), each by the route's own name for it (`names`: chat field -> it)."""
    if not plan.ignored:
        return {}
    return {IGNORED_HEADER: ", ".join((names or {}).get(n, n) for n in plan.ignored)}

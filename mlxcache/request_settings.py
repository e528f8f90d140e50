"""The request settings, one row each: the one place a sampling setting is spelled.

From `SAMPLING` come `SamplingParams`' range checks (`config`), the CLI's options and the
flags its messages name (`cli/options.py`, `cli/ui.py`), the server's request fields, the
fields each route passes on and the field an error names (`server/`), and the fields the
`--server` client sends (`remote`). `tests/test_request_settings.py` checks that they agree.

Plain Python only: the CLI builds its options from this table at start-up (no MLX,
pydantic or typer here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CHAT, MESSAGES, RESPONSES = "chat", "messages", "responses"
"""The routes: chat (and text) completions, Anthropic's Messages, OpenAI's Responses."""


@dataclass(frozen=True, slots=True)
class Bounds:
    """A closed or open interval (None: unbounded on that side), and how messages say it."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    finite: bool = False
    """Infinity is out too (where no upper bound keeps it out)."""

    def holds(self, value: float) -> bool:
        # Written so that NaN is always out: every comparison with it is False.
        if self.finite and not math.isfinite(value):
            return False
        if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def pydantic(self) -> dict[str, float]:
        """The bounds as pydantic's `Field` takes them."""
        out: dict[str, float] = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


@dataclass(frozen=True, slots=True)
class ApiField:
    """A setting as one route's request carries it."""

    name: str
    bounds: Bounds | None = None
    """What the route's schema accepts (None: the setting's own bounds)."""


@dataclass(frozen=True, slots=True)
class Option:
    """A setting as the CLI's option."""

    flags: tuple[str, ...]
    metavar: str
    help: str


@dataclass(frozen=True, slots=True)
class RequestSetting:
    """One request setting: a `SamplingParams` field and every front end's name for it."""

    name: str
    """The `SamplingParams` field, the library's name in messages (`errors.Setting`)."""
    kind: type
    """int or float (an int is a float's value too; a bool is neither)."""
    default: Any
    bounds: Bounds
    why: str
    """The message's end when a value is out of `bounds` (after the name)."""
    option: Option
    api: Mapping[str, ApiField] = field(default_factory=dict)
    """Route (`CHAT`, `MESSAGES`, `RESPONSES`) -> its request field; a route absent does
    not take the setting (the server's own value is used)."""

    @property
    def flag(self) -> str:
        """The CLI's word for the setting in messages (its long flag)."""
        return self.option.flags[0]

    def field(self, route: str = CHAT) -> str | None:
        """The request field of `route` that carries the setting (None: it carries none)."""
        api = self.api.get(route)
        return None if api is None else api.name

    def api_bounds(self, route: str = CHAT) -> Bounds:
        api = self.api.get(route)
        return self.bounds if api is None or api.bounds is None else api.bounds


def _same(name: str, bounds: Bounds | None = None, *routes: str) -> dict[str, ApiField]:
    """`name` as the field of each of `routes`, with the schema's `bounds` (None: own)."""
    return {route: ApiField(name, bounds) for route in routes}


_OPENAI = (CHAT, RESPONSES)
_EVERY = (CHAT, MESSAGES, RESPONSES)
_PENALTY_HELP = "; 0 is off."

SAMPLING: tuple[RequestSetting, ...] = (
    # In the CLI's help order.
    RequestSetting(
        "max_tokens",
        int,
        256,
        Bounds(low=1),
        " must be >= 1, got {}",
        Option(("--max-tokens", "-n"), "N", "Most tokens to generate."),
        {
            CHAT: ApiField("max_tokens"),
            MESSAGES: ApiField("max_tokens"),
            RESPONSES: ApiField("max_output_tokens"),
        },
    ),
    RequestSetting(
        "temperature",
        float,
        0.0,
        Bounds(low=0, finite=True),
        " must be a finite number >= 0, got {}",
        Option(("--temp", "-t"), "T", "Sampling temperature; 0 is greedy."),
        {
            **_same("temperature", Bounds(0, 2), *_OPENAI),
            MESSAGES: ApiField("temperature", Bounds(0, 1)),
        },
    ),
    RequestSetting(
        "top_p",
        float,
        1.0,
        Bounds(0, 1, low_open=True),
        " must be in (0, 1], got {}",
        Option(("--top-p",), "P", "Nucleus sampling: keep the most likely tokens up to mass P."),
        # 0 is OpenAI's "the most likely token" (`request_spec.spec_of`).
        _same("top_p", Bounds(0, 1), *_EVERY),
    ),
    RequestSetting(
        "top_k",
        int,
        0,
        Bounds(low=0),
        " must be >= 0, got {}",
        Option(("--top-k",), "K", "Sample among the K most likely tokens; 0 keeps all."),
        _same("top_k", None, *_EVERY),
    ),
    RequestSetting(
        "min_p",
        float,
        0.0,
        Bounds(0, 1, high_open=True),
        " must be in [0, 1), got {}",
        Option(
            ("--min-p",),
            "P",
            "Drop tokens less likely than P times the most likely one; 0 keeps all.",
        ),
        _same("min_p", None, *_OPENAI),
    ),
    RequestSetting(
        "repetition_penalty",
        float,
        1.0,
        Bounds(low=0, low_open=True, finite=True),
        " must be > 0, got {}",
        Option(
            ("--repetition-penalty",),
            "X",
            "Penalise the last {repetition_context} tokens' repeats (e.g. 1.1); 1 is off.",
        ),
        # The API's bound leaves infinity to `SamplingParams` (a SettingError naming it).
        _same("repetition_penalty", Bounds(low=0, low_open=True), *_OPENAI),
    ),
    RequestSetting(
        "presence_penalty",
        float,
        0.0,
        Bounds(-2, 2),  # OpenAI's range
        " must be in [-2, 2], got {}",
        Option(
            ("--presence-penalty",),
            "X",
            "Subtract X (-2..2) once from the logit of each token the reply has" + _PENALTY_HELP,
        ),
        _same("presence_penalty", None, CHAT),
    ),
    RequestSetting(
        "frequency_penalty",
        float,
        0.0,
        Bounds(-2, 2),
        " must be in [-2, 2], got {}",
        Option(
            ("--frequency-penalty",),
            "X",
            "Subtract X (-2..2) from a token's logit per occurrence in the reply" + _PENALTY_HELP,
        ),
        _same("frequency_penalty", None, CHAT),
    ),
    RequestSetting(
        "seed",
        int,
        0,
        Bounds(0, 2**63, high_open=True),
        " must be in [0, 2**63), got {}",
        Option(("--seed",), "N", "Seed: the same seed gives the same reply."),
        _same("seed", None, *_OPENAI),
    ),
)
"""Every request setting: the CLI's options and the chat request's fields are in this order."""


def by_name(table: tuple[RequestSetting, ...] | None = None) -> dict[str, RequestSetting]:
    """The rows of `table` (default: `SAMPLING`, as it is now) by setting name."""
    return {row.name: row for row in (SAMPLING if table is None else table)}


def default(name: str) -> Any:
    """The default of setting `name` (its one home)."""
    return by_name()[name].default


def fields_of(route: str) -> dict[str, RequestSetting]:
    """The request fields of `route` that carry a setting -> that setting's row."""
    return {api.name: row for row in SAMPLING if (api := row.api.get(route)) is not None}

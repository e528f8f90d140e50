"""What the engine yields while it serves requests."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class Stats:
    """Per-request numbers, shown after every reply so the user sees the cache work."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefilled_tokens: int = 0
    generated_tokens: int = 0
    restore_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    miss_reason: str = ""
    """Why nothing was resumed, when `cached_tokens` is 0 (e.g. shorter than one block)."""
    cached_from: str = ""
    """Where the cached prefix came from: "memory" or "disk" ("" when nothing was)."""
    draft: str = ""
    """The drafter that drafted the reply ("lookup", "model"; "" when none did)."""
    drafted_tokens: int = 0
    """Tokens drafted and verified (speculative decoding)."""
    accepted_tokens: int = 0
    """... of which the model picked the same (each saved a forward)."""
    verify_forwards: int = 0
    """Forwards of the model while drafting (each verifies a round of drafts)."""
    kv: str = ""
    """What the KV cache holds a key or value element in: "8-bit" or "4-bit" (quantized,
    `CacheConfig.kv_bits`), else the model's float type ("float32", "bfloat16")."""

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first token."""
        steps = self.generated_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form, derived rates included."""
        return {**asdict(self), "decode_tps": round(self.decode_tps, 3)}


CANCELLED = "cancelled"
"""finish_reason of a request cancelled before it finished (`EngineWorker`)."""


@dataclass(frozen=True, slots=True)
class Result:
    """A finished reply. finish_reason: "stop" (end of turn), "length" (max tokens or
    context), "error" (the request failed: `error` says why), "cancelled".
    `stop_token`: the end-of-turn token that ended it (not in `tokens`), if one did;
    `stop_string`: the stop string that ended it (not in `text`), if one did."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats = field(compare=False)
    error: str | None = None
    stop_token: int | None = None
    stop_string: str | None = None


@dataclass(frozen=True, slots=True)
class Prefill:
    """Prompt processing progress: `done` of `total` prompt tokens are in the KV cache;
    `start` of them were before this prefill began (a request's: resumed from the cache)."""

    request_id: int
    done: int
    total: int
    start: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token and the text it completes (may be empty mid-character).

    With `Request.logprobs` set, `logprob` is the token's log-probability and
    `top_logprobs` the (id, log-probability) of the most likely tokens, most likely first.
    A last Token that only flushes held-back text repeats the last id with `logprob` None.
    """

    request_id: int
    token: int
    text: str
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Done:
    """The request finished."""

    request_id: int
    result: Result


Event = Prefill | Token | Done


@dataclass(frozen=True, slots=True)
class Probing:
    """A one-time measurement of this device (`invariance`: seconds to minutes on a real
    model, once per model, device and versions) as it runs: `what` it measures for `model`
    and `why` it matters, `done` of `total` steps after `elapsed_s` seconds. Told with
    `done` 0 when it starts, after each step, and with `done` == `total` when it ends."""

    what: str
    why: str
    model: str
    done: int
    total: int
    elapsed_s: float

    @property
    def finished(self) -> bool:
        return self.done >= self.total

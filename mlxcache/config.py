"""Configuration as data: frozen, validated dataclasses (never CLI objects)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from pathlib import Path

from mlxcache import request_settings
from mlxcache.errors import Setting, SettingError, UserInputError, Worded
from mlxcache.request_settings import default

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_bytes(n: int) -> str:
    """A size the way people read it: 2.8 MiB, 512 B."""
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.1f} {unit}"


def format_size(n: int) -> str:
    """The shortest exact `parse_size` form of `n` bytes (2 << 30 -> "2G")."""
    for unit in "TGMK":
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)


def parse_size(text: str) -> int:
    """Bytes from a size such as `512M`, `2G`, `2GB`, `1.5GiB` or `1000`.

    Raises:
        ValueError: if `text` is not a size.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"not a size: {text!r} (try 512M or 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


_SECONDS = {"": 1, "S": 1, "M": 60, "H": 3600}


def parse_duration(text: str) -> float:
    """Seconds from a duration such as `30s`, `5m`, `1.5h` or `90` (seconds), as Ollama's
    `keep_alive` takes them.

    Raises:
        ValueError: if `text` is not a duration.
    """
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([SMH]?)\s*", text.upper())
    if not m:
        raise ValueError(f"not a duration: {text!r} (try 30s, 5m or 1h)")
    return float(m.group(1)) * _SECONDS[m.group(2)]


ENV_BLOCK_SIZE = "MLXCACHE_BLOCK_SIZE"
ENV_SERVER = "MLXCACHE_SERVER"
"""A running `mlxcache serve` for one-shot commands (`mlxcache.remote`; `--server`)."""
ENV_API_KEY = "MLXCACHE_API_KEY"
"""Its API key (`mlxcache serve --api-key`)."""
ENV_SERVER_TIMEOUT = "MLXCACHE_SERVER_TIMEOUT"
"""How long a `--server` client waits on a silent server, in seconds (default 120)."""
ENV_SERVER_DEADLINE = "MLXCACHE_SERVER_DEADLINE"
"""The most seconds a `--server` request may take in all (default: no limit)."""
METAL_BLOCK_SIZE = 256
"""Metal wants large prefill chunks; not yet measured on a Mac (`mlxcache bench chunks`)."""
CPU_BLOCK_SIZE = 16
"""Measured with `mlxcache bench chunks` on MLX's CPU backend (SmolLM2-135M, 2 cores): 16-,
32- and 64-token chunks prefill within 5% of each other (16 fastest), 256-token chunks ~25%
slower; so the smallest size allowed, 16, which resumes the most of every prompt."""


def default_block_size() -> int:
    """$MLXCACHE_BLOCK_SIZE, else the measured default of the current device.

    Raises:
        UserInputError: the variable is set but not a whole number >= 1 (it is read
            wherever a default is needed, so it fails as user input, not as a bad argument).
    """
    env = os.environ.get(ENV_BLOCK_SIZE, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise UserInputError(f"{ENV_BLOCK_SIZE} must be a whole number >= 1, got {env!r}")
        return int(env)
    import mlx.core as mx

    return METAL_BLOCK_SIZE if mx.default_device() == mx.gpu else CPU_BLOCK_SIZE


@dataclass(frozen=True)  # no slots: `ServerConfig.port` reads a default without building one
class ServerConfig:
    """The server's own settings; each default lives here (`mlxcache serve` reads them).

    Attributes:
        host: the address to bind (loopback).
        port: the port; 0 picks a free one.
        max_queue: requests that may wait beyond the running ones before a 429 (0: no limit).
        max_body: the largest request body, in bytes (else 413).
        lanes: requests run at once where each decodes alone (one forward per request and
            token).
        batched_lanes: ... and where requests decode as one batch (measured exact, or
            `--batch-inexact`): a larger batch costs little more per step.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    max_queue: int = 64
    max_body: int = 8 << 20
    lanes: int = 4
    batched_lanes: int = 16


def _invalid(name: str, why: str) -> SettingError:
    return SettingError(Worded(Setting(name), why))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick tokens. temperature 0 is greedy; a seed makes sampling reproducible.

    top_k 0, min_p 0, repetition_penalty 1 and the presence and frequency penalties 0
    switch their step off. The repetition penalty looks at the last `repetition_context`
    tokens of prompt + reply, so it is the same whether the prompt was resumed from the
    cache or prefilled. The presence and frequency penalties are OpenAI's: subtracted from
    the logit of each token the reply has so far, once (presence) or per occurrence
    (frequency); the prompt plays no part.
    """

    # Defaults, types and ranges: `request_settings.SAMPLING` (test_request_settings checks
    # that these fields are its rows, and repetition_context).
    temperature: float = default("temperature")
    top_p: float = default("top_p")
    seed: int = default("seed")
    max_tokens: int = default("max_tokens")
    top_k: int = default("top_k")
    min_p: float = default("min_p")
    repetition_penalty: float = default("repetition_penalty")
    repetition_context: int = 20
    """In-process only: no request setting (no flag, no request field) carries it."""
    presence_penalty: float = default("presence_penalty")
    frequency_penalty: float = default("frequency_penalty")

    def __post_init__(self) -> None:
        # Types first (settings also come from JSON files): a float seed or a string
        # temperature would otherwise fail deep inside MLX, or be silently coerced.
        rows = request_settings.by_name()
        for f in fields(self):
            value = getattr(self, f.name)
            whole = (rows[f.name].kind if f.name in rows else type(f.default)) is int
            if isinstance(value, bool) or not isinstance(value, Integral if whole else Real):
                kind = "an integer" if whole else "a number"
                raise _invalid(f.name, f" must be {kind}, got {value!r}")
        for f in fields(self):
            row = rows.get(f.name)
            value = getattr(self, f.name)
            if row is not None and not row.bounds.holds(value):
                raise _invalid(row.name, row.why.format(value))
        if self.repetition_context < 1:
            raise _invalid("repetition_context", f" must be >= 1, got {self.repetition_context}")


DRAFTS = ("auto", "lookup", "model", "off")
"""How replies are drafted (`DraftConfig.mode`)."""


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """Speculative decoding: drafts verified by the model, kept only where they are what
    plain decoding would pick (`mlxcache.draft`), so a drafted reply is a plain one.

    Attributes:
        mode: "lookup" drafts the tokens that followed the reply's last n-gram where it
            occurred before in prompt + reply; "model" drafts with `model`; "off" never
            drafts; "auto" drafts with lookup (or `model`) only where this device was
            measured to verify exactly and cheaply.
        model: the draft model's spec (what `mlxcache.model.load` takes); with mode
            "auto" or "model", drafting uses it.
        tokens: the most tokens drafted per verify forward (k; the forward has k + 1 rows);
            None: with n, the pair whose forwards this device's verify probe times
            cheapest per token (`drafting.choose`).
        ngram: lookup's longest n-gram (it tries n down to 1); None: the n chosen with k.
        inexact: draft even where the device was not measured to verify exactly: replies
            may then differ from plain decoding.
    """

    mode: str = "auto"
    model: str | None = None
    tokens: int | None = None
    ngram: int | None = None
    inexact: bool = False

    def __post_init__(self) -> None:
        if self.mode not in DRAFTS:
            raise _invalid("draft", f" must be one of {', '.join(DRAFTS)}, got {self.mode!r}")
        if self.mode == "model" and self.model is None:
            raise _invalid("draft", " model needs a draft model (--draft-model)")
        if self.tokens is not None and not 1 <= self.tokens <= MAX_DRAFT:
            raise _invalid("draft_tokens", f" must be in 1..{MAX_DRAFT}, got {self.tokens}")
        if self.ngram is not None and self.ngram < 1:
            raise _invalid("draft_ngram", f" must be >= 1, got {self.ngram}")


MAX_DRAFT = 8
"""The most tokens a verify forward checks (the probe measures widths up to this + 1)."""


KV_BITS = (4, 8)
"""The KV quantizations offered (`CacheConfig.kv_bits`)."""
KV_GROUP_SIZES = (32, 64, 128)

WARM_AHEAD = True
"""Warm-ahead's default, for `CacheConfig` and an `Engine` built without one."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The prompt cache's settings.

    Attributes:
        enabled: False prefills every request from token 0 and keeps nothing.
        directory: the disk tier and converted models; None: $MLXCACHE_CACHE_DIR or the
            platform cache dir.
        block_size: prefill chunk and cache block length, in tokens; default: per device
            (`default_block_size`), so every command shares one cache namespace.
        mem_bytes: memory tier budget.
        disk_bytes: disk tier budget; 0 disables the disk tier.
        max_entries: slot limit of the memory tier (entries kept at once).
        warm_ahead: after a reply, prefill the conversation as its next turn will start, in
            idle time (`modes.chat.warm_next_turn`), so the next turn resumes past the reply.
        state_stride: for models with recurrent layers, keep their state after every
            `state_stride`-th block (and after each kept prompt's last one); None: chosen
            from the first state's size, so that stored states cost at most a quarter of the
            blocks' KV (the memory tier also keeps states between strides, within an
            eighth of its budget).
        kv_bits: keep attention keys and values quantized to this many bits (4 or 8), from
            token 0, in the cache too (`model.kvquant`); None: full precision.
        kv_group_size: the quantization group along the head dimension (32, 64 or 128).
        mem_limit: the process's memory budget in bytes (`membudget`): requests that would
            pass it wait for room or are refused, and the memory tier is fitted inside it;
            0: none.
    """

    enabled: bool = True
    directory: Path | None = None
    block_size: int = field(default_factory=default_block_size)
    mem_bytes: int = 2 << 30
    disk_bytes: int = 20 << 30
    max_entries: int = 256
    warm_ahead: bool = WARM_AHEAD
    state_stride: int | None = None
    kv_bits: int | None = None
    kv_group_size: int = 64
    mem_limit: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            why = f" must be >= 1, got {self.block_size}"
            raise SettingError(Worded(Setting("block_size", "block size"), why))
        if self.mem_bytes < 0 or self.disk_bytes < 0 or self.mem_limit < 0:
            raise ValueError("cache budgets must be >= 0")
        if self.state_stride is not None and self.state_stride < 1:
            why = f" must be >= 1, got {self.state_stride}"
            raise SettingError(Worded(Setting("state_stride", "state stride"), why))
        if self.kv_bits is not None and self.kv_bits not in KV_BITS:
            why = f" must be one of {', '.join(map(str, KV_BITS))}, got {self.kv_bits}"
            raise SettingError(Worded(Setting("kv_bits", "KV bits"), why))
        if self.kv_group_size not in KV_GROUP_SIZES:
            why = f" must be one of {', '.join(map(str, KV_GROUP_SIZES))}, got {self.kv_group_size}"
            raise SettingError(Worded(Setting("kv_group_size", "KV group size"), why))
        if self.max_entries < 1:
            raise ValueError(f"max entries must be >= 1, got {self.max_entries}")

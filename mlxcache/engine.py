"""The engine: encode -> lookup -> prefill -> decode -> keep -> events.

Requests run as lanes over one model and one cache. Each lane makes exactly the forward
calls it would make alone (batch 1, canonical prefill), and lanes are interleaved call
by call, so a reply never depends on what runs beside it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import NoCache, PrefixCache
from mlxcache.detok import TextStream
from mlxcache.errors import ContextLengthError, GenerationError, UserInputError
from mlxcache.events import Done, Event, Prefill, Result, Stats, Token
from mlxcache.model import LoadedModel
from mlxcache.prefill import prefill
from mlxcache.sampling import LogitsProcessor, SamplingParams, make_processors, make_sampler

DEFAULT_BLOCK_SIZE = 256


@dataclass(slots=True)
class Request:
    """One generation: prompt token ids, sampling, and optional logits processors."""

    tokens: Sequence[int] | np.ndarray
    sampling: SamplingParams = field(default_factory=SamplingParams)
    processors: list[LogitsProcessor] = field(default_factory=list)
    stop_tokens: frozenset[int] | None = None
    """Token ids that end the reply; default: the tokenizer's end-of-turn ids."""


class Engine:
    """Serves requests over one model and one prefix cache.

    Args:
        loaded: the model, tokenizer and model key from `mlxcache.model.load`.
        cache: a prefix cache (see `mlxcache.cache.store.PromptCache`); None keeps nothing.
        block_size: the prefill chunk and cache block length (ignored when `cache` is given).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        cache: PrefixCache | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.loaded = loaded
        self.cache: PrefixCache = cache or NoCache(loaded.model, block_size)
        self._ids = itertools.count()
        self._lanes: dict[int, Generator[Event, None, None]] = {}

    @property
    def model(self) -> Any:
        """The mlx-lm model module (forward calls go through this attribute)."""
        return self.loaded.model

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, ready to reply."""
        ids = self.loaded.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, **template_kwargs
        )
        return [int(t) for t in ids]

    def encode(self, text: str) -> list[int]:
        """Token ids of raw text (no template, no special tokens added)."""
        return [int(t) for t in self.loaded.tokenizer.encode(text, add_special_tokens=False)]

    def check_fits(self, ids: Sequence[int] | np.ndarray, where: str = "the prompt") -> None:
        """Refuse a prompt that leaves no room for a reply in the model's context.

        Raises:
            ContextLengthError: naming `where` and both lengths.
        """
        limit = self.loaded.context_length
        if len(ids) >= limit:
            raise ContextLengthError(
                f"{where} has {len(ids)} tokens; the model's context is {limit}"
            )

    def submit(self, request: Request) -> int:
        """Queue a request as a new lane; returns its id. Validates it first.

        Raises:
            UserInputError: empty prompt.
            ContextLengthError: the prompt leaves no room in the model's context.
        """
        tokens = np.asarray(request.tokens, dtype=np.int32).reshape(-1)
        if tokens.size == 0:
            raise UserInputError("the prompt is empty")
        self.check_fits(tokens, "the prompt")
        rid = next(self._ids)
        self._lanes[rid] = self._lane(rid, tokens, request)
        return rid

    def run(self) -> Iterator[Event]:
        """Advance every lane one model call at a time, round robin, until all are done."""
        while self._lanes:
            for rid in list(self._lanes):
                event = next(self._lanes[rid], None)
                if event is None:
                    del self._lanes[rid]
                    continue
                yield event
                if isinstance(event, Done):
                    del self._lanes[rid]

    def generate(self, request: Request) -> Iterator[Event]:
        """Run one request (other queued lanes advance too); yields its events.

        Closing the iterator early (Ctrl-C, a consumer that stops) cancels the request.
        A failed request raises GenerationError here; `run()` instead ends it with a
        `Done` whose result carries the error, so the other lanes go on.
        """
        rid = self.submit(request)
        try:
            for event in self.run():
                if event.request_id != rid:
                    continue
                if isinstance(event, Done) and event.result.error is not None:
                    raise GenerationError(event.result.error)
                yield event
        finally:
            self.cancel(rid)

    def cancel(self, rid: int) -> None:
        """Stop a request now: its pin is released and it yields nothing more."""
        lane = self._lanes.pop(rid, None)
        if lane is not None:
            lane.close()

    def complete(self, request: Request) -> Result:
        """Run one request to the end and return its result.

        Raises:
            GenerationError: the request failed (e.g. its grammar allowed no token).
        """
        for event in self.generate(request):
            if isinstance(event, Done):
                return event.result
        raise GenerationError("the request ended without a result")  # unreachable by design

    # -- one lane -----------------------------------------------------------------------

    def _lane(self, rid: int, tokens: np.ndarray, req: Request) -> Generator[Event, None, None]:
        stats = Stats(prompt_tokens=int(tokens.size))
        start = time.perf_counter()
        resume = self.cache.restore(tokens)
        try:
            stats.cached_tokens = resume.length
            stats.prefilled_tokens = int(tokens.size) - resume.length
            stats.restore_s = time.perf_counter() - start
            logits = yield from self._prefill(rid, tokens, resume.layers, resume.length)
            result = yield from self._decode(rid, tokens, req, resume.layers, logits, stats, start)
        except GenerationError as exc:
            # This request fails alone: the lanes beside it go on.
            result = Result("", [], "error", stats, error=str(exc))
        finally:
            self.cache.release(resume)
        yield Done(rid, result)  # after the release: a finished request holds no pin

    def _prefill(
        self, rid: int, tokens: np.ndarray, layers: list[Any], start: int
    ) -> Generator[Event, None, mx.array]:
        """Prefill tokens[start:] canonically, keep the prompt's blocks; returns last logits."""
        n, block = int(tokens.size), self.cache.block_size
        # Trimmable KV is kept after the prompt (its full blocks); a whole-state checkpoint
        # (recurrent / rotating layers) must be taken at the last boundary before the end.
        keep_at = (n // block if self.cache.trimmable else (n - 1) // block) * block
        logits = None
        for stop, out in prefill(self.model, layers, tokens, start, block):
            logits = out
            if stop == keep_at and keep_at > start and not self.cache.trimmable:
                self.cache.keep(tokens[:keep_at], layers)
            yield Prefill(rid, stop, n)
        if keep_at > start and self.cache.trimmable:
            self.cache.keep(tokens[:keep_at], layers)
        if logits is None:  # prefill() always ends with the logits chunk
            raise GenerationError("prefill produced no logits")
        return logits

    def _decode(
        self,
        rid: int,
        prompt: np.ndarray,
        req: Request,
        layers: list[Any],
        logits: mx.array,
        stats: Stats,
        start: float,
    ) -> Generator[Event, None, Result]:
        sampling = req.sampling
        sampler = make_sampler(sampling)
        # Sampling's own processors (repetition penalty) first, then the request's (grammar).
        processors = [*make_processors(sampling), *req.processors]
        stop = req.stop_tokens
        if stop is None:
            stop = frozenset(self.loaded.tokenizer.eos_token_ids)
        room = self.loaded.context_length - int(prompt.size)
        budget = min(sampling.max_tokens, room)
        # Token history for processors, kept on the host: an mx.array made from host data is
        # readable at once, while a lazy concatenate would queue behind the forward in flight
        # and stall the grammar's mask computation that should overlap it.
        host = np.empty(prompt.size + budget, dtype=np.int32)
        host[: prompt.size] = prompt
        history = mx.array(prompt)
        text = TextStream(self.loaded.tokenizer)
        out: list[int] = []
        pieces: list[str] = []
        finish = "length"

        def pick(logits: mx.array) -> mx.array:
            for proc in processors:
                logits = proc(history, logits)
            return sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

        y = pick(logits)
        mx.async_eval(y)
        decode_start = 0.0
        nxt = y
        while True:
            more = len(out) + 1 < budget
            if more:
                # Queue the next forward before waiting on this token: graph building
                # overlaps compute (as mlx-lm does). Without processors the sampling is
                # queued too; a processor (grammar) must see the token first.
                nxt = self.model(y.reshape(1, 1), cache=layers)[:, -1, :]
                nxt = pick(nxt) if not processors else nxt
                mx.async_eval(nxt)
            token = cast(int, y.item())
            if not out:
                stats.ttft_s = time.perf_counter() - start
                decode_start = time.perf_counter()
            if token in stop:
                finish = "stop"
                break
            out.append(token)
            piece = text.add(token)
            pieces.append(piece)
            yield Token(rid, token, piece)
            if not more:
                break
            if processors:
                host[prompt.size + len(out) - 1] = token
                history = mx.array(host[: prompt.size + len(out)])
                nxt = pick(nxt)
                mx.async_eval(nxt)
            y = nxt
        tail = text.flush()
        if tail:
            pieces.append(tail)
            yield Token(rid, out[-1], tail)
        stats.generated_tokens = len(out)
        stats.decode_s = time.perf_counter() - decode_start
        return Result("".join(pieces), out, finish, stats)

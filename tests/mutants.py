"""Plausible exactness bugs, each applied through a setattr-like `patch` at a stable seam.

A test applies one with `monkeypatch.setattr` (undone after the test); a child process
(tests/exact_child.py) applies the same one with plain `setattr`. tests/test_mutations.py
checks that each is caught by a guarantee check of tests/guarantees.py.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchRotatingKVCache, KVCache, RotatingKVCache

import mlxcache.background as background_mod
import mlxcache.cache.layout as layout_mod
import mlxcache.cache.live as live_mod
import mlxcache.decode as decode_mod
import mlxcache.draft as draft_mod
import mlxcache.drafting as drafting_mod
import mlxcache.engine as engine_mod
import mlxcache.invariance as invariance
import mlxcache.lanes as lanes_mod
import mlxcache.model.loader as loader_mod
import mlxcache.prefill as prefill_mod
import mlxcache.prefilling as prefilling_mod
import mlxcache.request_lane as request_mod
import mlxcache.sampling as sampling_mod
from mlxcache.cache import blocks
from mlxcache.cache.disk import DiskTier, digest_tokens
from mlxcache.cache.layout import Layout
from mlxcache.cache.live import UNBOUNDED, Live
from mlxcache.cache.memory import MemoryTier, state_name
from mlxcache.cache.store import PromptCache
from mlxcache.config import MAX_DRAFT
from mlxcache.decode_batch import DecodeBatch
from mlxcache.encoder import common_prefix
from mlxcache.engine import Engine
from mlxcache.events import Done, Result
from mlxcache.ring import TimeBatchRing, TimeRing
from mlxcache.sampling import make_processors
from mlxcache.worker import EngineWorker

Patch = Callable[[Any, str, Any], None]


def shared_checkpoint(patch: Patch) -> None:
    """Restore hands out a stored non-trimmable checkpoint's cache objects, not copies."""
    patch(blocks, "from_snapshot", lambda checkpoint: checkpoint)


def no_checksum(patch: Patch) -> None:
    """The disk tier reads files without verifying their checksum."""
    patch(DiskTier, "_read", lambda self, name: self._path(name))


def hash_without_namespace(patch: Patch) -> None:
    """Block names chained without the namespace: two models' blocks of the same tokens
    get one name (the second model links the first one's file instead of writing its own)."""
    chain = blocks.chain_hashes
    patch(blocks, "chain_hashes", lambda tokens, size, ns: chain(tokens, size, ""))


def checkpoint_name_without_namespace(patch: Patch) -> None:
    """Checkpoint files named by the tokens alone: two models' checkpoints of the same
    prompt get one name (the second model links the first one's file)."""
    patch(PromptCache, "_checkpoint_name", lambda self, tokens: f"c-{digest_tokens(tokens)}")


def keep_decode_kv(patch: Patch) -> None:
    """After a reply, the store also keeps the reply's KV (computed by decode steps)."""

    class Keeping(request_mod.RequestLane):
        def _finish(self, result: Result) -> Done:
            lease = self.lease
            assert lease is not None
            ids = np.concatenate([self.tokens, np.asarray(result.tokens, np.int32)])
            ids = ids[: int(lease.layers[0].offset)]
            n = len(ids) // self.work.cache.block_size * self.work.cache.block_size
            if self.work.cache.trimmable and n:
                lease.keep(ids[:n])
            return super()._finish(result)

    patch(request_mod, "RequestLane", Keeping)


def penalty_without_cached_prompt(patch: Patch) -> None:
    """The repetition penalty sees only the prompt tokens the request prefilled, not those
    it resumed from the cache."""

    class Uncached(request_mod.RequestLane):
        def _reply(self) -> decode_mod.Reply:
            reply = super()._reply()
            assert self.lease is not None
            start = self.lease.length
            own = make_processors(reply.ask.sampling, reply.prompt - start)
            reply.procs = [*(_from(start, proc) for proc in own), *reply.ask.processors]
            return reply

    patch(request_mod, "RequestLane", Uncached)


def _from(start: int, proc: Any) -> Any:
    """`proc` seeing the history from `start` on."""
    return lambda tokens, logits: proc(tokens[start:], logits)


class _Batched:
    """Runs each decode step as a batch of 2 (the lane's row twice), as batching lanes into
    one forward would: the model sees batch size 2."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        if x.shape[1] != 1:
            return self._model(x, cache=cache)
        wide = [_map_arrays(c, lambda a: mx.concatenate([a, a])) for c in cache]
        out = self._model(mx.concatenate([x, x]), cache=wide)
        for c, w in zip(cache, wide, strict=True):
            vars(c).update(vars(_map_arrays(w, lambda a: a[:1])))
        return out[:1]


def _map_arrays(cache: Any, f: Callable[[mx.array], mx.array]) -> Any:
    out = copy.copy(cache)
    for name, value in vars(cache).items():
        if isinstance(value, mx.array):
            setattr(out, name, f(value))
    return out


def lanes_batched(patch: Patch) -> None:
    batched = property(lambda self: _Batched(self.loaded.model))
    patch(Engine, "model", batched)  # every forward a lane asks of the engine


def partial_last_block(patch: Patch) -> None:
    """The store also keeps the whole prompt, its partial last block included (when the
    request ends)."""
    restore, release, keep = PromptCache.restore, PromptCache.release, PromptCache.keep
    prompts: dict[int, np.ndarray] = {}  # id(layers) -> the prompt they were restored for

    def restore_noting(
        self: PromptCache,
        tokens: np.ndarray,
        count: bool = True,
        decode_matches_prefill: bool = False,
        whole: bool = False,
    ) -> Any:
        resume = restore(self, tokens, count, decode_matches_prefill, whole)
        prompts[id(resume.layers)] = np.asarray(tokens)
        return resume

    def release_keeping(self: PromptCache, resume: Any) -> None:
        tokens = prompts.pop(id(resume.layers), None)
        if tokens is not None and len(tokens) % self.block_size and self.trimmable:
            keep(self, tokens, resume)
        release(self, resume)

    patch(PromptCache, "restore", restore_noting)
    patch(PromptCache, "release", release_keeping)
    # The store cuts what it keeps to whole blocks; this one files the prompt as given.
    patch(MemoryTier, "_whole_blocks", lambda self, tokens, names: tokens)


def checkpoint_at_prompt_end(patch: Patch) -> None:
    """A request keeps its state after the whole prompt (partial last block included), not
    at the last block boundary before its end."""
    of = prefilling_mod.Prefilling.of

    def at_end(
        work: lanes_mod.Work, lease: Any, tokens: np.ndarray, start: int, keep_at: int
    ) -> prefilling_mod.Prefilling:
        return of(work, lease, tokens, start, len(tokens))

    patch(prefilling_mod.Prefilling, "of", staticmethod(at_end))


def unaligned_chunks(patch: Patch) -> None:
    """Prefill chunks of B counted back from the end, not from absolute multiples of B."""

    def schedule(
        start: int,
        end: int,
        block_size: int,
        decode_matches_prefill: bool = False,
        merge: bool = False,
    ) -> list[tuple[int, int]]:
        stops = list(range(end, start, -block_size))[::-1]
        return list(zip([start, *stops[:-1]], stops, strict=True))

    patch(prefill_mod, "schedule", schedule)


def merged_unprobed(patch: Patch) -> None:
    """Prefill chunks merged up to `MERGED_BLOCKS` blocks wide without the probe's verdict
    (as if every device computed a token's KV the same in any chunk): on the
    shape-sensitive model too, and for a cold prompt's canonical chunks."""
    schedule = prefill_mod.schedule

    def merged(
        start: int,
        end: int,
        block_size: int,
        decode_matches_prefill: bool = False,
        merge_to: int = 0,
    ) -> list[tuple[int, int]]:
        return schedule(start, end, block_size, decode_matches_prefill, merge_to=end)

    patch(prefill_mod, "schedule", merged)


def warm_in_one_chunk(patch: Patch) -> None:
    """Warm-ahead prefills its prefix in one forward call (fewer, larger calls), not in
    canonical chunks. The request that resumes from it makes the right calls; only the
    bits of the KV it resumes from differ (on the shape-sensitive model)."""

    def one_chunk(self: background_mod.WarmLane, lease: Any) -> prefilling_mod.Prefilling:
        state = prefilling_mod.Prefilling.of(
            self.work, lease, self.tokens, lease.length, len(self.tokens)
        )
        state.chunks = deque([(lease.length, len(self.tokens))])
        return state

    patch(background_mod.WarmLane, "_prefilling", one_chunk)


def restore_without_copy(patch: Patch) -> None:
    """join_blocks hands the same restored caches to every restore of the same blocks
    (no fresh copy), so a lane's writes reach the next restore."""
    join = blocks.join_blocks
    handed: dict[tuple[int, ...], list[KVCache]] = {}

    def join_blocks(parts: list[mx.array], n_layers: int) -> list[Any]:
        key = tuple(id(b) for b in parts)
        if key not in handed:
            handed[key] = join(parts, n_layers)
        return handed[key]

    patch(blocks, "join_blocks", join_blocks)


def shared_sampler(patch: Patch) -> None:
    """Every sampler draws from one global key stream instead of its own seed's."""
    state = {"key": mx.random.key(0)}
    mx.eval(state["key"])
    make = sampling_mod.make_sampler

    def make_sampler(params: sampling_mod.SamplingParams) -> sampling_mod.Sampler:
        if params.temperature == 0:
            return make(params)

        def sample(logprobs: mx.array) -> mx.array:
            state["key"], sub = mx.random.split(state["key"])
            mx.eval(state["key"])  # usable from any thread (the engine worker's, this one)
            return mx.random.categorical(logprobs / params.temperature, key=sub)

        return sample

    for module in (sampling_mod, engine_mod, lanes_mod, decode_mod):
        if hasattr(module, "make_sampler"):
            patch(module, "make_sampler", make_sampler)


def follow_in_one_chunk(patch: Patch) -> None:
    """A follow lane that fell behind prefills all the blocks the reply has completed in
    one forward call (fewer, larger calls), not one canonical chunk per block."""

    def one_chunk(
        self: background_mod.FollowLane, lease: Any, ids: np.ndarray, target: int
    ) -> prefilling_mod.Prefilling:
        state = prefilling_mod.Prefilling.of(self.work, lease, ids[:target], self.f.done, target)
        state.chunks = deque([(self.f.done, target)])
        return state

    patch(background_mod.FollowLane, "_prefilling", one_chunk)


def tail_of_a_prefix(patch: Patch) -> None:
    """A remembered whole prompt's tail and logits also resume a longer prompt that starts
    with it, as if that prompt ended there."""
    restore = PromptCache.restore

    def restore_prefix(
        self: PromptCache,
        tokens: np.ndarray,
        count: bool = True,
        decode_matches_prefill: bool = False,
        whole: bool = False,
    ) -> Any:
        for k in range(len(tokens) - 1, self.block_size - 1, -1):
            if not whole and self.mem.tail(tokens[:k]) is not None:
                return restore(self, tokens[:k], count)
        return restore(self, tokens, count, decode_matches_prefill, whole)

    patch(PromptCache, "restore", restore_prefix)


def tail_without_kv(patch: Patch) -> None:
    """A whole prompt resumes with its remembered logits but without its tail's KV."""
    patch(Layout, "append", lambda self, layers, tail: None)


def keep_decode_on_cancel(patch: Patch) -> None:
    """A request cancelled during its reply (Ctrl-C, a client gone) keeps the prompt and
    the reply so far, KV its decode steps computed included."""

    class Keeping(request_mod.RequestLane):
        def close(self) -> None:
            reply, lease = self.reply, self.lease
            cut = reply is not None and reply.stage is not decode_mod.Stage.DONE
            if not self.closed and cut and reply is not None and reply.out and lease:
                layers = lease.layers
                held = int(layers[0].offset) // self.work.cache.block_size
                held *= self.work.cache.block_size
                seen = np.concatenate([self.tokens, np.asarray(reply.out, np.int32)])[:held]
                if held > len(self.tokens) and (
                    self.work.cache.trimmable or held == layers[0].offset
                ):
                    lease.keep(seen)
            super().close()

    patch(request_mod, "RequestLane", Keeping)


def namespace_without_block_size(patch: Patch) -> None:
    """Stored KV filed without its block size: a cache of another block size on the same
    directory sees (and tries to resume) the entries of the first."""
    namespace = blocks.namespace
    patch(blocks, "namespace", lambda key, size, *layout: namespace(key, 0, *layout))


def snapshot_shares_state(patch: Patch) -> None:
    """A whole-state checkpoint takes the live cache's state as it is (no copy): what the
    live cache does next (a recurrent layer's new state in its slot list) reaches it."""
    patch(blocks, "snapshot", lambda layers: [type(c).from_state(c.state) for c in layers])


def no_capture(patch: Patch) -> None:
    """Blocks are not noted right after their chunk: keep cuts them out of the layers
    later, which no longer hold a sliding window's old positions or a block's state."""
    patch(PromptCache, "capture", lambda self, n, lease: None)


def state_of_the_block_start(patch: Patch) -> None:
    """Restored at block k, a recurrent layer gets the state kept after block k-1 (from
    before block k's tokens), not the state after block k."""
    layers_of = MemoryTier._layers

    def stale(self: MemoryTier, entry: Any, length: int) -> list[Any]:
        layers = layers_of(self, entry, length)
        if self.layout is not None and self.layout.has_state and length > self.block_size:
            older = layers_of(self, entry, length - self.block_size)
            for i, kind in enumerate(self.layout.kinds):
                if kind == "state":
                    layers[i] = older[i]
        return layers

    patch(MemoryTier, "_layers", stale)


def probe_trusted(patch: Patch) -> None:
    """Decode KV is taken as canonical without running the probe (as if every device were
    shape-invariant): a reply's decode KV is kept on the shape-sensitive model too."""
    patch(invariance, "decode_matches_prefill", lambda model, block_size: True)


def probe_key_without_model(patch: Patch) -> None:
    """Probe answers recorded per block size, device and versions but not per model: one
    model reads another's."""
    key = invariance._key
    unnamed = "any model"
    patch(
        invariance, "_key", lambda loaded, block_size: key(replace(loaded, key=unnamed), block_size)
    )


def foreign_tail(patch: Patch) -> None:
    """A remembered tail continues any prompt that starts with its tokens, whatever came
    before them (its prefix unchecked)."""

    def partial(self: MemoryTier, tokens: np.ndarray, length: int, limit: int) -> Any:
        if self.layout is None or not self.layout.plain or limit <= 0:
            return None
        best = None
        for tail in self._tails:
            k = common_prefix(tail.ids, tokens[length:])
            if k and (best is None or k > best[1]):
                best = (tail.kv, k)
        if best is None:
            return None
        k = min(best[1], limit)
        return self.layout.head(best[0], k), k

    patch(MemoryTier, "partial", partial)


def resume_past_the_state(patch: Patch) -> None:
    """A recurrent model resumes one block past its last kept state (harmless where every
    block keeps one: `state_stride` 1, or states between strides in memory)."""
    resumable = MemoryTier.resumable

    def later(self: MemoryTier, entry: Any, length: int) -> int:
        found = resumable(self, entry, length)
        return found if found in (0, length) else min(length, found + self.block_size)

    patch(MemoryTier, "resumable", later)


def batch_probe_trusted(patch: Patch) -> None:
    """Rows are taken to decode exactly in a batch without running the probe: requests
    decode together on the shape-sensitive model too."""
    patch(invariance, "batch_matches_solo", lambda model, block_size: True)


def batched_where_not_measured(patch: Patch) -> None:
    """Requests past their first token join the decode batch in an engine that does not
    batch (`Lane.solo` left to a drafted request's plan): the shape-sensitive model, which
    the probe refused, decodes in a batch."""
    request = request_mod.request

    def joining(work: lanes_mod.Work, rid: int, tokens: np.ndarray, *rest: Any) -> Any:
        lane = request(work, rid, tokens, *rest)
        plan = rest[-1]
        lane.solo = bool(plan and not plan.batched)
        return lane

    patch(request_mod, "request", joining)


def resume_anywhere_unprobed(patch: Patch) -> None:
    """Prompts resume inside a block on every device, not only where the probe found a
    token's KV independent of its chunk: on the shape-sensitive model too."""
    restore, chunks_for = PromptCache.restore, prefill_mod.chunks_for

    def anywhere_restore(
        self: PromptCache,
        tokens: Any,
        count: bool = True,
        decode_matches_prefill: bool = False,
        whole: bool = False,
    ) -> Any:
        return restore(self, tokens, count, True, whole)

    def anywhere_chunks(
        layers: Any, end: int, start: int, block_size: int, decode_matches_prefill: bool = False
    ) -> list[tuple[int, int]]:
        return chunks_for(layers, end, start, block_size, decode_matches_prefill=True)

    patch(PromptCache, "restore", anywhere_restore)
    patch(prefilling_mod, "chunks_for", anywhere_chunks)


def reply_end_not_fed(patch: Patch) -> None:
    """A kept reply's KV stops short of its last token: the next turn prefills it again."""
    way_of = request_mod.way_of
    patch(request_mod, "way_of", lambda *args: replace(way_of(*args), decode_matches_prefill=False))


def accept_one_row_late(patch: Patch) -> None:
    """The accept rule reads row i's pick against the draft before it: a first row whose
    pick differs from its draft is accepted, its draft's KV kept and the next row read."""
    patch(
        decode_mod,
        "accepts",
        lambda t, drafts, i: i < len(drafts) and (i == 0 or t == drafts[i - 1]),
    )


def rejected_draft_kv_kept(patch: Patch) -> None:
    """Rejected drafts' KV is not trimmed: the next verify attends to it."""
    patch(draft_mod.Checkpoint, "rewind", lambda self, model, inputs, rejected: None)


def batch_rewind_skipped(patch: Patch) -> None:
    """A drafted row of the decode batch keeps its rejected drafts' KV (and the probe, which
    would refuse such rows, is taken at its word: the replies must show it)."""
    patch(DecodeBatch, "rewind", lambda self, rid, n: None)
    patch(drafting_mod, "batch_verify_probe", lambda *_a, **_k: MAX_DRAFT + 1)


def batch_padding_kept(patch: Patch) -> None:
    """The decode batch drops nothing from its rows' KV: the padding of rows narrower than
    a drafted row's verify, and rejected drafts, stay in it (the probe taken at its word)."""
    patch(DecodeBatch, "_settle", lambda self: None)
    patch(drafting_mod, "batch_verify_probe", lambda *_a, **_k: MAX_DRAFT + 1)


def batch_state_not_restored(patch: Patch) -> None:
    """A drafted row of the decode batch whose drafts are rejected keeps the recurrent
    state it reached over them (the probe, which would refuse such rows, taken at its
    word)."""
    patch(DecodeBatch, "_restore", lambda self, *_a: None)
    patch(drafting_mod, "batch_verify_probe", lambda *_a, **_k: MAX_DRAFT + 1)


def state_not_restored(patch: Patch) -> None:
    """A ring buffer's or recurrent state is not put back before the accepted tokens are
    fed again: it has seen the rejected drafts (and the accepted tokens twice)."""
    patch(draft_mod.Checkpoint, "restore", lambda self: None)


def grammar_over_drafts(patch: Patch) -> None:
    """The history the processors read runs ahead over the drafts (written into it as the
    verify feeds them): a grammar consumes rejected tokens, penalties count them."""
    drafted = decode_mod.Reply._drafted

    def ahead(reply: Any, rows: Any) -> Any:
        if not hasattr(reply, "over"):  # its first step: the history and drafter replaced
            drafter = reply.way.drafter

            class Ahead:
                def propose(self, tokens: np.ndarray, k: int) -> list[int]:
                    drafts = drafter.propose(tokens, k)
                    at = reply.prompt + len(reply.out)
                    reply.host[at : at + len(drafts)] = drafts
                    reply.over = len(drafts)
                    return drafts

                def close(self) -> None:
                    drafter.close()

            reply.over = 0
            reply.tokens = lambda: reply.host[: reply.prompt + len(reply.out) + reply.over]
            reply.way = replace(reply.way, drafter=Ahead())
        return drafted(reply, rows)

    patch(decode_mod.Reply, "_drafted", ahead)


def pick_with_next_key(patch: Patch) -> None:
    """A verify row's pick draws with the next position's key (a key is used up before
    it, as when keys are split for every row of a round up front)."""
    drafted = decode_mod.Reply._drafted

    def next_key(reply: Any, rows: Any) -> Any:
        if not hasattr(reply, "calls"):  # its first step: its pick replaced
            reply.calls, pick = [0], reply.pick

            def late(row: mx.array) -> mx.array:
                reply.calls[0] += 1
                if reply.calls[0] > 1:  # a verify row (the first pick is the prompt's)
                    pick(row)  # this position's key, thrown away
                    if reply.ask.logprobs is not None:
                        reply.drawn_from.pop()
                return pick(row)

            reply.pick = late
        return drafted(reply, rows)

    patch(decode_mod.Reply, "_drafted", next_key)


def ring_one_too_wide(patch: Patch) -> None:
    """A sliding window restored with one position more than a cold prefill leaves in its
    ring (the replies stay the same while mlx-lm trims the spare position)."""
    start = layout_mod._ring_start

    def wider(stop: int, block: int, max_size: int, keep: int) -> tuple[int, int]:
        kept, first = start(stop, block, max_size, keep)
        return kept, first - 1 if first > keep else first

    patch(layout_mod, "_ring_start", wider)


def ring_rotated(patch: Patch) -> None:
    """Sliding windows decode as mlx-lm's ring does: once full, a step writes over the
    oldest slot and attends over the window rotated, other bits than a chunk's (the probe
    then refuses kept replies: every turn prefills its reply again)."""
    patch(TimeRing, "update_and_fetch", RotatingKVCache.update_and_fetch)


def batched_ring_rotated(patch: Patch) -> None:
    """Sliding windows decode in a batch as mlx-lm's batched ring does: once full, a step
    writes over the oldest slot and attends over the window rotated (the batch probe then
    refuses batching for them)."""
    patch(TimeBatchRing, "update_and_fetch", BatchRotatingKVCache.update_and_fetch)
    patch(TimeBatchRing, "make_mask", BatchRotatingKVCache.make_mask)


def capture_without_sync(patch: Patch) -> None:
    """A batched reply's blocks are captured from its own caches as they were when it
    joined the batch, not as the batch holds them."""
    patch(DecodeBatch, "sync", lambda self, rid, layers: None)


def reply_blocks_not_captured(patch: Patch) -> None:
    """A kept reply's blocks are not noted as decode reaches them: on sliding-window and
    recurrent models the reply keeps nothing past the prompt's blocks."""
    way_of = request_mod.way_of
    patch(request_mod, "way_of", lambda *args: replace(way_of(*args), capture=None))


def state_inside_a_block(patch: Patch) -> None:
    """A recurrent model resumes inside a kept block as attention layers do, its recurrent
    state taken from the block's end."""
    partial = MemoryTier.partial

    def inside(self: MemoryTier, tokens: np.ndarray, length: int, limit: int) -> Any:
        found = self.index.continuation(tokens, length) if limit > 0 else None
        if self.layout is None or not self.layout.has_state or found is None:
            return partial(self, tokens, length, limit)
        name = self._entry_blocks[found[0]][length // self.block_size]
        state = self._blocks.get(state_name(name))
        if state is None:
            return partial(self, tokens, length, limit)
        k = min(found[1], limit)
        return {**{n: a[..., :k, :] for n, a in self._blocks[name].data.items()}, **state.data}, k

    patch(MemoryTier, "partial", inside)


def kv_namespace_without_bits(patch: Patch) -> None:
    """Quantized blocks filed without their bit width: 4-bit and 8-bit KV share entries."""
    patch(Layout, "name", property(lambda self: "" if self.plain else "layout-v1"))


def adapter_not_in_key(patch: Patch) -> None:
    """A model's key leaves its adapter out: the base model's entries resume under it."""
    patch(loader_mod, "model_key", lambda base, adapter, template, args: base)


def adapter_not_applied(patch: Patch) -> None:
    """The adapter is checked and named in the key but its layers are never put in."""
    patch(loader_mod, "apply_adapter", lambda model, adapter, name: model)


def jobs_on_the_first_engine(patch: Patch) -> None:
    """A server of several models runs every request on the first model's engine (the
    worker forgets which engine a request named)."""
    submit = EngineWorker.submit

    def first(self: EngineWorker, request: Any, sink: Any, engine: Any = None) -> Any:
        return submit(self, request, sink, self._engines[0])

    patch(EngineWorker, "submit", first)


def events_by_lane_id_alone(patch: Patch) -> None:
    """The worker finds an event's request by its lane id alone: two engines' lanes of
    one id (each engine counts its own) get each other's tokens."""

    def deliver(self: EngineWorker, engine: Engine, event: Any) -> None:
        key = next((k for k in self._active if k[1] == event.request_id), None)
        if key is None:
            return
        job = self._active[key]
        if isinstance(event, Done):
            del self._active[key]
        self._send_to(job, event)

    patch(EngineWorker, "_deliver", deliver)


def live_not_rewound(patch: Patch) -> None:
    """The next turn takes the last reply's live layers as they are, not rewound to where
    its prompt leaves them (an edited turn attends over the old reply's KV too)."""
    patch(Live, "take", lambda self, k: self.layers)


def ring_held_after_dropping(patch: Patch) -> None:
    """A sliding window's ring is held for the next turn by its type alone, also once it
    has dropped positions: an edit inside the window rewinds what the ring no longer
    holds."""

    def by_type(layers: Any) -> int:
        rings = [c.max_size - 1 for c in layers if isinstance(c, TimeRing)]
        return min(rings, default=UNBOUNDED)

    patch(live_mod, "whole_until", by_type)


def ring_merged_past_window(patch: Patch) -> None:
    """A prefill merges its chunks past a sliding window as inside it (the ring's
    contents past it depend on the chunks that filled it)."""
    whole_until = prefill_mod.whole_until
    patch(prefill_mod, "whole_until", lambda layers: UNBOUNDED if whole_until(layers) else 0)


def merged_blocks_not_captured(patch: Patch) -> None:
    """A merged chunk captures only the block it ends (as one chunk per block would): a
    sliding window's earlier blocks of it are not kept."""

    def reached(self: prefilling_mod.Prefilling, stop: int) -> None:
        self.done = stop
        if stop % self.block == 0 and stop <= self.keep_at:
            self.lease.capture(stop)
        if self.kept < self.keep_at <= stop:
            self.kept = self.keep_at
            self.lease.keep(self.tokens[: self.keep_at])

    patch(prefilling_mod.Prefilling, "reached", reached)


def kv_namespace_without_group(patch: Patch) -> None:
    """Quantized blocks filed by their bit width alone: two group sizes share entries."""
    quant = lambda self: "".join(sorted({f"q{bits}" for _group, bits in self._quant.values()}))  # noqa: E731
    name = property(lambda self: "" if self.plain else f"layout-v1-{quant(self)}")
    patch(Layout, "name", name)


def probe_key_without_kv(patch: Patch) -> None:
    """Probe records keyed without the KV quantization: a quantized engine reads the
    full-precision answers (kernels of another kind)."""
    patch(invariance, "kv_tag", lambda layers: "")


def probe_key_without_group(patch: Patch) -> None:
    """Probe records keyed by the KV bit width alone, not its group size."""
    tag = invariance.kv_tag
    patch(invariance, "kv_tag", lambda layers: tag(layers).split("g")[0])


def verify_widest_passed(patch: Patch) -> None:
    """Drafting uses the widest verify width that passed, though a narrower one failed (a
    plan of k drafts also runs the widths below k + 1)."""
    widest = property(lambda self: max([1, *(w for w, ok in self.passed.items() if ok)]))
    patch(invariance.Verify, "width", widest)


def drafts_past_a_stop_string(patch: Patch) -> None:
    """A verify round reads on past the row whose pick ended the reply at a stop string:
    the accepted drafts after it join the reply."""
    accepts = decode_mod.accepts
    patch(decode_mod, "reads_on", lambda reply, token, drafts, i: accepts(token, drafts, i))


def draft_prompt_not_prefilled(patch: Patch) -> None:
    """The draft model takes the prompt as fed though its KV holds only what its cache
    resumed: its positions are stale, its drafts are from elsewhere (the reply stays
    plain: only its acceptance shows it)."""
    patch(draft_mod, "prefill", lambda *args, **kwargs: iter(()))


MUTANTS: dict[str, Callable[[Patch], None]] = {
    f.__name__: f
    for f in (
        shared_checkpoint,
        no_checksum,
        hash_without_namespace,
        checkpoint_name_without_namespace,
        checkpoint_at_prompt_end,
        keep_decode_kv,
        penalty_without_cached_prompt,
        lanes_batched,
        partial_last_block,
        unaligned_chunks,
        merged_unprobed,
        restore_without_copy,
        shared_sampler,
        warm_in_one_chunk,
        tail_of_a_prefix,
        tail_without_kv,
        follow_in_one_chunk,
        keep_decode_on_cancel,
        namespace_without_block_size,
        snapshot_shares_state,
        no_capture,
        state_of_the_block_start,
        probe_trusted,
        probe_key_without_model,
        foreign_tail,
        resume_past_the_state,
        batch_probe_trusted,
        batched_where_not_measured,
        resume_anywhere_unprobed,
        reply_end_not_fed,
        accept_one_row_late,
        rejected_draft_kv_kept,
        batch_rewind_skipped,
        batch_padding_kept,
        batch_state_not_restored,
        state_not_restored,
        grammar_over_drafts,
        pick_with_next_key,
        ring_one_too_wide,
        kv_namespace_without_bits,
        jobs_on_the_first_engine,
        events_by_lane_id_alone,
        kv_namespace_without_group,
        probe_key_without_kv,
        probe_key_without_group,
        verify_widest_passed,
        drafts_past_a_stop_string,
        draft_prompt_not_prefilled,
        ring_rotated,
        batched_ring_rotated,
        capture_without_sync,
        reply_blocks_not_captured,
        state_inside_a_block,
        adapter_not_in_key,
        adapter_not_applied,
        live_not_rewound,
        ring_held_after_dropping,
        ring_merged_past_window,
        merged_blocks_not_captured,
    )
}

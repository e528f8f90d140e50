"""The shape-invariance probe and its record (mlxcache/invariance.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache
from shapemodel import Shaped, checkpointed, shaped
from spy import spied

import mlxcache.invariance as invariance
from mlxcache.bench.families import FAMILIES, build
from mlxcache.cache.base import NoCache
from mlxcache.cache.store import PromptCache
from mlxcache.config import MAX_DRAFT, CacheConfig
from mlxcache.decode_batch import DecodeBatch
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel, load
from mlxcache.ring import TimeBatchRing, TimeRing
from mlxcache.runtime import batch_anyway, open_engine
from mlxcache.sampling import SamplingParams


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_decode_is_canonical_on_cpu_and_not_for_a_shape_sensitive_model(tiny: LoadedModel) -> None:
    assert invariance.decode_matches_prefill(tiny.model, 4)
    assert invariance.decode_matches_prefill(tiny.model, 16)
    assert not invariance.decode_matches_prefill(shaped(tiny).model, 4)


class WideShaped(Shaped):
    """Shape-sensitive only in calls wider than `narrow` tokens: decode steps and canonical
    chunks agree; chunks merged past a block do not."""

    def __init__(self, model: Any, narrow: int) -> None:
        super().__init__(model)
        self._narrow = narrow

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        if x.shape[1] <= self._narrow:
            return self._model(x, cache=cache)
        return super().__call__(x, cache)


class AtWidth(Shaped):
    """Shape-sensitive only in calls of exactly `width` tokens (a kernel that differs at
    one tile size): a merged chunk from a block boundary is that wide, one from inside a
    block is not."""

    def __init__(self, model: Any, width: int) -> None:
        super().__init__(model)
        self._width = width

    def __call__(self, x: mx.array, cache: list[Any]) -> mx.array:
        if x.shape[1] != self._width:
            return self._model(x, cache=cache)
        return super().__call__(x, cache)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_a_merged_chunk_from_a_block_boundary_is_probed(tiny: LoadedModel) -> None:
    assert not invariance.decode_matches_prefill(AtWidth(tiny.model, 4 * 4), 4)
    assert invariance.decode_matches_prefill(AtWidth(tiny.model, 4 * 4 + 1), 4)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_merged_chunks_are_probed(tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose chunks wider than a block compute other bits fails the probe (no
    merged chunks, nor decode KV kept, there); it passes where chunks are not merged."""
    wide = WideShaped(tiny.model, 4)
    assert not invariance.decode_matches_prefill(wide, 4)
    monkeypatch.setattr(invariance, "MERGED_BLOCKS", 1)
    monkeypatch.setattr("mlxcache.prefill.MERGED_BLOCKS", 1)
    assert invariance.decode_matches_prefill(wide, 4)


CANONICAL_DECODE = {"qwen3", "qwen3_moe", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2"}
"""The families whose decode steps this CPU computes as chunked prefill, measured: MLA's
one-row path is another computation than its multi-row one (absorbed projections), Mamba
2's scan differs by length."""


@pytest.fixture(scope="module")
def families(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("probe-families")
    return {name: load(str(build(root / name, tiny.path, c))) for name, c in FAMILIES.items()}


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_block_layout_is_probed(family: str, families: dict[str, LoadedModel]) -> None:
    """Sliding windows (past their size) and recurrent states are measured like plain KV:
    canonical where this CPU computes them so (the shape-sensitive sliding and recurrent
    models fail it: `guarantees.check_kept_replies`)."""
    loaded = families[family]
    assert invariance.decode_matches_prefill(loaded.model, 4) == (family in CANONICAL_DECODE)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_a_ring_decoded_in_place_fails_the_probe(
    families: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's own ring writes a decode step over the oldest slot once the window is full:
    the probe runs past the window and sees those steps differ from chunked prefill."""
    monkeypatch.setattr(TimeRing, "update_and_fetch", RotatingKVCache.update_and_fetch)
    assert not invariance.decode_matches_prefill(families["gemma3_text"].model, 4)
    assert not invariance.decode_matches_prefill(families["gemma3_text"].model, 3)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_batches_exactly(family: str, families: dict[str, LoadedModel]) -> None:
    """Plain KV, recurrent state and sliding windows (past the window, kept in time order)
    decode as one batch with each row's bits its own: the batch probe passes for all."""
    assert invariance.batch_matches_solo(families[family].model, 4)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_a_batched_ring_decoded_in_place_fails_the_batch_probe(
    families: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TimeBatchRing, "update_and_fetch", BatchRotatingKVCache.update_and_fetch)
    monkeypatch.setattr(TimeBatchRing, "make_mask", BatchRotatingKVCache.make_mask)
    assert not invariance.batch_matches_solo(families["gemma3_text"].model, 4)
    assert invariance.batch_matches_solo(families["qwen3"].model, 4)  # no ring: unchanged


def test_models_without_a_block_layout_are_not_probed(recurrent: LoadedModel) -> None:
    assert not invariance.decode_matches_prefill(checkpointed(recurrent).model, 4)
    assert not invariance.batch_matches_solo(checkpointed(recurrent).model, 4)


def test_the_answers_are_recorded_per_model_and_block_size(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def probe(model: object, block_size: int) -> bool:
        calls.append(block_size)
        return block_size == 4

    monkeypatch.setattr(invariance, "decode_matches_prefill", probe)
    monkeypatch.setattr(invariance, "batch_matches_solo", lambda model, block_size: False)
    assert invariance.probe(tiny, 4, tmp_path) == {"decode": True, "batch": False}
    assert invariance.probe(tiny, 4, tmp_path)["decode"]  # read back, not probed again
    assert not invariance.probe(tiny, 8, tmp_path)["decode"]
    assert calls == [4, 8]
    record = json.loads((tmp_path / invariance.PROBES).read_text())
    assert sorted(r["decode"] for r in record.values()) == [False, True]
    (tmp_path / invariance.PROBES).write_text("{not json")  # a damaged record: probe again
    assert invariance.probe(tiny, 4, tmp_path)["decode"]
    assert calls == [4, 8, 4]


def test_open_engine_measures_only_when_asked_and_reads_the_record_by_default(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    config = CacheConfig(block_size=4, directory=tmp_path)
    plain = open_engine(str(tiny_gguf), config)  # nothing recorded: nothing measured
    assert not plain.decode_matches_prefill and not plain.batch_decode
    assert not (tmp_path / invariance.PROBES).exists()
    on_cpu = mx.default_device() == mx.cpu
    asked = open_engine(str(tiny_gguf), config, invariant=True)
    assert asked.decode_matches_prefill == asked.batch_decode == on_cpu
    # Recorded now: the default reads it (one-shot commands, regress, the library).
    recorded = open_engine(str(tiny_gguf), config)
    assert recorded.decode_matches_prefill == recorded.batch_decode == on_cpu
    assert not open_engine(str(tiny_gguf), config, invariant=False).decode_matches_prefill
    off = CacheConfig(enabled=False, block_size=4, directory=tmp_path)
    assert not open_engine(str(tiny_gguf), off, invariant=True).decode_matches_prefill


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_batched_rows_are_exact_on_cpu_and_not_for_a_shape_sensitive_model(
    tiny: LoadedModel,
) -> None:
    assert invariance.batch_matches_solo(tiny.model, 4)
    assert not invariance.batch_matches_solo(shaped(tiny).model, 4)


BATCH_DRAFTED = ("qwen3_moe", "gemma3_text", "gpt_oss", "qwen3_next", "lfm2")
"""The families whose drafted rows join a decode batch on this CPU (every cache layout)."""


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_drafted_rows_in_a_batch_are_exact_on_cpu_and_not_for_a_shape_sensitive_model(
    tiny: LoadedModel,
    sliding: LoadedModel,
    families: dict[str, LoadedModel],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rows verifying drafts beside one-row rows, rejected drafts and padding taken out of
    the caches, give their one-row bits on this CPU at every width, for every layout that
    batches (plain KV, sliding windows, recurrent state); the shape-sensitive model fails,
    and so do families whose verify forwards are not exact even alone, and a batch that
    keeps rejected drafts or padding, leaves a recurrent state past its rejected drafts, or
    lets a row leave without feeding its accepted tokens again."""
    exact = [tiny, sliding, *(families[f] for f in BATCH_DRAFTED)]
    assert [invariance.batch_verify_width(m.model, 4) for m in exact] == [MAX_DRAFT + 1] * 7
    assert invariance.batch_verify_width(shaped(tiny).model, 4) == 1
    for family in ("deepseek_v3", "nemotron_h"):  # MLA, Mamba 2: not exact alone either
        assert invariance.batch_verify_width(families[family].model, 4) == 1
    recurrent = [families["qwen3_next"].model, families["lfm2"].model]
    with monkeypatch.context() as patched:
        patched.setattr(DecodeBatch, "_restore", lambda self, *_a: None)
        assert [invariance.batch_verify_width(m, 4) for m in recurrent] == [1, 1]
    with monkeypatch.context() as patched:
        patched.setattr(DecodeBatch, "_feed_again", lambda self, *_a: None)
        assert [invariance.batch_verify_width(m, 4) for m in recurrent] == [1, 1]
    with monkeypatch.context() as patched:
        patched.setattr(DecodeBatch, "rewind", lambda self, rid, n: None)
        assert invariance.batch_verify_width(tiny.model, 4) == 1
        assert invariance.batch_verify_width(sliding.model, 4) == 1
    monkeypatch.setattr(DecodeBatch, "_settle", lambda self: None)  # padding kept too
    assert invariance.batch_verify_width(tiny.model, 4) == 1
    assert invariance.batch_verify_width(sliding.model, 4) == 1


def test_the_batch_verify_answer_is_recorded(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def width(model: object, block_size: int) -> int:
        calls.append(block_size)
        return 3

    monkeypatch.setattr(invariance, "batch_verify_width", width)
    assert invariance.batch_verify_probe(tiny, 4, tmp_path) == 3
    assert invariance.batch_verify_probe(tiny, 4, tmp_path) == 3  # read back
    assert invariance.batch_verify_probe(tiny, 4, None) == 3  # a sharded run: measured
    assert calls == [4, 4]


def test_batching_anyway_is_what_a_user_asks_for(tiny: LoadedModel, recurrent: LoadedModel) -> None:
    """`serve --batch-inexact`: a model the probe refuses (the shape-sensitive one) decodes
    as one batch all the same; a model whose caches have no batched form cannot."""
    engine = Engine(shaped(tiny), block_size=4)
    assert not engine.batch_decode and batch_anyway(engine) and engine.batch_decode
    loaded, spy = spied(engine.loaded)
    engine.loaded = loaded
    params = SamplingParams(max_tokens=6)
    for seed in range(3):
        engine.submit(Request([5 + seed, 6, 7], params, stop_tokens=frozenset()))
    list(engine.run())
    assert max(spy.batch_sizes) == 3
    assert not batch_anyway(Engine(checkpointed(recurrent), block_size=4))


@pytest.mark.parametrize(("end", "at"), [("length", 7), ("length", 1), ("stop", 3), ("stop", 0)])
def test_a_kept_reply_holds_every_token_drawn(
    tiny: LoadedModel, tmp_path: Path, end: str, at: int
) -> None:
    """Where replies are kept, the next turn resumes after the whole reply, its end token
    included (as mlx-lm's cache does): none of it is prefilled in the next turn's time to
    first token, a reply cut at its limit and an end token drawn first too. The next
    reply is the cold run's."""
    cache = PromptCache(tiny.model, tiny.key, CacheConfig(block_size=4), root=tmp_path / "kv")
    engine = Engine(tiny, cache, decode_matches_prefill=True)
    cold = Engine(tiny, NoCache(tiny.model, 4))
    prompt = [40, 3, 99, 17, 250, 8]  # the tiny model draws 66, 254 x3, then 245 ...
    drawn = cold.complete(Request(prompt, SamplingParams(max_tokens=12), stop_tokens=frozenset()))
    if end == "stop":  # greedy: the reply ends where this token is first drawn
        at = next(i for i in range(at, 12) if drawn.tokens[i] not in drawn.tokens[:i])
        params, stop = SamplingParams(max_tokens=12), frozenset({drawn.tokens[at]})
    else:
        params, stop = SamplingParams(max_tokens=at), frozenset()
    got = engine.complete(Request(prompt, params, stop_tokens=stop))
    assert got.tokens == drawn.tokens[:at] and got.finish_reason == end
    assert got.stop_token == (drawn.tokens[at] if end == "stop" else None)
    fed = [*prompt, *drawn.tokens[: at + (end == "stop")]]
    follow = Request([*fed, 11, 12, 13], SamplingParams(max_tokens=5))
    again = engine.complete(follow)
    assert again.stats.cached_tokens == len(fed)
    assert again.tokens == cold.complete(follow).tokens


def test_every_part_a_probe_verdict_depends_on_keys_its_record(
    tiny: LoadedModel, quantizable: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each part of `invariance.key_parts` changed alone gives another record key, so an
    answer recorded under one is never read under another (every part is varied here: a
    new one must be added). Read and recorded answers apart: tests/guarantees.py
    (`check_probes_apart`, `check_probes_kv_apart`)."""
    import mlx_lm

    from mlxcache.model.kvquant import quantize_kv

    def patched(target: Any, name: str, value: Any) -> list[str]:
        monkeypatch.setattr(target, name, value, raising=False)
        return [invariance._key(quantizable, 4)]

    varied: dict[str, Any] = {
        "model": lambda: [invariance._key(tiny, 4)],
        "block_size": lambda: [invariance._key(quantizable, 8)],
        "device": lambda: patched(mx, "default_device", lambda: mx.Device(mx.gpu)),
        "mlx": lambda: patched(mx, "__version__", "0.0.0-other"),
        "mlx_lm": lambda: patched(mlx_lm, "__version__", "0.0.0-other"),
        "probe": lambda: patched(invariance, "PROBE_VERSION", "p-other"),
        "kv": lambda: [
            invariance._key(quantize_kv(quantizable, bits, group), 4)
            for bits, group in [(8, 32), (4, 32), (8, 64)]
        ],
    }
    assert sorted(invariance.key_parts(quantizable, 4)) == sorted(varied)
    base = invariance._key(quantizable, 4)
    for part, vary in varied.items():
        keys = vary()
        monkeypatch.undo()
        assert base not in keys and len(set(keys)) == len(keys), f"{part}: keys {keys}"

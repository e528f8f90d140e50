"""The llguidance logits processor: mask exactness, the engine contract, failures."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcache import constrain
from mlxcache.constrain import (
    GrammarProcessor,
    apply_mask,
    bitmask_to_bool,
    compile_for,
    grammar_from_json_schema,
    grammar_from_lark,
    ll_tokenizer,
    processor_for,
)
from mlxcache.engine import Engine, Request
from mlxcache.errors import GenerationError, GrammarError
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams

YES_NO = {
    "type": "object",
    "properties": {"ok": {"enum": ["yes", "no"]}},
    "required": ["ok"],
    "additionalProperties": False,
}


def reference_bits(words: np.ndarray, width: int) -> np.ndarray:
    """Obviously right: token t is allowed iff bit t%32 of word t//32 is set."""
    out = np.zeros(width, dtype=bool)
    for t in range(min(width, 32 * words.size)):
        out[t] = (int(words[t // 32]) >> (t % 32)) & 1 == 1
    return out


@pytest.mark.parametrize("width", [1, 31, 32, 33, 262, 288, 300, 1000])
def test_bitmask_to_bool_is_exact_with_padding(width: int) -> None:
    rng = np.random.default_rng(width)
    words = rng.integers(-(2**31), 2**31, size=9, dtype=np.int64).astype(np.int32)  # 288 bits
    words[0] = -1  # all 32 bits set, sign bit included
    got = bitmask_to_bool(words.reshape(1, -1), width)
    assert got.dtype == np.bool_ and got.shape == (width,)
    assert np.array_equal(got, reference_bits(words, width))
    if width > 288:  # model vocab padded past the tokenizer's: never allowed
        assert not got[288:].any()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_apply_mask_keeps_allowed_logits_bitwise(dtype: mx.Dtype) -> None:
    logits = mx.random.normal((1, 50), key=mx.random.key(0)).astype(dtype)
    allowed = np.zeros(50, dtype=bool)
    allowed[[0, 7, 49]] = True
    out = apply_mask(logits, allowed)
    assert out.dtype == dtype and out.shape == (1, 50)
    got = np.array(out.astype(mx.float32))[0]
    ref = np.array(logits.astype(mx.float32))[0]
    assert np.array_equal(got[allowed], ref[allowed])
    assert np.all(np.isneginf(got[~allowed]))


def test_processor_follows_the_engine_contract(tiny: LoadedModel) -> None:
    tok = ll_tokenizer(tiny.tokenizer, tiny.key)
    proc = GrammarProcessor(tok, grammar_from_lark('start: "ab"'), stop_tokens={2})
    prompt = [5, 6, 7]
    width = 262
    logits = mx.zeros((1, width))
    ids = tiny.tokenizer.encode("ab", add_special_tokens=False)
    # First call: the prompt; nothing consumed, only the grammar's first byte allowed.
    first = np.array(proc(mx.array(prompt), logits))[0]
    assert proc.consumed == []
    assert set(np.flatnonzero(np.isfinite(first))) <= set(range(width)) - {2}
    history = list(prompt)
    for token in ids:
        history.append(token)
        out = np.array(proc(mx.array(history), logits))[0]
    assert proc.consumed == ids
    assert proc.complete
    assert list(np.flatnonzero(np.isfinite(out))) == [2]  # complete: only the stop token


def test_processor_rejects_a_forbidden_token(tiny: LoadedModel) -> None:
    proc = processor_for(tiny, grammar_from_lark('start: "ab"'))
    proc(mx.array([5]), mx.zeros((1, 262)))
    bad = tiny.tokenizer.encode("z", add_special_tokens=False)
    with pytest.raises(GenerationError, match="the grammar rejected token"):
        proc(mx.array([5, *bad]), mx.zeros((1, 262)))


def test_processor_needs_a_stop_token_and_a_valid_grammar(tiny: LoadedModel) -> None:
    tok = ll_tokenizer(tiny.tokenizer, tiny.key)
    with pytest.raises(ValueError, match="stop_tokens"):
        GrammarProcessor(tok, grammar_from_lark('start: "a"'), stop_tokens=set())
    with pytest.raises(GrammarError, match="cannot compile the grammar"):
        GrammarProcessor(tok, grammar_from_lark("start: undefined_rule"), stop_tokens={2})


def test_grammar_allowing_nothing_fails_instead_of_nan(tiny: LoadedModel) -> None:
    proc = processor_for(tiny, grammar_from_lark('start: "ab"'))
    # Logits narrower than the vocabulary: the one allowed token falls outside.
    with pytest.raises(GenerationError, match="allows no token"):
        proc(mx.array([5]), mx.zeros((1, 3)))


def test_random_model_still_writes_valid_json_and_stops(tiny: LoadedModel) -> None:
    engine = Engine(tiny)
    proc = processor_for(tiny, grammar_from_json_schema(YES_NO))
    ids = engine.encoder.encode("x")
    result = engine.complete(Request(ids, SamplingParams(max_tokens=40), [proc]))
    assert result.finish_reason == "stop"
    assert json.loads(result.text) in ({"ok": "yes"}, {"ok": "no"})
    assert result.text in ('{"ok": "yes"}', '{"ok": "no"}')  # one line, our separators


def test_sampled_runs_are_seeded_and_valid(tiny: LoadedModel) -> None:
    engine = Engine(tiny)
    texts = []
    for seed in (1, 1, 2):
        proc = processor_for(tiny, grammar_from_json_schema(YES_NO))
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=40)
        result = engine.complete(Request(engine.encoder.encode("x"), params, [proc]))
        assert result.finish_reason == "stop"
        texts.append(json.loads(result.text))
    assert texts[0] == texts[1]


def test_the_tokenizer_view_is_serialized_once_across_processes(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hugging Face tokenizer serialized for llguidance is kept in the directory: a new
    process (no view built yet) reads it, and masks as one that serialized it."""
    monkeypatch.setattr(constrain, "_tokenizers", {})
    first = ll_tokenizer(tiny.tokenizer, tiny.key, tmp_path)
    (kept,) = tmp_path.iterdir()
    assert kept.name.startswith(tiny.key) and json.loads(kept.read_text())["model"]

    def not_again(_self: Any) -> Any:
        raise AssertionError("serialized again")

    monkeypatch.setattr(constrain, "_tokenizers", {})
    monkeypatch.setattr(copy, "copy", not_again)
    again = ll_tokenizer(tiny.tokenizer, tiny.key, tmp_path)
    assert again is not first
    grammar = grammar_from_json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    masks = []
    for tok in (first, again):
        proc = GrammarProcessor(tok, grammar, stop_tokens={2})
        masks.append(proc.allowed(262))
    assert masks[0].any() and np.array_equal(masks[0], masks[1])


def test_an_unwritable_grammar_dir_only_costs_the_shortcut(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constrain, "_tokenizers", {})
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    tok = ll_tokenizer(tiny.tokenizer, tiny.key, blocked / "grammar")
    assert tok.vocab_size > 0 and blocked.read_text() == "not a directory"


def test_the_tokenizer_view_is_kept_under_the_models_cache_dir_one_version_each(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--cache-dir` holds it (not the default cache dir); another version's file of the
    same key is removed when this one is written, another key's (a shard's) is not."""
    monkeypatch.setattr(constrain, "_tokenizers", {})
    monkeypatch.setenv("MLXCACHE_CACHE_DIR", str(tmp_path / "default"))
    loaded = dataclasses.replace(tiny, cache_root=tmp_path / "given")
    folder = tmp_path / "given" / "grammar"
    folder.mkdir(parents=True)
    old, shard = folder / f"{tiny.key}-0.1-0.2.json", folder / f"{tiny.key}-r1of2-0.1-0.2.json"
    old.write_text("{}")
    shard.write_text("{}")
    compile_for(loaded, grammar_from_json_schema({"type": "integer"}))
    kept = sorted(p.name for p in folder.iterdir())
    assert len(kept) == 2 and shard.name in kept and not old.exists()
    assert not (tmp_path / "default").exists()

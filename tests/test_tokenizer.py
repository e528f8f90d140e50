"""The tokenizer rebuilt from GGUF metadata against the GGUF's own vocabulary and template."""

from __future__ import annotations

import shutil
from pathlib import Path

import jinja2
import mlx.core as mx
import pytest

from mlxcache.model.loader import LoadedModel, default_model_path, load

pytestmark = pytest.mark.model

TEXTS = [
    "Hello, world!",
    "naïve café — Ünïcödé ß 東京 😀🚀 👩‍💻",
    "def f(x):\n    return x ** 2  # 12345\n\ttabs\r\n",
    "   leading spaces and trailing   ",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def meta() -> dict:
    return mx.load(str(default_model_path()), return_metadata=True)[1]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(smol: LoadedModel, text: str) -> None:
    ids = smol.tokenizer.encode(text, add_special_tokens=False)
    assert smol.tokenizer.decode(ids) == text


def test_control_tokens_are_single_special_ids(smol: LoadedModel, meta: dict) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    control = [i for i, t in enumerate(meta["tokenizer.ggml.token_type"].tolist()) if t == 3]
    assert len(control) == 17
    for i in control:
        assert smol.tokenizer.encode(tokens[i], add_special_tokens=False) == [i]
    assert smol.tokenizer.decode([1, 2, 504], skip_special_tokens=True) == "The"


def test_digits_split_one_by_one_and_known_ids(smol: LoadedModel) -> None:
    ids = smol.tokenizer.encode("2024 Paris", add_special_tokens=False)
    assert [smol.tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4", " Paris"]
    # Ids of the reference SmolLM2 tokenizer for " Paris" and "The capital of France is".
    assert ids[-1] == 7042
    assert smol.tokenizer.encode("The capital of France is", add_special_tokens=False) == [
        504,
        3575,
        282,
        4649,
        314,
    ]


def test_chat_template_matches_gguf_metadata(smol: LoadedModel, meta: dict) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    expected = (
        jinja2.Environment()
        .from_string(meta["tokenizer.chat_template"])
        .render(messages=messages, add_generation_prompt=True)
    )
    rendered = smol.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert rendered == expected
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("generation", ['{"eos_token_id": [1, 7]}', "not json", None])
def test_end_tokens_are_read_as_mlx_lm_reads_them(
    tiny: LoadedModel, tmp_path: Path, generation: str | None
) -> None:
    """generation_config.json's end ids win over config.json's (a chat model's end-of-turn
    token is often only there); one that cannot be read is skipped, as mlx-lm skips it."""
    from mlx_lm import load as mlx_lm_load

    folder = tmp_path / "model"
    shutil.copytree(tiny.path, folder)
    if generation is not None:
        (folder / "generation_config.json").write_text(generation)
    ours = load(str(folder)).tokenizer.eos_token_ids
    assert ours == mlx_lm_load(str(folder))[1].eos_token_ids
    named = generation is not None and generation.startswith("{")
    assert ours == tiny.tokenizer.eos_token_ids | ({1, 7} if named else set())

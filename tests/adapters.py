"""Fine-tuned adapters built in the tests, saved as `mlx_lm.lora` saves them, with random
non-zero weights (a new LoRA layer's `lora_b` is zero: the adapter would change nothing)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_model

from mlxcache.sampling import SamplingParams, make_processors, make_sampler


def write_adapter(
    model_dir: Path,
    dest: Path,
    fine_tune_type: str = "lora",
    seed: int = 0,
    num_layers: int = 2,
    rank: int = 4,
    scale: float = 4.0,
) -> Path:
    """An adapter for the mlx-lm folder `model_dir` in `dest` (made): the model's last
    `num_layers` layers tuned, every trained parameter random (`full`: the layers' own
    weights, shifted)."""
    model, _ = load_model(model_dir)
    model.freeze()
    # `linear_to_lora_layers` draws `lora_a` from MLX's global generator: seeded here, so an
    # adapter is the same whatever ran before it in the process.
    mx.random.seed(seed)
    if fine_tune_type == "full":
        for layer in model.layers[-num_layers:]:
            layer.unfreeze()
    else:
        params = {"rank": rank, "scale": scale, "dropout": 0.0}
        linear_to_lora_layers(model, num_layers, params, use_dora=fine_tune_type == "dora")
    rng = np.random.default_rng(seed)
    trained = {
        name: mx.array(
            np.asarray(value, dtype=np.float32) + rng.standard_normal(value.shape) * 0.05,
            dtype=value.dtype,
        )
        for name, value in tree_flatten(model.trainable_parameters())
    }
    model.update(tree_unflatten(list(trained.items())))
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / "adapters.safetensors"), trained)
    config = {
        "fine_tune_type": fine_tune_type,
        "num_layers": num_layers,
        "lora_parameters": None
        if fine_tune_type == "full"
        else {"rank": rank, "scale": scale, "dropout": 0.0},
    }
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def mlx_lm_reply(
    model_dir: Path, adapter: Path | None, prompt: list[int], params: SamplingParams
) -> list[int]:
    """mlx-lm's own reply: its `load(model, adapter_path=)` and `generate_step`, drawing
    with mlxcache's sampler of `params` (its own key stream: seeded replies compare)."""
    model, _ = mlx_lm_load(str(model_dir), adapter_path=None if adapter is None else str(adapter))
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=params.max_tokens,
        sampler=make_sampler(params),
        logits_processors=make_processors(params, len(prompt)),
    )
    return [int(token) for token, _ in steps]

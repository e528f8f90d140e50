"""`mlxcache bench adapter`: decode speed with a LoRA adapter, interleaved against mlx-lm's
own adapter generate (`load(model, adapter_path=)` + `stream_generate`) on the same
weights, against the base model without it, and against the adapter fused into the base
weights (what `mlx_lm.fuse` makes: the measured alternative to unfused layers).

Without `--adapter` a LoRA adapter with mlx-lm's training defaults (16 layers, rank 8,
scale 20, every linear layer) and random weights is written to a scratch folder: speed
does not depend on what the weights learnt.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, cast

from mlxcache.bench.decode_bench import PROMPT, _mlx_lm, _ours
from mlxcache.engine import Engine
from mlxcache.model import LoadedModel, load
from mlxcache.model.adapter import WEIGHTS
from mlxcache.types import as_module

GOAL = 0.95
"""Decode tok/s with an adapter over mlx-lm's adapter generate."""
LORA_DEFAULTS = {"num_layers": 16, "rank": 8, "scale": 20.0, "dropout": 0.0}
"""`mlx_lm.lora`'s defaults."""


def random_adapter(model_folder: Path, dest: Path, seed: int = 0) -> Path:
    """A LoRA adapter for `model_folder` in `dest`, as `mlx_lm.lora` saves one, its
    `lora_b` random (a new one's is zero)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(model_folder)
    model.freeze()
    params = {k: LORA_DEFAULTS[k] for k in ("rank", "scale", "dropout")}
    linear_to_lora_layers(model, int(LORA_DEFAULTS["num_layers"]), params)
    mx.random.seed(seed)
    trainable = cast(list[tuple[str, Any]], tree_flatten(model.trainable_parameters()))
    weights = {
        name: mx.random.normal(value.shape, dtype=value.dtype) * 0.002 for name, value in trainable
    }
    dest.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(dest / WEIGHTS), weights)
    config = {
        "fine_tune_type": "lora",
        "num_layers": LORA_DEFAULTS["num_layers"],
        "lora_parameters": params,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config))
    return dest


def fused(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with its LoRA layers fused into the base weights (mlx_lm.fuse's way: a
    quantized base dequantized, the product added, quantized again)."""
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    model = as_module(loaded.model)
    layers = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(layers))
    mx.eval(model.parameters())
    return loaded


def _mlx_lm_engine(path: Path, adapter: Path, like: LoadedModel) -> Engine:
    """mlx-lm's own `load(model, adapter_path=)`, wrapped for `decode_bench._mlx_lm`."""
    from dataclasses import replace

    from mlx_lm.utils import load as mlx_lm_load

    model = mlx_lm_load(str(path), adapter_path=str(adapter))[0]
    return Engine(replace(like, model=model))


def _tokens(engine: Engine, ids: list[int], n: int) -> list[int]:
    from mlxcache.engine import Request
    from mlxcache.sampling import SamplingParams

    request = Request(ids, SamplingParams(max_tokens=n), stop_tokens=frozenset())
    return engine.complete(request).tokens


def run(
    model: str | None = None, adapter: Path | None = None, tokens: int = 32, rounds: int = 3
) -> dict[str, Any]:
    """Median decode tok/s of each loop over `rounds` interleaved rounds, and the ratios."""
    with tempfile.TemporaryDirectory(prefix="mlxcache-adapter-bench-") as scratch:
        base = load(model)
        tuned = adapter or random_adapter(base.path, Path(scratch) / "adapter")
        ours = Engine(load(model, adapter=tuned))
        engines = {
            "adapter": ours,
            "mlx_lm_adapter": _mlx_lm_engine(base.path, tuned, ours.loaded),
            "base": Engine(base),
            "fused": Engine(fused(load(model, adapter=tuned))),
        }
        ids = ours.encoder.encode(PROMPT)
        plain = _tokens(ours, ids, tokens)
        same = {
            "mlx_lm_adapter": _mlx_lm_tokens(engines["mlx_lm_adapter"], ids, tokens) == plain,
            "fused": _tokens(engines["fused"], ids, tokens) == plain,
        }
        tps: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(rounds):
            for name, engine in engines.items():
                measure = _mlx_lm if name == "mlx_lm_adapter" else _ours
                tps[name].append(measure(engine, ids, tokens))
    return _result(tps, same, tokens, rounds, adapter)


def _mlx_lm_tokens(engine: Engine, ids: list[int], n: int) -> list[int]:
    """mlx-lm's greedy tokens (its `generate_step`: no end-of-turn stop, as `_tokens`)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(ids), as_module(engine.model), max_tokens=n)
    return [int(token) for token, _ in steps]


def _result(
    tps: dict[str, list[float]],
    same: dict[str, bool],
    tokens: int,
    rounds: int,
    adapter: Path | None,
) -> dict[str, Any]:
    median = {name: statistics.median(values) for name, values in tps.items()}
    ratio = median["adapter"] / median["mlx_lm_adapter"]
    return {
        "bench": "adapter",
        "adapter": str(adapter) if adapter else "random LoRA (mlx_lm.lora defaults)",
        "tokens": tokens,
        "rounds": rounds,
        **{f"{name}_tps": round(value, 3) for name, value in median.items()},
        "vs_mlx_lm": round(ratio, 4),
        "vs_base": round(median["adapter"] / median["base"], 4),
        "fused_vs_unfused": round(median["fused"] / median["adapter"], 4),
        "same_tokens_as_mlx_lm": same["mlx_lm_adapter"],
        "fused_same_tokens": same["fused"],
        "goal": GOAL,
        "pass": ratio >= GOAL and same["mlx_lm_adapter"],
    }

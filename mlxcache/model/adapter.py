"""Fine-tuned adapters as `mlx_lm.lora` saves them: a folder with `adapter_config.json` and
`adapters.safetensors`, checked up front and applied as mlx-lm's own `load` applies them.

The LoRA layers stay unfused (mlx-lm's `load(..., adapter_path=)` keeps them so): fusing
adds the low-rank product into the base weights, which rounds otherwise and changes the
tokens (measured figures: docs/models.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from mlxcache.errors import AdapterError
from mlxcache.fileio import loads_json
from mlxcache.model.digest import hash_file
from mlxcache.model.folder import settle_random

if TYPE_CHECKING:
    from mlxcache.types import Model

CONFIG, WEIGHTS = "adapter_config.json", "adapters.safetensors"
FINE_TUNE_TYPES = ("lora", "dora", "full")
"""What mlx-lm's `load_adapters` reads (a config without the field is "lora")."""


@dataclass(frozen=True, slots=True)
class Adapter:
    """A checked adapter folder: where it is, its kind and its content digest."""

    path: Path
    fine_tune_type: str
    digest: str
    """xxh3-128 of its config's and weights' bytes (hex): part of the model's key."""

    @property
    def label(self) -> str:
        """How listings name it: folder name and the digest's start."""
        return f"{self.path.name}@{self.digest[:12]}"

    def describe(self) -> dict[str, str]:
        return {"path": str(self.path), "type": self.fine_tune_type, "digest": self.digest}


def check_adapter(path: str | os.PathLike[str]) -> Adapter:
    """The adapter in folder `path`, its files present and its config readable.

    Raises:
        AdapterError: a missing folder or file, a damaged config, a fine-tune type mlx-lm
            does not read.
    """
    folder = Path(path).expanduser().resolve()
    if not folder.is_dir():
        raise AdapterError(f"adapter folder not found: {folder}")
    config_file = folder / CONFIG
    if not config_file.is_file():
        raise AdapterError(f"not an mlx-lm adapter (no {CONFIG}): {folder}")
    try:
        config = loads_json(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read adapter config {config_file}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"adapter config {config_file} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind not in FINE_TUNE_TYPES:
        raise AdapterError(
            f"adapter {folder}: fine-tune type {kind!r} is not supported "
            f"(expected one of {', '.join(FINE_TUNE_TYPES)})"
        )
    if kind != "full" and not _lora_config(config):
        raise AdapterError(
            f"adapter config {config_file}: a {kind} adapter needs 'num_layers' and "
            "'lora_parameters' with 'rank', 'scale' and 'dropout'"
        )
    if not (folder / WEIGHTS).is_file():
        raise AdapterError(f"adapter {folder} has no {WEIGHTS}")
    hasher = xxhash.xxh3_128()
    for name in (CONFIG, WEIGHTS):
        hasher.update(name.encode() + b"\0")
        hash_file(hasher, folder / name)
    return Adapter(folder, str(kind), str(hasher.hexdigest()))


def _lora_config(config: dict[str, Any]) -> bool:
    params = config.get("lora_parameters")
    return (
        isinstance(config.get("num_layers"), int)
        and isinstance(params, dict)
        and all(k in params for k in ("rank", "scale", "dropout"))
    )


def apply_adapter(model: Model, adapter: Adapter, model_name: str) -> Model:
    """`model` with `adapter` applied by mlx-lm's `load_adapters`, in eval mode, as mlx-lm's
    `load(..., adapter_path=)` returns it; its weights are read (a damaged file fails here,
    not in the first reply).

    Raises:
        AdapterError: the weights file is damaged, or its tensors do not fit `model` (an
            adapter trained for another base model).
    """
    import mlx.core as mx
    from mlx_lm.tuner.utils import load_adapters

    from mlxcache.types import as_module

    try:
        weights = mx.load(str(adapter.path / WEIGHTS))
    except (RuntimeError, ValueError, OSError) as exc:
        raise AdapterError(f"adapter {adapter.path}: damaged {WEIGHTS} ({exc})") from exc
    if not isinstance(weights, dict) or not weights:
        raise AdapterError(f"adapter {adapter.path}: {WEIGHTS} holds no tensors")
    del weights  # checked: `load_adapters` reads them again (a full fine-tune's twice over)
    try:
        load_adapters(as_module(model), str(adapter.path))
    except (ValueError, KeyError, TypeError) as exc:
        first = str(exc).strip().splitlines()
        detail = first[1].strip() if len(first) > 1 else (first[0] if first else type(exc).__name__)
        raise AdapterError(
            f"adapter {adapter.path} does not fit model {model_name} "
            f"(trained for another base model?): {detail}"
        ) from exc
    as_module(model).eval()
    mx.eval(as_module(model).parameters())
    settle_random()
    return model

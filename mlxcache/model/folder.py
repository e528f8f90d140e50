"""Loading an mlx-lm model folder, its failures as one domain error."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcache.errors import UnsupportedModelError

if TYPE_CHECKING:
    from mlxcache.types import Model

_MAX_DETAIL = 300  # mlx-lm lists every missing parameter; the error line keeps the start


def load_folder(path: Path, *, lazy: bool = False, what: str = "") -> tuple[Model, dict[str, Any]]:
    """mlx-lm's `load_model(path)`: (model, config).

    Raises:
        UnsupportedModelError: mlx-lm cannot build the model from the folder (unknown
            architecture, weights that do not fit the config, a damaged weight file), in
            one line that starts with `cannot load {what}` (`what` defaults to the path).
    """
    from mlx_lm.utils import load_model

    try:
        loaded = load_model(path, lazy=lazy)
    # MLX reports a damaged or truncated safetensors file as a RuntimeError.
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as exc:
        detail = " ".join(str(exc).split())
        if len(detail) > _MAX_DETAIL:
            detail = detail[: _MAX_DETAIL - 3] + "..."
        raise UnsupportedModelError(f"cannot load {what or f'model {path}'}: {detail}") from exc
    settle_random()
    return loaded


def settle_random() -> None:
    """Evaluate MLX's global PRNG key. Building a model (or its LoRA layers) draws initial
    weights that the loaded ones replace, each draw a lazy split of the key before it:
    left unevaluated, that chain grows with every model built (about 1 MB per SmolLM2
    load), for as long as a server loads and unloads models. Its value is unchanged."""
    import mlx.core as mx

    mx.eval(mx.random.state)

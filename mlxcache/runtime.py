"""Open an engine from settings: the one entry point the CLI and scripts need."""

from __future__ import annotations

from collections.abc import Callable

from mlxcache.cache.base import NoCache, PrefixCache
from mlxcache.cache.layout import Layout
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine
from mlxcache.invariance import probe
from mlxcache.model import LoadedModel, load
from mlxcache.model.gguf import Progress
from mlxcache.paths import cache_dir, kv_dir
from mlxcache.types import new_layers


def make_cache(
    loaded: LoadedModel, config: CacheConfig, on_warning: Callable[[str], None] | None = None
) -> PrefixCache:
    """The prompt cache `config` describes for `loaded` (one that keeps nothing when off)."""
    if not config.enabled:
        return NoCache(loaded.model, config.block_size)
    root = kv_dir(config.directory) if config.disk_bytes > 0 else None
    label = (loaded.name, str(loaded.path))
    return PromptCache(loaded.model, loaded.key, config, root, on_warning, label)


def open_engine(
    model: str | None = None,
    cache_config: CacheConfig | None = None,
    progress: Progress | None = None,
    on_warning: Callable[[str], None] | None = None,
    invariant: bool = False,
) -> Engine:
    """Load `model` (default: the embedded SmolLM2) and attach the prompt cache
    `cache_config` describes.

    Args:
        model: a model spec (see `mlxcache.model.load`).
        cache_config: the prompt cache's settings; default: memory and disk tiers under
            the platform cache dir.
        progress: called as a GGUF conversion advances.
        on_warning: called with one-line warnings (e.g. the disk tier had to be disabled,
            a warm-ahead lane failed).
        invariant: use what this device was measured to compute exactly (`invariance`:
            the probe runs once per model, device and versions): keep each reply's decode
            KV for the next turn, and decode concurrent requests as one batch. Chat and
            serve ask for it.
    """
    config = cache_config or CacheConfig()
    loaded = load(model, cache_root=config.directory, progress=progress, on_warning=on_warning)
    prompts = make_cache(loaded, config, on_warning)
    allowed = measured(loaded, config) if invariant else NOTHING_MEASURED
    return Engine(
        loaded,
        prompts,
        warm_ahead=config.warm_ahead,
        keep_replies=allowed["decode"],
        batch_decode=allowed["batch"],
        on_warning=on_warning,
    )


NOTHING_MEASURED = {"decode": False, "batch": False}


def measured(loaded: LoadedModel, config: CacheConfig) -> dict[str, bool]:
    """What the device allows for `loaded` (`invariance.probe`): "decode", a reply's decode
    KV may be kept as canonical; "batch", requests may decode as one batch. Both False
    but for a plain KV model with the prompt cache on (whose directory keeps the record)."""
    layout = Layout.of(new_layers(loaded.model), config.block_size)
    if not config.enabled or layout is None or not layout.plain:
        return NOTHING_MEASURED
    return probe(loaded, config.block_size, cache_dir(config.directory))


def batch_anyway(engine: Engine) -> bool:
    """Let `engine`'s requests decode as one batch even where this device was not measured
    to give each the bits it gets alone: its replies then depend on the requests running
    beside it (as mlx_lm.server's do); the caller says so to its user. False when the
    model's caches cannot be batched (other than plain KV)."""
    layout = Layout.of(new_layers(engine.model), engine.cache.block_size)
    if layout is None or not layout.plain:
        return False
    engine.batch_decode = True
    return True

"""Open an engine from settings: the one entry point the CLI and scripts need."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, cast

from mlx_lm.models.cache import KVCache

from mlxcache import distributed
from mlxcache.cache.base import NoCache, PrefixCache
from mlxcache.cache.layout import Layout, kv_tag
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig, DraftConfig
from mlxcache.decode_batch import batchable
from mlxcache.draft import same_vocabulary
from mlxcache.drafting import Drafting, DraftModel
from mlxcache.engine import Engine
from mlxcache.errors import Setting, UserInputError, Worded
from mlxcache.invariance import Note, probe, recorded_probe
from mlxcache.launch import launched_rank
from mlxcache.membudget import budgeted
from mlxcache.model import LoadedModel, load
from mlxcache.model.gguf import Progress
from mlxcache.model.kvquant import quantize_kv
from mlxcache.paths import cache_dir, kv_dir
from mlxcache.types import as_module, new_layers


def make_cache(
    loaded: LoadedModel, config: CacheConfig, on_warning: Callable[[str], None] | None = None
) -> PrefixCache:
    """The prompt cache `config` describes for `loaded` (one that keeps nothing when off)."""
    if not config.enabled:
        return NoCache(loaded.model, config.block_size)
    root = kv_dir(config.directory) if config.disk_bytes > 0 else None
    # `cache ls` names a shard's entries and quantized KV's apart (each its own namespace).
    notes = [n for n in (loaded.shard, kv_tag(new_layers(loaded.model))) if n]
    if loaded.adapter is not None:
        notes.append(f"adapter {loaded.adapter.label}")
    if loaded.chat_template is not None or loaded.template_args:
        notes.append("own chat template")
    name = f"{loaded.name} ({', '.join(notes)})" if notes else loaded.name
    label = (name, str(loaded.path))
    return PromptCache(loaded.model, loaded.key, config, root, on_warning, label)


def open_engine(
    model: str | None = None,
    cache_config: CacheConfig | None = None,
    progress: Progress | None = None,
    on_warning: Callable[[str], None] | None = None,
    invariant: bool | None = None,
    split: str | None = None,
    on_rank_lost: Callable[[str | None], None] | None = None,
    draft: DraftConfig | None = None,
    on_note: Note | None = None,
    adapter: str | os.PathLike[str] | None = None,
    chat_template: str | None = None,
    chat_template_args: str | Mapping[str, Any] | None = None,
    shared: Mapping[str, Any] | None = None,
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
            KV for the next turn, and decode concurrent requests as one batch. True:
            measured now where no answer is recorded (chat and serve ask for it); None
            (the default): the recorded answer, read from the cache dir, and the canonical
            path where none is recorded (nothing measured: one-shot commands start at
            once); False: the canonical path.
        split: in a process started by `mlx.launch`, how the model is sharded across the
            processes ("tensor" or "pipeline"; default: tensor where the model supports
            it). The engine then runs as one rank of the run (`distributed`): on rank 0,
            it tells the others each call; on the others, `distributed.follow` makes them.
        on_rank_lost: in such a run, called when another rank's process ended before the
            run did; it must end this process (`distributed.Ranks.watch`). None: not
            watched (a rank may then wait forever for one that is gone).
        draft: speculative decoding's settings (`DraftConfig`); default: never drafts.
        on_note: told as the device's exactness is measured (`events.Probing`: what,
            why, how far; once per model and device: seconds to minutes on a real model,
            with nothing else to show).
        adapter, chat_template, chat_template_args, shared: see `mlxcache.model.load`
            (no adapter in a sharded run; `shared` is not one either).

    Raises:
        RankError: a process of the distributed run stopped or cannot be reached.
        UserInputError: a draft model that cannot draft for `model` (another vocabulary,
            layers other than plain KV).
    """
    config = cache_config or CacheConfig()
    args: dict[str, Any] = {"progress": progress, "on_warning": on_warning}
    template: dict[str, Any] = {
        "chat_template": chat_template,
        "chat_template_args": chat_template_args,
    }
    if launched_rank() is None:
        if split is not None and on_warning is not None:
            on_warning(
                Worded("a split (", Setting("split"), ") is for runs under mlx.launch: ignored")
            )
        loaded = load(
            model,
            cache_root=config.directory,
            adapter=adapter,
            shared=shared,
            **args,
            **template,
        )
        ranks = None
    elif adapter is not None:
        raise UserInputError("an adapter cannot be applied in a sharded run (mlx.launch)")
    else:
        loaded, ranks = _load_shard(model, config, split, {**args, **template}, on_rank_lost)
    if config.kv_bits is not None:
        loaded = quantize_kv(loaded, config.kv_bits, config.kv_group_size, on_warning)
    budget = None
    if config.mem_limit and ranks is None:
        config, budget = budgeted(loaded, config)
    elif config.mem_limit and on_warning is not None:  # the ranks would admit apart
        on_warning(
            Worded("a memory limit (", Setting("mem_limit"), ") is ignored under mlx.launch")
        )
    prompts = make_cache(loaded, config, on_warning)
    allowed = NOTHING_MEASURED
    if invariant is not False and ranks is None:
        allowed = measured(loaded, config, on_note, measure=invariant is True)
    # No probe in a sharded run (its forwards are one rank's): the canonical path. A cache
    # that keeps nothing resumes nothing on every rank: nothing to agree on.
    if ranks is not None and not isinstance(prompts, NoCache):
        prompts = distributed.AgreedCache(prompts, ranks, loaded.model)
    drafting = None
    if draft is not None:
        drafting = _drafting(loaded, config, draft, ranks, {**args, "on_note": on_note})
    return Engine(
        loaded,
        prompts,
        warm_ahead=config.warm_ahead,
        decode_matches_prefill=allowed["decode"],
        batch_decode=allowed["batch"],
        on_warning=on_warning,
        ranks=ranks,
        drafting=drafting,
        budget=budget,
    )


def _drafting(
    loaded: LoadedModel,
    config: CacheConfig,
    draft: DraftConfig,
    ranks: distributed.Ranks | None,
    args: dict[str, Any],
) -> Drafting:
    """The engine's drafting: the draft model loaded and checked, with its own prompt
    cache (a quarter of the memory budget); probes recorded but in a sharded run. There
    rank 0 alone runs the draft model (`drafting.Shared`): it loads it first (a GGUF is
    converted once), the others read it lazily, for the same checks, and never run it."""
    record = None if ranks is not None else cache_dir(config.directory)
    leader = ranks is None or ranks.leader
    helper = None
    if draft.model is not None and draft.mode != "off":
        if not leader:
            distributed.sync("rank 0 loading the draft model")
        small = load(draft.model, cache_root=config.directory, lazy=not leader, **_loading(args))
        if ranks is not None and leader:
            distributed.sync("loading the draft model")
        if not same_vocabulary(small.tokenizer, loaded.tokenizer):
            raise UserInputError(
                f"draft model {small.name} does not share {loaded.name}'s vocabulary "
                "token for token: it cannot draft for it"
            )
        if not all(type(c) is KVCache for c in new_layers(small.model)):
            raise UserInputError(
                f"draft model {small.name} has layers other than plain attention: "
                "choose a plain transformer to draft with"
            )
        own = dataclasses.replace(config, mem_bytes=config.mem_bytes // 4)
        cache = make_cache(small, own, args["on_warning"]) if leader else NoCache(small.model, 1)
        helper = DraftModel(small, cache)
    note = noted(loaded, args["on_note"])
    warn = args["on_warning"]
    agree = None if ranks is None else ranks.from_leader
    return Drafting(loaded, draft, config.block_size, record, helper, warn, note, leader, agree)


def _loading(args: dict[str, Any]) -> dict[str, Any]:
    return {k: args[k] for k in ("progress", "on_warning")}


def _load_shard(
    model: str | None,
    config: CacheConfig,
    split: str | None,
    args: dict[str, Any],
    on_lost: Callable[[str | None], None] | None,
) -> tuple[LoadedModel, distributed.Ranks | None]:
    """This rank's shard of `model`. Rank 0 loads first (a GGUF is converted once, by it)."""
    leader = launched_rank() == 0
    if not leader:
        distributed.sync("rank 0 loading the model")
    loaded = load(model, cache_root=config.directory, lazy=True, **args)
    if leader:
        distributed.sync("loading the model")
    topo = distributed.topology(loaded.model, loaded.config, split)
    if topo is None:  # launched alone: the weights are read at the first forward
        return loaded, None
    ranks = distributed.Ranks(topo)
    if leader:
        distributed.lead(ranks)
    loaded = distributed.shard(loaded, topo)
    if on_lost is not None:
        ranks.watch(on_lost)
    return loaded, ranks


NOTHING_MEASURED = {"decode": False, "batch": False}


def measured(
    loaded: LoadedModel, config: CacheConfig, on_note: Note | None = None, measure: bool = True
) -> dict[str, bool]:
    """What the device allows for `loaded` (`invariance.probe`): "decode", a reply's decode
    KV may be kept as canonical; "batch", requests may decode as one batch. Both False
    but for a model the store keeps block by block (`Layout`) with the prompt cache on
    (whose directory keeps the record). `measure` False: the recorded answer only (a file
    read), both False where none is recorded."""
    layout = Layout.of(new_layers(loaded.model), config.block_size)
    if not config.enabled or layout is None:
        return NOTHING_MEASURED
    directory = cache_dir(config.directory)
    if not measure:
        return recorded_probe(loaded, config.block_size, directory) or NOTHING_MEASURED
    return probe(loaded, config.block_size, directory, noted(loaded, on_note))


NOTED_PARAMETERS = 10_000_000
"""A model this large takes seconds to probe: it is said (a small one is done at once)."""


def noted(loaded: LoadedModel, on_note: Note | None) -> Note | None:
    """`on_note` for a model whose probes take long enough to be said."""
    from mlx.utils import tree_flatten

    if on_note is None:
        return None
    arrays = cast(list[tuple[str, Any]], tree_flatten(as_module(loaded.model).parameters()))
    size = sum(int(v.size) for _, v in arrays)
    return on_note if size >= NOTED_PARAMETERS else None


def batch_anyway(engine: Engine) -> bool:
    """Let `engine`'s requests decode as one batch even where this device was not measured
    to give each the bits it gets alone: its replies then depend on the requests running
    beside it (as mlx_lm.server's do); the caller says so to its user. False when the
    model's caches cannot be batched (`decode_batch.batchable`)."""
    if not batchable(new_layers(engine.model)):
        return False
    engine.batch_decode = True
    return True

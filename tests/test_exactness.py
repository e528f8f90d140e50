"""Every exactness guarantee on the tiny model and its sliding-window version, each plain
and shape-sensitive (tests/guarantees.py has the checks and what they compare)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
from guarantees import (
    B,
    Rig,
    Variant,
    check_adapter_apart,
    check_batched,
    check_bit_flip,
    check_cancelled_decode,
    check_chat,
    check_disk,
    check_drafted,
    check_drafted_stops,
    check_end_token,
    check_follow,
    check_foreign_tail,
    check_fork,
    check_interrupted,
    check_interrupted_inside_a_chunk,
    check_kept_replies,
    check_lanes,
    check_models_interleaved,
    check_new_process,
    check_penalty,
    check_rebuilt_layers,
    check_restore_repeatedly,
    check_ring_turns,
    check_sparse_states,
    check_two_block_sizes,
    check_two_models,
    check_warm,
    check_warm_ahead,
    check_warm_preempted,
    check_worker,
    prompt,
)
from spy import spied

from mlxcache.cache.base import NoCache
from mlxcache.engine import Engine, Request
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams

# Every guarantee on four model variants, new processes; in the fast tier all the same (`make check`).
pytestmark = [pytest.mark.slow, pytest.mark.check]

VARIANTS = [
    "plain",
    "shaped",
    "sliding",
    "shaped-sliding",
    "recurrent",
    "shaped-recurrent",
    "checkpointed",
    "shaped-checkpointed",
    "quantized",
    "shaped-quantized",
    "adapter",
    "shaped-adapter",
]
CHECKS: list[Callable[[Rig], None]] = [
    check_warm,
    check_fork,
    check_chat,
    check_lanes,
    check_penalty,
    check_interrupted,
    check_interrupted_inside_a_chunk,
    check_warm_ahead,
    check_warm_preempted,
    check_worker,
    check_follow,
    check_disk,
    check_new_process,
    check_restore_repeatedly,
    check_bit_flip,
    check_cancelled_decode,
    check_two_block_sizes,
    check_kept_replies,
    check_end_token,
    check_batched,
    check_drafted,
    check_drafted_stops,
    check_foreign_tail,
    check_sparse_states,
    check_rebuilt_layers,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
@pytest.mark.parametrize("name", VARIANTS)
def test_guarantee(
    name: str, check: Callable[[Rig], None], variants: dict[str, Variant], tmp_path: Path
) -> None:
    check(Rig(variants[name], tmp_path))


@pytest.mark.parametrize("name", VARIANTS)
def test_two_models_in_one_directory(
    name: str, variants: dict[str, Variant], other_variants: dict[str, Variant], tmp_path: Path
) -> None:
    check_two_models(Rig(variants[name], tmp_path), other_variants[name])


@pytest.mark.parametrize("name", VARIANTS)
def test_two_models_on_one_engine_worker(
    name: str, variants: dict[str, Variant], other_variants: dict[str, Variant], tmp_path: Path
) -> None:
    check_models_interleaved(Rig(variants[name], tmp_path), other_variants[name])


def last_logits(loaded: LoadedModel, tokens: list[int], block: int) -> mx.array:
    spied_model, spy = spied(loaded)
    Engine(spied_model, NoCache(spied_model.model, block)).complete(
        Request(tokens, SamplingParams(max_tokens=1))
    )
    return spy.last_logits[[sum(c) for c in spy.calls].index(len(tokens))]


@pytest.mark.parametrize("name", ["shaped", "shaped-sliding", "shaped-recurrent"])
def test_the_shaped_model_has_teeth(name: str, variants: dict[str, Variant]) -> None:
    """Another chunking of the same prompt gives other bits (the plain model on CPU: the same)."""
    p = prompt(16)
    shaped = variants[name].loaded
    assert not mx.array_equal(last_logits(shaped, p, B), last_logits(shaped, p, 2 * B))
    plain = variants[name.replace("shaped-", "").replace("shaped", "plain")].loaded
    assert mx.array_equal(last_logits(plain, p, B), last_logits(plain, p, 2 * B))


@pytest.mark.parametrize("name", ["adapter", "shaped-adapter"])
def test_an_adapter_keeps_its_own_namespace(
    name: str, variants: dict[str, Variant], tmp_path: Path
) -> None:
    check_adapter_apart(Rig(variants[name], tmp_path))


@pytest.mark.parametrize("name", ["plain", "shaped"])
def test_a_ring_rewound_inside_its_window(
    name: str, variants: dict[str, Variant], tmp_path: Path
) -> None:
    check_ring_turns(Rig(variants[name], tmp_path))

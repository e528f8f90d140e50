"""The guarantee checks have teeth: each plausible exactness bug (tests/mutants.py),
patched in for one test, makes the checks that guard against it fail."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from guarantees import (
    Rig,
    Variant,
    check_adapter_apart,
    check_batched,
    check_bit_flip,
    check_cancelled_decode,
    check_chat,
    check_drafted,
    check_drafted_stops,
    check_end_token,
    check_follow,
    check_foreign_tail,
    check_fork,
    check_kept_replies,
    check_kv_apart,
    check_lanes,
    check_models_interleaved,
    check_penalty,
    check_probes_apart,
    check_probes_kv_apart,
    check_rebuilt_layers,
    check_restore_repeatedly,
    check_ring_turns,
    check_self_drafted,
    check_sparse_states,
    check_two_block_sizes,
    check_two_models,
    check_uneven_widths,
    check_warm,
    check_warm_ahead,
)
from mutants import MUTANTS

from mlxcache.errors import GenerationError

# The exactness checks rerun under each mutant; in the fast tier all the same (`make check`).
pytestmark = [pytest.mark.slow, pytest.mark.check]

# Which checks, on which variant, must catch each mutant (every one of them must fail).
CAUGHT_BY: dict[str, list[tuple[str, str]]] = {
    "shared_checkpoint": [("checkpointed", "restore_repeatedly")],
    "no_checksum": [("plain", "bit_flip"), ("recurrent", "bit_flip")],
    "hash_without_namespace": [("plain", "two_models"), ("sliding", "two_models")],
    "checkpoint_name_without_namespace": [("checkpointed", "two_models")],
    "checkpoint_at_prompt_end": [("checkpointed", "warm")],
    "keep_decode_kv": [("plain", "chat"), ("shaped", "chat")],
    "penalty_without_cached_prompt": [("plain", "penalty"), ("recurrent", "penalty")],
    "lanes_batched": [("plain", "lanes"), ("shaped", "lanes")],
    "partial_last_block": [("plain", "warm")],
    "unaligned_chunks": [
        ("plain", "warm"),
        ("shaped", "fork"),
        ("sliding", "warm"),
        ("recurrent", "warm"),
    ],
    "merged_unprobed": [("shaped", "chat"), ("shaped", "fork"), ("plain", "warm")],
    "restore_without_copy": [("plain", "restore_repeatedly")],
    "shared_sampler": [("plain", "lanes")],
    "warm_in_one_chunk": [
        ("shaped", "warm_ahead"),
        ("shaped-sliding", "warm_ahead"),
        ("shaped-recurrent", "warm_ahead"),
    ],
    "tail_of_a_prefix": [("plain", "chat"), ("shaped", "chat"), ("recurrent", "chat")],
    "tail_without_kv": [("plain", "warm"), ("plain", "chat"), ("sliding", "warm")],
    "follow_in_one_chunk": [("shaped", "follow")],
    "keep_decode_on_cancel": [("plain", "cancelled_decode"), ("shaped", "cancelled_decode")],
    "namespace_without_block_size": [
        ("plain", "two_block_sizes"),
        ("sliding", "two_block_sizes"),
        ("checkpointed", "two_block_sizes"),
    ],
    "snapshot_shares_state": [("checkpointed", "restore_repeatedly")],
    "no_capture": [("sliding", "fork"), ("recurrent", "fork")],
    "state_of_the_block_start": [("recurrent", "fork"), ("recurrent", "chat")],
    "probe_trusted": [("shaped", "kept_replies")],
    "probe_key_without_model": [("shaped", "probes_apart")],
    "foreign_tail": [("plain", "foreign_tail")],
    "resume_past_the_state": [("recurrent", "sparse_states")],
    "batch_probe_trusted": [("shaped", "batched")],
    "batched_where_not_measured": [("shaped", "batched")],
    "resume_anywhere_unprobed": [("shaped", "chat"), ("shaped", "fork")],
    "reply_end_not_fed": [("plain", "kept_replies"), ("plain", "batched"), ("plain", "end_token")],
    "accept_one_row_late": [("plain", "drafted"), ("recurrent", "drafted")],
    "rejected_draft_kv_kept": [("plain", "drafted")],
    "batch_rewind_skipped": [("plain", "drafted"), ("sliding", "drafted")],
    "batch_padding_kept": [("plain", "drafted"), ("sliding", "drafted")],
    "batch_state_not_restored": [("recurrent", "drafted")],
    "state_not_restored": [("recurrent", "drafted"), ("checkpointed", "drafted")],
    "grammar_over_drafts": [("plain", "drafted")],
    "pick_with_next_key": [("plain", "drafted"), ("recurrent", "drafted")],
    "ring_one_too_wide": [("sliding", "rebuilt_layers")],
    "kv_namespace_without_bits": [("quantized", "kv_apart")],
    "kv_namespace_without_group": [("quantized", "kv_apart")],
    "probe_key_without_kv": [("quantized", "probes_kv_apart")],
    "probe_key_without_group": [("quantized", "probes_kv_apart")],
    "verify_widest_passed": [("plain", "uneven_widths"), ("recurrent", "uneven_widths")],
    "drafts_past_a_stop_string": [
        ("plain", "drafted_stops"),
        ("sliding", "drafted_stops"),
        ("recurrent", "drafted_stops"),
        ("quantized", "drafted_stops"),
    ],
    "draft_prompt_not_prefilled": [("plain", "self_drafted")],
    "ring_rotated": [("sliding", "kept_replies")],
    "batched_ring_rotated": [("sliding", "batched")],
    "capture_without_sync": [("sliding", "batched"), ("recurrent", "batched")],
    "reply_blocks_not_captured": [("sliding", "kept_replies"), ("recurrent", "kept_replies")],
    "state_inside_a_block": [("recurrent", "kept_replies")],
    "adapter_not_in_key": [("adapter", "adapter_apart"), ("shaped-adapter", "adapter_apart")],
    "adapter_not_applied": [("adapter", "adapter_apart")],
    "jobs_on_the_first_engine": [("plain", "models_interleaved")],
    "events_by_lane_id_alone": [("plain", "models_interleaved"), ("sliding", "models_interleaved")],
    "live_not_rewound": [("plain", "kept_replies"), ("quantized", "kept_replies")],
    "ring_held_after_dropping": [("plain", "ring_turns")],
    "ring_merged_past_window": [("plain", "ring_turns")],
    "merged_blocks_not_captured": [("plain", "ring_turns")],
}


@pytest.fixture(params=sorted(MUTANTS))
def mutant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The name of a mutant, patched in for this test."""
    name = str(request.param)
    MUTANTS[name](monkeypatch.setattr)
    return name


def test_every_mutant_has_checks_in_the_fast_tier() -> None:
    """Each mutant is caught by the checks `CAUGHT_BY` names, and those run in the fast
    tier (`make check` selects the tests marked check: this module's)."""
    assert sorted(CAUGHT_BY) == sorted(MUTANTS)
    assert all(CAUGHT_BY[name] for name in MUTANTS)
    assert any(mark.name == "check" for mark in pytestmark)


def test_mutant_is_caught(
    mutant: str,
    variants: dict[str, Variant],
    other_variants: dict[str, Variant],
    tmp_path: Path,
) -> None:
    checks: dict[str, Callable[[Rig], None]] = {
        "warm": check_warm,
        "adapter_apart": check_adapter_apart,
        "fork": check_fork,
        "chat": check_chat,
        "lanes": check_lanes,
        "penalty": check_penalty,
        "restore_repeatedly": check_restore_repeatedly,
        "bit_flip": check_bit_flip,
        "warm_ahead": check_warm_ahead,
        "follow": check_follow,
        "cancelled_decode": check_cancelled_decode,
        "two_block_sizes": check_two_block_sizes,
        "kept_replies": check_kept_replies,
        "end_token": check_end_token,
        "batched": check_batched,
        "drafted": check_drafted,
        "drafted_stops": check_drafted_stops,
        "self_drafted": check_self_drafted,
        "probes_apart": check_probes_apart,
        "foreign_tail": check_foreign_tail,
        "sparse_states": check_sparse_states,
        "rebuilt_layers": check_rebuilt_layers,
        "ring_turns": check_ring_turns,
        "kv_apart": check_kv_apart,
        "probes_kv_apart": check_probes_kv_apart,
        "uneven_widths": check_uneven_widths,
        "two_models": lambda rig: check_two_models(rig, other_variants[rig.variant.name]),
        "models_interleaved": lambda rig: check_models_interleaved(
            rig, other_variants[rig.variant.name]
        ),
    }
    for i, (variant, check) in enumerate(CAUGHT_BY[mutant]):
        # A check fails on a wrong token or bit, or the mutant makes a request fail.
        with pytest.raises((AssertionError, GenerationError)):
            checks[check](Rig(variants[variant], tmp_path / str(i), mutant))


def test_only_the_shaped_model_catches_non_canonical_warm_ahead(
    variants: dict[str, Variant], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The request after warm-ahead makes the cold run's calls from the right resume point:
    the spy and the geometry see nothing, only the bits of the KV differ."""
    MUTANTS["warm_in_one_chunk"](monkeypatch.setattr)
    check_warm_ahead(Rig(variants["plain"], tmp_path / "plain"))
    with pytest.raises(AssertionError, match="logits differ"):
        check_warm_ahead(Rig(variants["shaped"], tmp_path / "shaped"))

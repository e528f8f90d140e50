"""The benchmarks run end to end (on the tiny model, tiny sizes) and report their ratios.

Figures are not asserted: speed targets live in the benchmarks, not in unit tests.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxcache.bench import decode_bench, json_bench, resume_bench

pytestmark = pytest.mark.slow  # each benchmark runs its workload


def test_decode_bench(cache_root: Path, tiny_gguf: Path) -> None:
    result = decode_bench.run(str(tiny_gguf), tokens=4, rounds=1)
    assert result["bench"] == "decode" and result["ratio"] > 0 and isinstance(result["pass"], bool)


def test_resume_bench(cache_root: Path, tiny_gguf: Path) -> None:
    result = resume_bench.run(str(tiny_gguf), turns=2, block_size=4, prefix_tokens=12)
    assert [r["cached"] > 0 for r in result["turns"]] == [False, True]
    assert result["disk_cached_tokens"] > 0
    assert result["second_process_cached"] >= 64  # the shared prefix (~90 tokens), from disk
    assert 0 < result["stored_vs_unique_bytes"] <= 1.2  # shared blocks: bytes follow unique tokens
    assert set(result["goals"]) == {
        "warm_vs_expected",
        "disk_vs_cold",
        "second_vs_first",
        "stored_vs_unique_bytes",
    }


def test_json_bench(cache_root: Path, tmp_path: Path) -> None:
    from tinymodel import write_tiny_gguf

    write_tiny_gguf(tmp_path / "long.gguf", context=4096)  # the shared instructions are long
    result = json_bench.run(str(tmp_path / "long.gguf"), tokens=4, rounds=1, lines=2, block_size=16)
    assert result["same_outputs"] is True and result["ratio"] > 0


def test_chat_bench(cache_root: Path, tmp_path: Path) -> None:
    from tinymodel import write_tiny_gguf

    from mlxcache.bench import chat_bench

    write_tiny_gguf(tmp_path / "long.gguf", context=4096)  # five turns of byte-level tokens
    result = chat_bench.run(str(tmp_path / "long.gguf"), max_tokens=6, block_size=4)
    assert result["identical_to_no_cache"] == {"a": True, "b": True, "d": True}
    assert [len(result["per_turn"][w]) for w in "abdc"] == [5, 5, 5, 5]
    waited = result["per_turn"]["a"]
    assert all(row["cached"] > 0 for row in waited[1:])
    assert result["goals"]["a_prefills_at_most_a_block_plus_the_turn"] is True
    assert result["generate_twice"]["share"] >= 0.75
    # Replies kept (the tiny model passes the probe on CPU): no way prefills a token more
    # than mlx-lm keeping its whole cache, the next turn sent at once and without
    # warm-ahead included.
    if mx.default_device() == mx.cpu:
        for way in "abd":
            assert result["goals"][f"{way}_prefills_at_most_mlx_lm"] is True, way
    assert len(result["prefilled_per_turn"]["c"]) == 5


def test_chunks_bench(cache_root: Path, tiny_gguf: Path) -> None:
    from mlxcache.bench import chunks_bench

    result = chunks_bench.run(str(tiny_gguf), tokens=64, rounds=1, sizes=(8, 16, 32))
    assert set(result["tps"]) == {"8", "16", "32"} and result["suggested_block_size"] in (16, 32)
    assert chunks_bench.suggest({8: 100.0, 16: 95.0, 32: 100.0, 64: 80.0}) == 16
    assert chunks_bench.suggest({8: 100.0, 16: 50.0, 32: 89.0, 64: 91.0}) == 64


SHORT_SUITE = """
model: tiny
defaults: {temperature: 0, max_tokens: 8, seed: 0}
cases:
  - {name: plain, kind: plain, prompt: Say hi.}
  - {name: yes-no, kind: json, schema: {type: boolean}, prompts: ["Is it?", "Is it not?"]}
"""
"""A suite whose JSON replies the tiny random model completes (a boolean) within its
token limit: every reply `bench spec` times must be valid."""


def test_spec_bench(
    cache_root: Path, wide_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every drafter and round runs requests of its own (a JSON request's matcher serves
    one reply: a second submission would be refused) and every JSON reply is valid."""
    from mlxcache.bench import spec_bench

    monkeypatch.setattr(spec_bench, "PRODUCTS", {"type": "boolean"})
    suite = tmp_path / "short.yaml"
    suite.write_text(SHORT_SUITE)
    rows = list(spec_bench.run(str(wide_gguf), None, 8, 12, 3, suite, tmp_path / "c", rounds=2))
    assert [r.get("workload") for r in rows] == ["code", "json", "chat", "regress", None]
    for row in rows[:-1]:
        assert all(row[d]["same_bytes"] for d in ("plain", "lookup", "model", "auto")), row
        assert row["plain"]["acceptance"] is None and row["model"]["acceptance"] is not None
        # The draft model drafts unconstrained: a grammar's replies may reject them all.
        assert row["model"]["acceptance"] > 0 or row["workload"] == "json", row["workload"]
    assert rows[0]["lookup"]["forwards_per_token"] < rows[0]["plain"]["forwards_per_token"]
    summary = rows[-1]
    assert summary["probe_width"] == 9 and summary["goals"]["same_bytes"] is True
    totals = [sum(r[d]["decode_s"] for r in rows[:-1]) for d in ("auto", "plain")]
    assert summary["auto_vs_plain"] == round(totals[0] / totals[1], 3)
    assert set(summary["goals"]) == {
        "lookup_forwards_code",
        "lookup_forwards_json",
        "same_bytes",
        "auto_not_slower",
    }


def test_spec_bench_fails_on_a_broken_json_reply(
    cache_root: Path, wide_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The random model cannot complete the products list in 12 tokens: the bench stops
    with the reply's error, never times it."""
    from mlxcache.bench import spec_bench
    from mlxcache.errors import OutputError

    monkeypatch.setattr(spec_bench, "JSON_TOKENS", 0)  # --tokens alone: 12

    suite = tmp_path / "short.yaml"
    suite.write_text(SHORT_SUITE)
    with pytest.raises(OutputError, match=r"plain reply \(round 1\) is broken: .*token limit"):
        list(spec_bench.run(str(wide_gguf), None, 8, 12, 3, suite, tmp_path / "c", rounds=1))


def test_spec_sweep(cache_root: Path, wide_gguf: Path, tmp_path: Path) -> None:
    """Every workload, n and k replayed; the summary's profile and the pair drafting picks
    with it on this device's measured costs."""
    from mlxcache.bench import spec_bench
    from mlxcache.drafting import choose

    suite = Path(__file__).parent.parent / "examples" / "smoke.yaml"
    rows = list(spec_bench.sweep(str(wide_gguf), 8, 12, suite, tmp_path / "c"))
    *lines, summary = rows
    pairs = [(n, k) for n in spec_bench.SWEEP_NGRAMS for k in spec_bench.SWEEP_K]
    workloads = ["code", "json", "chat", "regress"]
    assert [(r["workload"], r["ngram"], r["k"]) for r in lines] == [
        (w, n, k) for w in workloads for n, k in pairs
    ]
    for r in lines:  # a forward yields at least its own pick; lookup drafts k or nothing
        assert r["tokens_per_forward"] >= 1 and 0 <= r["drafted_share"] <= 1
        assert r["forwards_per_token"] <= 1 and r["expected_vs_plain"] > 0
    profile = {tuple(map(int, nk.split(","))): tuple(v) for nk, v in summary["profile"].items()}
    assert sorted(profile) == sorted(pairs)
    costs = {int(w): c for w, c in summary["probe_costs"].items()}
    n, k, ratio = choose(costs, summary["probe_width"], profile=profile)  # type: ignore[arg-type]
    assert summary["device_best"] == {"ngram": n, "k": k}
    assert summary["device_best_vs_plain"] == ratio
    assert summary["drafting_pays_here"] == (ratio < 1)


def test_agent_bench(cache_root: Path, wide_gguf: Path) -> None:
    from mlxcache.bench import agent_bench

    result = agent_bench.run(
        str(wide_gguf),
        agents=2,
        turns=2,
        system_tokens=80,
        tool_count=3,
        result_tokens=30,
        tokens=64,
        block_size=16,
        baseline=False,
    )
    assert result["routes_same_bytes"] is True and result["agent_0_equals_solo_cold"] is True
    for route in agent_bench.ROUTES:
        first, second = result[route]["per_turn"]
        assert first["resumed"] < second["resumed"] and second["prefilled"] > 0
        # The first of the reply (a call begun) comes before the reply ends.
        assert 0 < second["ttft_p50_s"] <= second["latency_p50_s"]
    assert set(result["goals"]) == {
        "only_new_tokens_prefilled",
        "routes_same_bytes",
        "equals_solo_cold",
    }
    assert result["goals"]["only_new_tokens_prefilled"] is True


def test_memory_bench(cache_root: Path, tmp_path: Path) -> None:
    from tinymodel import write_tiny_gguf

    from mlxcache.bench import memory_bench

    model = tmp_path / "heads.gguf"  # heads of 32: a quantization group fits them
    write_tiny_gguf(model, heads=2, kv_heads=1, context=4096)
    suite = Path(__file__).parent.parent / "examples" / "smoke.yaml"
    settings = memory_bench.SoakSettings(0.2, 3, 2, 2, 4, None, 0.5)
    result = memory_bench.run(
        str(model),
        memory_bench.PARTS,
        settings,
        context_tokens=80,
        cache_mem=16 << 20,
        document_tokens=120,
        suite=suite,
    )
    soak = result["soak"]
    assert soak["errors"] == 0 and soak["replies"] > 0 and soak["samples"] >= 2
    assert soak["replies_checked_cold"] >= 1 and soak["goals"]["replies_equal_cold"] is True
    assert set(soak["goals"]) == {
        "peak_within_limit",
        "flat_once_full",
        "no_errors",
        "replies_equal_cold",
    }
    context = result["context"]
    for width in ("full", "q8", "q4"):
        row = context[width]
        assert row["resumed_from_memory"] == 80 and row["resumed_from_disk"] == 80, width
    assert context["q8"]["kv_bytes_per_token"] < context["full"]["kv_bytes_per_token"]
    assert context["q4"]["kv_bytes_per_token"] < context["q8"]["kv_bytes_per_token"]
    quality = result["quality"]
    assert quality["document_tokens"] == 120
    for width in ("q8", "q4"):
        assert 0 <= quality[width]["greedy_changed_share"] <= 1
        assert 0 <= quality[width]["suite_tokens_changed_share"] <= 1
    assert quality["q8"]["mean_abs_logprob_diff"] <= quality["q4"]["mean_abs_logprob_diff"]


def test_reuse_bench_measures_turns_to_the_token(cache_root: Path) -> None:
    from mlxcache.bench import reuse_bench
    from mlxcache.bench.families import FAMILIES

    *rows, summary = reuse_bench.run(None, 16)
    assert [r["family"] for r in rows] == list(FAMILIES)
    assert all(r["equal_to_no_cache"] for r in rows)
    full = next(r for r in rows if r["family"] == reuse_bench.REFERENCE)
    assert full["reprefilled_per_turn"] == [0, 0, 0]  # its replies' own KV is kept
    kept = {r["family"] for r in rows if r["decode_kv"] == "kept"}
    if mx.default_device() == mx.cpu:  # measured on MLX's CPU backend
        # Sliding windows and the recurrent hybrids whose decode is canonical here keep
        # their replies as full attention does; MLA and Mamba 2 decode otherwise.
        assert kept == set(FAMILIES) - {"deepseek_v3", "nemotron_h"}
    for row in rows:
        assert len(row["reprefilled_per_turn"]) == 3 and row["cold_ttft_vs_mlx_lm"] > 0
        if row["family"] in kept:
            assert row["reprefilled_per_turn"] == [0, 0, 0], row
        else:  # each reply's last partial block, prefilled again: within the goal
            assert 0 < max(row["reprefilled_per_turn"]) < 16, row
    assert summary["pass"], summary["failures"]


def test_adapter_bench(cache_root: Path, tiny_gguf: Path) -> None:
    from mlxcache.bench import adapter_bench

    result = adapter_bench.run(str(tiny_gguf), tokens=4, rounds=1)
    assert result["bench"] == "adapter" and result["same_tokens_as_mlx_lm"] is True
    assert result["vs_mlx_lm"] > 0 and result["vs_base"] > 0 and isinstance(result["pass"], bool)
    assert isinstance(result["fused_same_tokens"], bool)

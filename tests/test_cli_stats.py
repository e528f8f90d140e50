"""The stats line: where the prefix came from (memory, disk), what it saved, a session's measured prefill speed, and what an interrupted prefill kept."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from mlxcache.config import CacheConfig
from mlxcache.events import Prefill, Stats
from mlxcache.model import LoadedModel
from mlxcache.runtime import make_cache
from mlxcache_cli import options as o
from mlxcache_cli import ui
from mlxcache_cli.main import app

runner = CliRunner()


def _stats(**values: Any) -> dict[str, Any]:
    base = Stats(prompt_tokens=37, generated_tokens=7, decode_s=0.6).as_dict()
    return {**base, **values}


class _Bar:
    replying = False


def test_stats_line_names_the_tier_and_the_time_saved(capsys: pytest.CaptureFixture[str]) -> None:
    # A cold prefill of 37 tokens in 3.7 s: 0.1 s a token; 32 cached save 3.2 s, less the
    # 0.04 s their restore took.
    rate = ui.PrefillRate()
    miss = _stats(prefilled_tokens=37, ttft_s=3.7, miss_reason="no cached prefix")
    ui.stats_line(miss, rate)
    hit = _stats(cached_tokens=32, prefilled_tokens=5, restore_s=0.04, ttft_s=0.54)
    ui.stats_line({**hit, "cached_from": "disk"}, rate)
    assert capsys.readouterr().err.splitlines() == [
        "0/37 prompt tokens cached (no cached prefix), 37 prefilled · TTFT 3.70s · "
        "7 tokens at 10.0 tok/s",
        "32/37 prompt tokens cached (disk), 5 prefilled · saved ~3.2 s · TTFT 0.54s · "
        "7 tokens at 10.0 tok/s",
    ]


def test_a_short_resumed_prefill_prices_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 54: 5 tokens resumed after 1,000 cached took 0.5 s (restore, overheads,
    attention over the prefix): 0.1 s a token would claim 100 s saved where the cold prefill
    of those 1,000 took 20 s. A resumed prefill measures nothing; the cold one does."""
    rate = ui.PrefillRate()
    hit = _stats(prompt_tokens=1005, cached_tokens=1000, prefilled_tokens=5, ttft_s=0.5)
    ui.stats_line({**hit, "cached_from": "disk"}, rate)
    cold = _stats(prompt_tokens=1005, prefilled_tokens=1005, ttft_s=20.1)
    ui.stats_line(cold, rate)
    ui.stats_line({**hit, "cached_from": "memory"}, rate)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("1000/1005 prompt tokens cached (disk), 5 prefilled · TTFT 0.50s")
    assert lines[2].startswith(
        "1000/1005 prompt tokens cached (memory), 5 prefilled · saved ~20.0 s · TTFT 0.50s"
    )


@pytest.mark.parametrize(
    ("cold_tokens", "cold_s", "cached", "saved"),
    [
        (37, 3.7, 37, 3.7),  # the same prompt again: its own cold cost
        (37, 3.7, 30, 3.0),  # fewer: a share of it
        (37, 3.7, 38, None),  # more than a short sample covers: unknown
        (ui.EXTRAPOLATE_FROM, 12.8, 1000, 100.0),  # a long sample prices more tokens
        (20, 2.0, 0, None),  # nothing cached
    ],
)
def test_saved_never_claims_more_than_a_cold_prefill_measured(
    cold_tokens: int, cold_s: float, cached: int, saved: float | None
) -> None:
    rate = ui.PrefillRate()
    rate.add(_stats(prefilled_tokens=cold_tokens, ttft_s=cold_s))
    rate.add(_stats(prefilled_tokens=3, ttft_s=0.001))  # a shorter cold one: not the measure
    hit = _stats(cached_tokens=cached, prefilled_tokens=2, ttft_s=0.3)
    assert rate.saved_s(hit) == (None if saved is None else pytest.approx(saved))


def test_a_session_measures_its_prefill_speed_across_turns(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A retry prefills nothing: the speed measured on the first turn prices its prefix."""
    rate = ui.PrefillRate()
    ui.stats_line(_stats(prefilled_tokens=37, ttft_s=3.7, miss_reason="no cached prefix"), rate)
    again = _stats(cached_tokens=37, restore_s=0.01, ttft_s=0.02, cached_from="memory")
    ui.stats_line(again, rate)
    ui.stats_line(again)  # no speed measured in this run: no estimate
    lines = capsys.readouterr().err.splitlines()
    assert lines[1].startswith("37/37 prompt tokens cached (memory), 0 prefilled · saved ~3.7 s")
    assert lines[2].startswith("37/37 prompt tokens cached (memory), 0 prefilled · TTFT 0.02s")


def test_stats_tell_memory_from_disk(tiny: LoadedModel, tmp_path: Path) -> None:
    """The cache says which tier a prefix came from: none, memory, then disk (a new cache
    on the same directory, as a new process)."""
    from mlxcache.engine import Engine, Request
    from mlxcache.sampling import SamplingParams

    config = CacheConfig(block_size=4, directory=tmp_path)
    ids, params = list(range(5, 15)), SamplingParams(max_tokens=2)
    first = Engine(tiny, make_cache(tiny, config))
    assert first.complete(Request(ids, params)).stats.cached_from == ""
    assert first.complete(Request(ids, params)).stats.cached_from == "memory"
    reopened = Engine(tiny, make_cache(tiny, config))
    assert reopened.complete(Request(ids, params)).stats.cached_from == "disk"


def test_generate_says_disk_in_a_new_process_without_a_saving_it_cannot_measure(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    args = ["generate", "--raw", "abcdefghijklmnopqrst", "-m", str(tiny_gguf), "-n", "2"]
    args += ["--block-size", "4", "--cache-dir", str(tmp_path)]
    assert runner.invoke(app, args).exit_code == 0
    again = runner.invoke(app, [*args, "--json"])
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["stats"]["cached_from"] == "disk"
    # No cold prefill ran in this process: nothing prices the cached tokens.
    assert re.fullmatch(
        r"16/19 prompt tokens cached \(disk\), 3 prefilled · TTFT \d+\.\d\ds · "
        r"2 tokens at \d+\.\d tok/s · KV float32\n",
        again.stderr,
    )


def test_keep_note_on_an_interrupted_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    bar = _Bar()
    with pytest.raises(KeyboardInterrupt), o.keep_note(bar, 37, lambda: 32):
        raise KeyboardInterrupt
    bar.replying = True  # past the prefill: the whole prompt is kept, nothing to say
    with pytest.raises(KeyboardInterrupt), o.keep_note(bar, 37, lambda: 37):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt), o.keep_note(_Bar(), 37, lambda: 1 // 0):
        raise KeyboardInterrupt  # a failed lookup says nothing: the interrupt goes on
    assert capsys.readouterr().err == "prefill stopped: 32 of 37 prompt tokens kept for next time\n"


def test_ctrl_c_in_a_prefill_keeps_its_full_blocks(
    tiny: LoadedModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped after its second chunk, a 20-token prompt keeps 8 tokens; the note says so."""
    from mlxcache.engine import Engine, Request

    config = CacheConfig(block_size=4, directory=tmp_path, disk_bytes=0)
    engine = Engine(tiny, make_cache(tiny, config))
    ids = list(range(40, 60))
    events = engine.generate(Request(ids))
    with pytest.raises(KeyboardInterrupt), o.watch(engine, ids, True, events) as seen:
        for event in events:
            seen(event)
            if isinstance(event, Prefill) and event.done == 8:
                raise KeyboardInterrupt  # between two chunks, as a key press may land
    assert capsys.readouterr().err == "prefill stopped: 8 of 20 prompt tokens kept for next time\n"
    assert engine.cache.cached_length(np.asarray(ids)) == 8


def test_stats_line_names_drafting_and_the_kv_width(capsys: pytest.CaptureFixture[str]) -> None:
    """7 tokens, 6 after the first, in 3 verify forwards: 0.50 forwards a token (plain
    decoding makes 1)."""
    drafted = _stats(
        prefilled_tokens=37, ttft_s=3.7, draft="lookup", drafted_tokens=12, accepted_tokens=9
    )
    ui.stats_line({**drafted, "verify_forwards": 3, "kv": "8-bit"})
    ui.stats_line({**drafted, "draft": "", "kv": "float32"})  # not drafted: nothing said
    assert capsys.readouterr().err.splitlines() == [
        "0/37 prompt tokens cached, 37 prefilled · TTFT 3.70s · 7 tokens at 10.0 tok/s · "
        "lookup drafted 12, accepted 9 · 0.50 forwards/token · KV 8-bit",
        "0/37 prompt tokens cached, 37 prefilled · TTFT 3.70s · 7 tokens at 10.0 tok/s · "
        "KV float32",
    ]


def test_quiet_prints_no_stats_line_but_still_measures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rate = ui.PrefillRate()
    ui.stats_line(_stats(prefilled_tokens=37, ttft_s=3.7), rate, quiet=True)
    assert capsys.readouterr().err == ""
    assert rate.saved_s(_stats(cached_tokens=37)) == pytest.approx(3.7)


def test_stats_name_the_kv_width_a_request_ran_with(quantizable: LoadedModel) -> None:
    """Full precision: the model's float type; --kv-bits: its bits."""
    from mlxcache.engine import Engine, Request
    from mlxcache.model.kvquant import quantize_kv
    from mlxcache.sampling import SamplingParams

    request = Request([5, 6, 7], SamplingParams(max_tokens=1))
    plain = Engine(quantizable, block_size=4).complete(request).stats.kv
    eight = quantize_kv(quantizable, 8, 32)
    assert (plain, Engine(eight, block_size=4).complete(request).stats.kv) == ("float32", "8-bit")

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
    # 5 tokens prefilled in 0.5 s (TTFT less restore): 0.1 s a token; 32 cached save 3.2 s,
    # less the 0.04 s their restore took.
    hit = _stats(cached_tokens=32, prefilled_tokens=5, restore_s=0.04, ttft_s=0.54)
    ui.stats_line({**hit, "cached_from": "disk"})
    miss = _stats(prefilled_tokens=37, ttft_s=3.7, miss_reason="no cached prefix")
    ui.stats_line(miss)
    assert capsys.readouterr().err.splitlines() == [
        "32/37 prompt tokens cached (disk), 5 prefilled · saved ~3.2 s · TTFT 0.54s · "
        "7 tokens at 10.0 tok/s",
        "0/37 prompt tokens cached (no cached prefix), 37 prefilled · TTFT 3.70s · "
        "7 tokens at 10.0 tok/s",
    ]


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


def test_generate_says_disk_and_saved_in_a_new_process(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    args = ["generate", "--raw", "abcdefghijklmnopqrst", "-m", str(tiny_gguf), "-n", "2"]
    args += ["--block-size", "4", "--cache-dir", str(tmp_path)]
    assert runner.invoke(app, args).exit_code == 0
    again = runner.invoke(app, [*args, "--json"])
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["stats"]["cached_from"] == "disk"
    assert re.match(
        r"16/\d+ prompt tokens cached \(disk\), \d+ prefilled · saved ~\d+\.\d+ s · TTFT ",
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
